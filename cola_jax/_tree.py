"""What the transforms read of the trees they are given: constraint specs, ``map_params``'s stand-in, nnx Variables.

The per-leaf work on them is :mod:`cola_jax._engine`'s.
"""

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import optax

from cola_jax.constraints.base import Constraint

ConstraintTree = Any  # a prefix of params with Constraint or None leaves
ConstraintSpec = Constraint | ConstraintTree | Callable[[Any], ConstraintTree] | None


class NotParams:
  """A field of the state that holds no copy of the parameters, as ``optax.tree.map_params`` sees it.

  ``map_params`` calls ``init`` with a stand-in for the parameters and maps
  its function over the fields that come back as that stand-in. A transform
  puts this object, a leaf, where its state holds per-leaf auxiliaries that
  are not shaped like the parameters (``constraint_states``), so that
  ``map_params`` hands that whole field to ``transform_non_params``.
  """

  def __repr__(self):
    return "NotParams()"


NOT_PARAMS = NotParams()


@functools.cache
def _placeholder_type() -> type:
  """The type of the stand-in that ``optax.tree.map_params`` passes to ``init``, found through that function."""
  seen = []
  optax.tree_utils.tree_map_params(lambda placeholder: seen.append(type(placeholder)) or (), lambda x: x, ())
  return seen[0]


def is_params_placeholder(params) -> bool:
  """Whether ``init`` was called by ``optax.tree.map_params`` (with its stand-in, not with parameters)."""
  return isinstance(params, _placeholder_type())


def is_function(spec) -> TypeGuard[Callable[[Any], Any]]:
  """Whether ``spec`` (constraints, a mask, radii) is a function of the parameters rather than a tree of them.

  A pytree that is also callable (an Equinox module built with ``jax.tree.map``
  over the model) is a tree: its leaves are the spec, it is not called.
  """
  return callable(spec) and not isinstance(spec, Constraint) and jax.tree_util.treedef_is_leaf(jax.tree.structure(spec))


def without_variables(params):
  """``params`` with flax.nnx Variables replaced by their arrays.

  ``nnx.Optimizer`` initialises the transform on ``Param`` variables but updates
  it with plain arrays; a per-leaf constraint state built inside a Variable
  would come back from nnx as an ``nnx.State`` and no longer match.
  """
  nnx = sys.modules.get("flax.nnx")  # no Variables exist unless nnx is imported
  return params if nnx is None else nnx.as_pure(params)


def hashable(constraint):
  """The constraint, or its identity when a hyperparameter is traced (inject_hyperparams): a key for grouping leaves."""
  try:
    hash(constraint)
  except TypeError:
    return id(constraint)
  return constraint


def equinox_hint(params) -> str:
  """For an error about a leaf that is no floating-point array: the filter an Equinox model needs, if ``params``
  holds one (its flags, numbers and functions are leaves too), else nothing."""
  eqx = sys.modules.get("equinox")
  if eqx is None:
    return ""
  is_module = lambda x: isinstance(x, eqx.Module)
  if not any(is_module(x) for x in jax.tree.leaves(params, is_leaf=is_module)):
    return ""
  return (
    " An Equinox model's fields that are not arrays (Dropout's flag, activation functions) are leaves too: pass "
    "its arrays, eqx.filter(model, eqx.is_array), to init and update (params, static = eqx.partition(model, "
    "eqx.is_array) splits them off), as Equinox's optax examples do."
  )


def broadcast(owner: str, what: str, prefix, params, is_leaf: Callable[[Any], bool], fix: str):
  """``prefix`` broadcast to the structure of ``params`` (``jax.tree.broadcast``), or a ValueError.

  The error names the first path at which ``prefix`` (called ``what``) is
  not a prefix of ``params``, with what the parameters have there; ``fix``
  ends it.
  """
  try:
    return jax.tree.broadcast(prefix, params, is_leaf=is_leaf)
  except ValueError as error:
    difference = _first_difference(what, prefix, params, is_leaf, ()) or str(error)
    raise ValueError(
      f"{owner}: {what} must be a pytree prefix of the parameters (their tree, cut anywhere), but {difference}. {fix}"
    ) from None


def _is_leaf(tree) -> bool:
  """Whether ``tree`` is one leaf (None and empty containers are nodes without children)."""
  structure = jax.tree.structure(tree)
  return jax.tree_util.treedef_is_leaf(structure) and structure.num_leaves == 1


def _level(tree) -> tuple[Any, list]:
  """``tree``'s node: its one-level tree structure and its children by key."""
  children, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
  return treedef, [(path[0], child) for path, child in children]


def _described(tree) -> str:
  if tree is None:
    return "None (no parameters)"
  if _is_leaf(tree):
    return f"a leaf of shape {jnp.shape(tree)}"
  keys = [jax.tree_util.keystr((key,)) for key, _ in _level(tree)[1]]
  shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
  return f"a {type(tree).__name__} of {shown}" if keys else f"an empty {type(tree).__name__}"


def _first_difference(what: str, prefix, full, is_leaf: Callable[[Any], bool], path: tuple) -> str | None:
  """Where ``prefix`` first stops being a prefix of ``full``, in words; None if it is one."""
  if is_leaf(prefix) or _is_leaf(prefix):  # a leaf of the prefix stands for the whole subtree
    return None
  here, there = f"{what}{jax.tree_util.keystr(path)}", f"params{jax.tree_util.keystr(path)}"
  if _is_leaf(full) or type(prefix) is not type(full):
    return f"{here} is a {type(prefix).__name__} where {there} is {_described(full)}"
  prefix_node, prefix_children = _level(prefix)
  full_node, full_children = _level(full)
  prefix_keys, full_keys = [key for key, _ in prefix_children], [key for key, _ in full_children]
  missing = [key for key in full_keys if key not in prefix_keys]
  if missing:
    return f"{here} has no {jax.tree_util.keystr((missing[0],))}: {there} is {_described(full)}"
  extra = [key for key in prefix_keys if key not in full_keys]
  if extra:
    return (
      f"{what}{jax.tree_util.keystr(path + (extra[0],))} is not among the parameters: {there} is {_described(full)}"
    )
  if prefix_keys != full_keys or prefix_node != full_node:
    return f"{here} is a {type(prefix).__name__} of other fields than {there}, {_described(full)}"
  for (key, prefix_child), (_, full_child) in zip(prefix_children, full_children):
    found = _first_difference(what, prefix_child, full_child, is_leaf, path + (key,))
    if found is not None:
      return found
  return None
