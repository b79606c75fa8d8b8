"""The units of a leaf in the leaf's own layout, without moving its axes.

A leaf is a collection of units: the entries along the *unit* axes, one unit
per index of the *other* axes (the columns of a Dense kernel ``(in, out)`` for
unit axes ``(0,)``; the whole leaf when every axis is a unit axis). A function
of one unit is applied to every unit by ``jax.vmap`` over the other axes where
they lie, and per-unit reductions run over the unit axes, so that no array of
the leaf's size is transposed into a ``(units, unit size)`` layout (on XLA:CPU
each such transpose costs about as much as the whole per-unit geometry).
Per-unit values are arrays ``(*other shape, ...)``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from cola_jax.constraints import _axes


@dataclasses.dataclass(frozen=True)
class UnitLayout:
  """The unit axes ``unit`` (sorted, non-negative) of a leaf of ``shape``; the other axes index the units."""

  shape: tuple[int, ...]
  unit: tuple[int, ...]

  @property
  def others(self) -> tuple[int, ...]:
    return _axes.others(len(self.shape), self.unit)

  @property
  def other_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.others)

  @property
  def unit_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.unit)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def map(self, fn):
    """``x -> fn(unit)`` for every unit of a leaf-shaped ``x``, stacked as ``(*other shape, *out shape)``."""
    # The outermost vmap takes the first other axis; each inner one sees the
    # leaf without the axes taken outside it, all of which precede its own.
    for depth, axis in reversed(list(enumerate(self.others))):
      fn = jax.vmap(fn, in_axes=axis - depth)
    return fn

  def spread(self, per_unit: jax.Array) -> jax.Array:
    """``(*other shape)`` values broadcastable against leaf-shaped arrays."""
    return jnp.expand_dims(per_unit, self.unit)

  def all(self, mask: jax.Array) -> jax.Array:
    """Per unit ``(*other shape)``: whether the leaf-shaped ``mask`` holds on every entry of the unit."""
    return jnp.all(mask, axis=self.unit)
