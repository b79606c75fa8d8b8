"""Axis arguments of the constraints: normalisation, validation and the batched views.

A constraint that acts on parts of a leaf (one unit, one matrix) names the
axes of a part; the other axes index the parts. The parts are brought to the
front as one leading axis of size ``prod(other sizes)`` (the parts in the
row-major order of the other axes) so that the geometry of one part can be
``jax.vmap``-ed over them.
"""

import math
import operator


def normalize(owner: str, name: str, value) -> tuple[int, ...] | None:
  """``None``, or ``value`` (an int or a sequence of ints) as a non-empty tuple without repeats."""
  if value is None:
    return None
  items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
  message = f"{owner}: {name} must be None, an int or a tuple of ints, got {value!r}."
  out = []
  for item in items:
    if isinstance(item, bool):
      raise TypeError(message)
    try:
      out.append(operator.index(item))
    except TypeError:
      raise TypeError(message) from None
  if not out:
    raise ValueError(f"{owner}: {name} must name at least one axis, got {value!r}.")
  if len(set(out)) != len(out):
    raise ValueError(f"{owner}: {name} {value!r} repeats an axis.")
  return tuple(out)


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
