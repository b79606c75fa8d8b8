"""Axis arguments of the constraints: normalisation, validation, the batched views, and the ambiguous default.

A constraint that acts on parts of a leaf (one unit, one matrix) names the
axes of a part; the other axes index the parts. The parts are brought to the
front as one leading axis of size ``prod(other sizes)`` (the parts in the
row-major order of the other axes) so that the geometry of one part can be
``jax.vmap``-ed over them.

Without axes, a matrix constraint reads a leaf as a kernel whose last axis
indexes the outputs and whose other axes the inputs: right for Dense and conv
kernels, wrong for a multi-head attention kernel or a stack of layers, which
have three axes too. :func:`warn_if_ambiguous` says so where the leaf's path
is known.
"""

import math
import operator
import re
from collections.abc import Callable

from cola_jax import _warn


def _ints(items, message: str) -> list[int]:
  """``items`` as Python ints (``operator.index``; a bool is no axis), or a TypeError of ``message``."""
  if any(isinstance(item, bool) for item in items):
    raise TypeError(message)
  try:
    return [operator.index(item) for item in items]
  except TypeError:
    raise TypeError(message) from None


def normalize(owner: str, name: str, value) -> tuple[int, ...] | None:
  """``None``, or ``value`` (an int or a sequence of ints) as a non-empty tuple without repeats."""
  if value is None:
    return None
  items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
  message = f"{owner}: {name} must be None, an int or a tuple of ints, got {value!r}."
  out = _ints(items, message)
  if not out:
    raise ValueError(f"{owner}: {name} must name at least one axis, got {value!r}.")
  if len(set(out)) != len(out):
    raise ValueError(f"{owner}: {name} {value!r} repeats an axis.")
  return tuple(out)


def matrix_axes(owner: str, row_axes, column_axes) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
  """``row_axes`` and ``column_axes`` normalised: both None, or two groups that share no axis."""
  rows = normalize(owner, "row_axes", row_axes)
  columns = normalize(owner, "column_axes", column_axes)
  if (rows is None) != (columns is None):
    raise ValueError(
      f"{owner}: give both row_axes and column_axes (every other axis is batched), "
      f"or neither; got row_axes={row_axes!r}, column_axes={column_axes!r}."
    )
  if rows is not None and columns is not None and set(rows) & set(columns):
    raise ValueError(f"{owner}: row_axes {row_axes!r} and column_axes {column_axes!r} share an axis.")
  return rows, columns


def blocks(owner: str, value) -> tuple[int, int] | None:
  """``None``, or ``value``, a pair of positive ints ``(row blocks, column blocks)``, as a tuple."""
  if value is None:
    return None
  message = (
    f"{owner}: blocks must be None or a pair of ints (row blocks, column blocks), such as (heads, 1), got {value!r}."
  )
  if not isinstance(value, (list, tuple)):
    raise TypeError(message)
  out = _ints(value, message)
  if len(out) != 2 or min(out) < 1:
    raise ValueError(
      f"{owner}: blocks must be two positive ints (row blocks, column blocks), such as (heads, 1), got {value!r}."
    )
  return out[0], out[1]


def resolve(where: str, shape: tuple[int, ...], **named: tuple[int, ...]) -> dict:
  """The named axis groups of a leaf of ``shape``, non-negative and sorted.

  Raises ValueError starting with ``where`` (which names the leaf) for an axis
  out of range or an axis named twice, within a group or across groups.
  """
  ndim = len(shape)
  out, seen = {}, {}
  for name, axes in named.items():
    bad = [a for a in axes if not -ndim <= a < ndim]
    if bad:
      raise ValueError(
        f"{where}: {name}={axes!r} is out of range for a leaf of rank {ndim} (axes count from -{ndim} to {ndim - 1})."
      )
    resolved = tuple(sorted(a % ndim for a in axes))
    for a in resolved:
      if a in seen:
        raise ValueError(
          f"{where}: axis {a} is named twice ({seen[a]} and {name}); "
          f"{', '.join(f'{k}={v!r}' for k, v in named.items())}."
        )
      seen[a] = name
    out[name] = resolved
  return out


def others(ndim: int, *groups: tuple[int, ...]) -> tuple[int, ...]:
  """The axes of a rank-``ndim`` leaf named by none of ``groups``, in order."""
  named = set().union(*groups)
  return tuple(a for a in range(ndim) if a not in named)


