"""What the transforms read of the trees they are given: constraint specs, ``map_params``'s stand-in, nnx Variables.

The per-leaf work on them is :mod:`cola_jax._engine`'s.
"""

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
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
