"""Elementwise numerics shared by the constraints."""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

# pi/2 split into three float32 parts whose products with small integers are
# exact (Cody-Waite range reduction).
_PIO2_HI = np.float32(1.5703125)
_PIO2_MID = np.float32(4.837512969970703125e-4)
_PIO2_LO = np.float32(7.54978995489188216e-8)


def sincos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns ``(sin(x), cos(x))`` to float32 accuracy, in plain arithmetic.

  XLA's CPU backend evaluates ``jnp.sin`` and ``jnp.cos`` as two separate
  scalar-heavy expansions and, inside a multi-output update, computes each of
  them once per output. This version reduces ``x = k pi/2 + y`` with
  ``|y| <= pi/4`` and evaluates minimax polynomials for sin and cos on the
  reduced argument, so XLA vectorises and fuses it like any product or sum.
  Absolute error <= 1.2e-7 for float32 arguments with ``|x| <= 100`` (tested).
  Other float dtypes fall back to ``jnp.sin`` and ``jnp.cos``.
  """
  if x.dtype != jnp.float32:
    return jnp.sin(x), jnp.cos(x)
  k = jnp.round(x * np.float32(2 / np.pi))
  y = x - k * _PIO2_HI - k * _PIO2_MID - k * _PIO2_LO
  y2 = y * y
  sin_y = y + y * y2 * (
      np.float32(-1.6666654611e-1)
      + y2 * (np.float32(8.3321608736e-3) + y2 * np.float32(-1.9515295891e-4)))
  cos_y = (1 - 0.5 * y2) + y2 * y2 * (
      np.float32(4.166664568298827e-2)
      + y2 * (np.float32(-1.388731625493765e-3)
              + y2 * np.float32(2.443315711809948e-5)))
  quadrant = k.astype(jnp.int32) & 3
  odd = (quadrant & 1) == 1
  sin_x = jnp.where(odd, cos_y, sin_y)
  cos_x = jnp.where(odd, sin_y, cos_y)
  sin_x = jnp.where(quadrant >= 2, -sin_x, sin_x)
  cos_x = jnp.where((quadrant == 1) | (quadrant == 2), -cos_x, cos_x)
  return sin_x, cos_x


def inverse_sqrt(z: jax.Array) -> jax.Array:
  """Returns ``1 / sqrt(z)`` for ``z > 0`` to float32 accuracy, in plain arithmetic.

  XLA's CPU backend treats ``sqrt``, ``rsqrt`` and floating-point division as
  expensive: a value computed with them that feeds several outputs of an
  elementwise update is written to its own array and read back by each,
  which costs more than the arithmetic. This version uses only bit
  operations, multiplications and additions, which XLA fuses into every
  consumer: an initial guess from the exponent bits, one Newton step (relative
  error <= 1.8e-3) and one second-order step ``y (1 - e/2 + 3 e^2/8)`` with
  ``e = z y^2 - 1`` (error <= 4 e^3 / 16 < 1e-8, below float32 rounding).
  Valid for normal float32 ``z``; ``z = 0`` gives a finite, meaningless
  value (callers handle it). Other float dtypes fall back to ``lax.rsqrt``.
  """
  if z.dtype != jnp.float32:
    return jax.lax.rsqrt(z)
  bits = jax.lax.bitcast_convert_type(z, jnp.int32)
  y = jax.lax.bitcast_convert_type(np.int32(0x5F375A86) - (bits >> 1), jnp.float32)
  y = y * (np.float32(1.5) - np.float32(0.5) * z * y * y)
  e = z * y * y - 1
  return y - y * e * (np.float32(0.5) - np.float32(0.375) * e)


@jax.custom_jvp
def computed_together(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """The arrays (all of one shape), unchanged, computed in one pass over their entries.

  XLA's CPU backend has no multi-output loop fusion: each array that several
  consumers need is recomputed inside each consumer's loop (or written out
  piecewise, where it contains a ``log`` or ``sqrt``). A variadic reduction is
  one loop with several results, so on CPU the arrays are returned as sums over
  a trailing axis of length two whose second entries are zeros (``x + 0`` is
  ``x``, up to the sign of a zero): every intermediate they share is computed
  once and each array is written to memory once. Other backends fuse
  multi-output loops themselves and get the arrays as they are.
  """
  if jax.default_backend() != "cpu" or not arrays:
    return arrays
  padded = tuple(jnp.stack([x, jnp.zeros_like(x)], axis=-1) for x in arrays)
  zeros = tuple(np.zeros((), x.dtype) for x in arrays)
  return tuple(jax.lax.reduce(
      padded, zeros, lambda a, b: tuple(u + v for u, v in zip(a, b)), (arrays[0].ndim,)))


@computed_together.defjvp
def _computed_together_jvp(primals, tangents):
  return computed_together(*primals), tuple(tangents)


def concrete_float(value: Any) -> Optional[float]:
  """The value as a Python float when it is known now, else None.

  Hyperparameters may arrive as traced arrays (under ``jit`` or
  ``optax.inject_hyperparams``) or as schedules; those cannot be checked at
  construction and are left to the caller.
  """
  if callable(value):
    return None
  try:
    return float(value)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def explicit_sharding(x: jax.Array):
  """``x``'s sharding when its mesh has explicit axes, else None.

  For ``out_sharding=``: under explicit sharding an array created from a shape
  alone (noise) is replicated unless told otherwise, so every device would
  draw the whole array; with auto axes (or no mesh) XLA partitions it itself.
  """
  sharding = jax.typeof(x).sharding
  return sharding if sharding.mesh.explicit_axes else None