def to_parts(x, batch: tuple[int, ...], part: tuple[int, ...]):
  """``x`` with the ``batch`` axes flattened to one leading axis, then the ``part`` axes."""
  moved = x.transpose(batch + part)
  return moved.reshape((math.prod(x.shape[a] for a in batch),) + moved.shape[len(batch) :])


def from_parts(parts, shape: tuple[int, ...], batch: tuple[int, ...], part: tuple[int, ...]):
  """Inverse of :func:`to_parts` for a leaf of ``shape``."""
  order = batch + part
  moved = parts.reshape(tuple(shape[a] for a in order))
  inverse = sorted(range(len(order)), key=order.__getitem__)
  return moved.transpose(inverse)


_KEY = re.compile(r"\['(?P<key>[^']*)'\]|\.(?P<attribute>\w+)")
_IN_PROJECTIONS = ("query", "key", "value")


def _names(path: str) -> list[str]:
  """The dict keys and attribute names of a path as ``jax.tree_util.keystr`` writes it (an nnx Variable's last
  ``.value`` dropped): ``"['attn']['query']['kernel']"`` gives ``['attn', 'query', 'kernel']``."""
  parts = [(m["key"], m["attribute"]) for m in _KEY.finditer(path)]
  if parts and parts[-1][1] == "value":
    parts.pop()
  return [key if key is not None else attribute for key, attribute in parts]


def warn_if_ambiguous(what: str, shape: tuple[int, ...], path: str, spell: Callable[..., str], units: bool = False):
  """Warns, naming the leaf, when a 3-D leaf's default view (inputs first, outputs last) is no matrix it holds.

  Flax's attention kernels are recognised by their paths. A ``query``,
  ``key`` or ``value`` kernel ``(features, heads, head_dim)`` is viewed as
  one ``(features * heads, head_dim)`` matrix, neither per head nor per
  layer: the warning spells both. An ``out`` kernel ``(heads, head_dim,
  features)`` is viewed as the layer's ``(heads * head_dim, features)``
  matrix and passes quietly, as does a leaf whose path mentions ``conv``
  (``Conv_0``, ``conv1``): a 1-D conv kernel ``(width, in, out)``, the
  default's own reading. The leaves with the same misuse make one warning
  (:mod:`cola_jax._warn`).

  ``spell(rows, columns)`` writes a matrix constraint with those axes;
  ``units``: the constraint norms units (``UnitNorm``, ``MaxNorm``) and
  ``spell(axis)`` writes it normed over those axes.
  """
  if len(shape) != 3:
    return
  names = _names(path)
  layer = names[-2] if len(names) >= 2 and names[-1] == "kernel" else None
  if layer == "out" or any("conv" in name.lower() for name in names):
    return
  if layer in _IN_PROJECTIONS:
    kind = ("Flax attention kernel", "Flax attention kernels", " (features, heads, head_dim)")
    if units:
      view = "norms each over its features and heads together, one unit per head_dim index"
      fixes = (
        f"Per head: {spell('(0, 2)')}, each head's (features, head_dim) matrix one unit; per layer: {spell('0')}, "
        "each column of its (features, heads * head_dim) matrix (and so of each head's)."
      )
    else:
      view = f"views each as one (features * heads, head_dim) matrix, ({shape[0] * shape[1]}, {shape[2]}) for {shape}"
      fixes = f"Per head: {spell('0', '2')}; per layer: {spell('0', '(1, 2)')}."
    fixes = f"neither per head nor per layer. {fixes}"
  else:
    kind = ("3-D leaf", "3-D leaves", "")
    if units:
      view = "norms each over its axes 0 and 1, one unit per index of axis 2, as a 1-D conv kernel (width, in, out)"
      fixes = f"per index of axis 0, each column of its matrix: {spell('1')}; {spell('(0, 1)')}"
    else:
      view = f"views each as one ({shape[0] * shape[1]}, {shape[2]}) matrix for {shape}, as a 1-D conv kernel"
      view += " (width, in, out)"
      fixes = f"one matrix per index of axis 0: {spell('1', '2')}; {spell('(0, 1)', '2')}"
    fixes = f"a multi-head kernel or a stack of layers is not that. Name the axes, e.g. {fixes} keeps this view"
    fixes += " and silences this."

  def compose(leaves: str, count: int) -> str:
    many = f"{count} {kind[1]}" if count > 1 else f"one {kind[0]}"
    return f"{what} with its default axes on {many}{kind[2]}: {leaves}. It {view}: {fixes}"

  _warn.warn_about((what, kind, fixes), path, compose)
