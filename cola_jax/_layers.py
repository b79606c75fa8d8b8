"""The layer that holds each leaf, as far as the parameter tree shows it, and what a per-unit default reads there.

A Flax parameter tree (linen's nested dicts, an ``nnx.State``) shows its
layers only in its leaves' names: ``kernel`` is the weight of a ``Dense``, an
``nnx.Linear``, a ``Conv`` or an attention projection, laid out
``(..., in, out)``, and ``embedding`` the table of ``nn.Embed`` and
``nnx.Embed``. An Equinox parameter tree is the filtered model itself, so each
leaf sits in its module: ``eqx.nn.Linear``, ``Conv`` and ``ConvTranspose``
hold their ``weight`` as ``(out, in, ...)``, outputs first, and
``eqx.nn.Embedding`` its table as ``weight``. Equinox is read only where the
model's code imported it (no Equinox module exists otherwise).
"""

import dataclasses
import sys

import jax

from cola_jax import _warn
from cola_jax.constraints._axes import _names
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.max_norm import MaxNorm
from cola_jax.constraints.unit_norm import UnitNorm

KERNEL = "kernel"  # a Flax kernel (..., in, out): the outputs last
WEIGHT = "weight"  # an Equinox Linear or Conv weight (out, in, ...): the outputs first
TABLE = "table"  # an embedding table (vocab, d), Flax's or Equinox's


def _equinox_layers() -> dict[type, str]:
  eqx = sys.modules.get("equinox")
  if eqx is None:
    return {}
  return {eqx.nn.Linear: WEIGHT, eqx.nn.Conv: WEIGHT, eqx.nn.ConvTranspose: WEIGHT, eqx.nn.Embedding: TABLE}


_BOX_FIELDS = ("value", "raw_value")  # what an nnx Variable, a linen box and cola's Constrained hold their array as


def _by_name(path) -> str | None:
  keys = list(path)
  while keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name in _BOX_FIELDS:
    keys.pop()
  names = _names(jax.tree_util.keystr(tuple(keys)))
  return {"kernel": KERNEL, "embedding": TABLE}.get(names[-1]) if names else None


def of_leaves(params, is_leaf=None) -> list[str | None]:
  """Per leaf of ``params`` flattened with ``is_leaf``: ``KERNEL``, ``WEIGHT``, ``TABLE``, or None (not known)."""
  layers = _equinox_layers()
  classes = tuple(layers)
  stop = lambda x: isinstance(x, classes) or (is_leaf is not None and is_leaf(x))
  out = []
  for path, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=stop)[0]:
    kind = next((kind for cls, kind in layers.items() if isinstance(node, cls)), None)
    if kind is None:
      out.append(_by_name(path))
      continue
    for inner, _ in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_leaf)[0]:
      out.append(kind if inner and getattr(inner[0], "name", None) == "weight" else None)
  return out


def read_in(constraint: Constraint, layer: str | None, shape: tuple[int, ...], path: str) -> Constraint:
  """``constraint`` as it reads a leaf of ``shape`` held by ``layer``.

  ``UnitNorm`` and ``MaxNorm`` without ``axis`` norm each output unit's
  incoming weights: every axis but the last of a Flax kernel (the constraint
  as it is), every axis but the first of an Equinox weight (the constraint
  with those axes). A matrix in no layer whose layout is known (a bare array,
  a leaf not named ``kernel``, an embedding table) is read as a Flax kernel,
  and named in a warning.
  """
  if not isinstance(constraint, (MaxNorm, UnitNorm)) or constraint.axis is not None or len(shape) < 2:
    return constraint
  if layer == WEIGHT:
    return dataclasses.replace(constraint, axis=tuple(range(1, len(shape))))
  if layer != KERNEL and len(shape) == 2 and 0 not in shape:  # a leaf without entries is left free
    name = type(constraint).__name__
    spell = lambda axis: f"{name}({constraint.radius!r}, axis={axis})"

    def compose(leaves: str, count: int) -> str:
      where = "the parameters (one array)" if not path else f"the leaf at {leaves}" if count == 1 else leaves
      where = where if count == 1 else f"{count} leaves, {where}"
      return (
        f"{name} constraint on {where}, of shape {shape}: a matrix in no layer whose layout is known (a Flax "
        f"kernel, an Equinox Linear or Conv weight), read as a Flax kernel (in, out): one unit per column. One unit "
        f"per row (an (out, in) weight, a token's embedding): {spell(-1)}; {spell(0)} keeps this reading and "
        "silences this."
      )

    _warn.warn_about((name, constraint.radius, shape, "no layer"), path, compose)
  return constraint
