"""The leaves an entry constrains when it is not told which: one rule for every entry.

``c_cola_*`` and ``o_cola_*`` without ``mask=`` or ``constraints=``, and
``hyperspherical_descent`` and ``manifold_muon`` without ``constraints=``,
constrain the weight matrices: every leaf with ``ndim >= 2`` except biases,
scales and embedding tables. Flax linen and nnx tell them apart by name
(``kernel``, ``bias``, ``scale``, ``embedding``); Equinox calls a Linear's
matrix and an Embedding's table both ``weight``, and the table is told by its
module, ``eqx.nn.Embedding`` (:mod:`cola_jax._layers`); a leaf or a layer whose
name says ``embed`` holds a table too. Parameters that are one array are that
array. The choice is said where it is made: more than
one leaf taken is a ``UserWarning`` naming them, none an error. Within
``optax.masked`` or ``optax.partition`` the labels chose already: every leaf
routed there with ``ndim >= 2`` is taken, names aside, and nothing is said.
"""

import re

import jax
import jax.numpy as jnp
import optax

from cola_jax import _layers, _warn
from cola_jax.declared import is_box
from cola_jax.path_rules import _path_name

_FREE_LEAF = re.compile("bias|scale|embed", re.IGNORECASE)  # the name of a bias, a norm's scale, a table
_FREE_LAYER = re.compile("embed", re.IGNORECASE)  # an embedding layer, whatever it calls its table


def _is_matrix(leaf) -> bool:
  arrays = jax.tree.leaves(leaf)  # a Flax box or Variable holds its array
  return len(arrays) == 1 and jnp.ndim(arrays[0]) >= 2


def _is_weight_matrix(name: str, leaf, held_by: str | None) -> bool:
  if not name:  # the parameters are this one array
    return True
  *layer, last = name.split("/")
  free = held_by == _layers.TABLE or _FREE_LEAF.search(last) or (layer and _FREE_LAYER.search(layer[-1]))
  return _is_matrix(leaf) and not free


def _within_masked(params) -> bool:
  """Whether ``params`` is the group that ``optax.masked`` or ``optax.partition`` chose: the user's choice already."""
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  return any(is_masked(x) for x in jax.tree.leaves(params, is_leaf=is_masked))


def weight_matrices(owner: str, params, constraint: str | None, instead: str):
  """The rule's choice of leaves of ``params``: a pytree of bools (Flax boxes and Variables as leaves).

  Warns naming the leaves taken when there are more than one, raises when
  there is none. ``constraint`` spells the entry's constraint and ``instead``
  the arguments that choose the leaves, for the messages' one-line fix;
  ``constraint=None``: the user named the leaves otherwise (a radius per
  leaf), and nothing is said.
  """
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)
  if _within_masked(params):
    return treedef.unflatten([_is_matrix(leaf) for _, leaf in paths_and_leaves])
  names = [_path_name(path) for path, _ in paths_and_leaves]
  layers = _layers.of_leaves(params, is_leaf=is_box)
  chosen = [_is_weight_matrix(name, leaf, held) for name, (_, leaf), held in zip(names, paths_and_leaves, layers)]
  taken = [name for name, take in zip(names, chosen) if take]
  if constraint is not None and names and len(taken) != 1:
    example = taken[0] if taken else names[0]
    fix = f"constraints=cola.path_constraints([(r'{re.escape(example)}$', {constraint})])"
    if not taken:
      raise ValueError(
        f"{owner}: not told which leaves to constrain (no {instead}), it takes the weight matrices (every leaf "
        f"with ndim >= 2 but biases, scales and embedding tables), and these parameters have none: "
        f"{_warn.named(names)}. Say which leaves to constrain, e.g. {fix}."
      )
    _warn.warn(
      f"{owner}: not told which leaves to constrain (no {instead}), it constrains these {len(taken)}: "
      f"{_warn.named(taken)}. The default of every entry: each leaf with ndim >= 2 but biases, scales and embedding "
      f"tables, the first and last layers included. Say which, e.g. {fix}; any {instead} silences this."
    )
  return treedef.unflatten(chosen)
