"""Elementwise numerics shared by the constraints."""

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax import _platform

# pi/2 split into three float32 parts whose products with small integers are
# exact (Cody-Waite range reduction): k * _PIO2_HI and k * _PIO2_MID are exact
# for k < 2**13, so the reduction is exact for |x| < FAST_SINCOS_LIMIT.
_PIO2_HI = np.float32(1.5703125)
_PIO2_MID = np.float32(4.837512969970703125e-4)
_PIO2_LO = np.float32(7.54978995489188216e-8)
FAST_SINCOS_LIMIT = np.float32(2.0**13)
# 1.5 * 2**23: for |v| < 2**22, v + _ROUNDER rounds v to the nearest integer k
# (the float32 spacing there is 1), and the low bits of its bit pattern are those
# of k (two's complement: 2**22 + k in the mantissa).
_ROUNDER = np.float32(1.5 * 2**23)
_ROUNDER_BITS = np.float32(1.5 * 2**23).view(np.int32)
# Above pi/4 by what Cody-Waite can leave below FAST_SINCOS_LIMIT: k = round(x 2/pi) is taken from the float32
# product, which for |x 2/pi| < 5216 errs by half its spacing (2**-11) and 2/pi's rounding (3.1e-4), so |y| may
# exceed pi/4 by (4.9e-4 + 3.1e-4) pi/2 < 1.3e-3. The polynomials hold their 1.2e-7 to |y| = 0.7875.
_QUARTER_TURN = np.float32(0.7867)


def _two_over_pi(bits: int) -> int:
  """``floor(2**bits * 2 / pi)``, from Machin's formula in integer arithmetic."""
  one = 1 << (bits + 64)  # 64 guard bits

  def arctan_inverse(n):  # one * arctan(1 / n)
    total, term, k, sign = 0, one // n, 1, 1
    while term:
      total += sign * (term // k)
      term //= n * n
      k, sign = k + 2, -sign
    return total

  pi = 4 * (4 * arctan_inverse(5) - arctan_inverse(239))
  return (2 * one << bits) // pi


# Payne-Hanek reduction of float32 x = M 2**e (M < 2**24 an integer, e in
# [_E_MIN, _E_MAX], i.e. 2**13 <= |x| < 2**128): x 2/pi = M (2**e 2/pi mod 4)
# mod 4. Row e - _E_MIN holds 2**e 2/pi mod 4 in five float32 parts, four of
# 12 bits at the weights 2**1..2**-10, 2**-11..2**-22, 2**-23..2**-34,
# 2**-35..2**-46, and the next 24 bits, so that the products with the 12-bit
# halves of M that matter are exact.
_E_MIN, _E_MAX = -10, 104
_FRACTION_BITS = 70


def _quarter_turn_table() -> np.ndarray:
  bits = _E_MAX + _FRACTION_BITS + 4
  two_over_pi = _two_over_pi(bits)
  rows = []
  for e in range(_E_MIN, _E_MAX + 1):
    f = (two_over_pi >> (bits - e - _FRACTION_BITS)) & ((4 << _FRACTION_BITS) - 1)
    parts = [(f >> (_FRACTION_BITS - 10)) * 2.0**-10]
    for low in (22, 34, 46):
      parts.append(((f >> (_FRACTION_BITS - low)) & 0xFFF) * 2.0**-low)
    parts.append((f & ((1 << (_FRACTION_BITS - 46)) - 1)) * 2.0**-_FRACTION_BITS)
    rows.append(parts)
  table = np.array(rows)
  assert np.all(table.astype(np.float32) == table)
  return table.astype(np.float32)


_QUARTER_TURNS = _quarter_turn_table()


def _mod4(v):
  """``v`` minus the nearest multiple of 4 (exact: the result has fewer bits)."""
  return v - 4 * jnp.round(v * np.float32(0.25))


def _reduce_large(x):
  """``(y, k)`` with ``x = k pi/2 + y``, ``|y| <= pi/4``, for float32 ``|x| >= 2**13``.

  Exact reduction (Payne-Hanek): the quarter turns ``x 2/pi mod 4`` are
  summed from exact products of 12-bit parts, with an absolute error below
  ``2**-33``. Only the quadrant ``k mod 4`` of ``k`` is meaningful.
  """
  ax = jnp.abs(x)
  bits = jax.lax.bitcast_convert_type(ax, jnp.int32)
  row = jnp.clip((bits >> 23) - 150 - _E_MIN, 0, _QUARTER_TURNS.shape[0] - 1)
  m = ((bits & 0x7FFFFF) | 0x800000).astype(jnp.float32)
  c0, c1, c2, c3, c4 = (jnp.asarray(_QUARTER_TURNS[:, j])[row] for j in range(5))
  m_high = jnp.floor(m * np.float32(2.0**-12)) * np.float32(2.0**12)
  m_low = m - m_high  # m_high * c0 is a multiple of 4: left out
  turns = _mod4(_mod4(_mod4(m_low * c0) + _mod4(m_high * c1)) + _mod4(_mod4(m_low * c1) + _mod4(m_high * c2)))
  small = (m_low * c2 + m_high * c3) + (m_low * c3 + m * c4)
  k = jnp.round(turns + small)
  y = ((turns - k) + small) * np.float32(np.pi / 2)
  y = jnp.where(ax <= np.finfo(np.float32).max, y, np.float32(np.nan))  # inf: NaN
  negative = x < 0
  return jnp.where(negative, -y, y), jnp.where(negative, -k, k)


def sincos_of_quarter_turns(y, quadrant):
  """``sin`` and ``cos`` of ``k pi/2 + y`` for float32 ``|y| <= pi/4`` (minimax polynomials).

  ``quadrant`` is an int32 whose two low bits are ``k mod 4``. The quadrant
  swaps sine and cosine (odd ``k``) and flips their sign bits (an xor), which
  costs a few integer operations instead of comparisons and selects.
  """
  y2 = y * y
  sin_y = y + y * y2 * (
    np.float32(-1.6666654611e-1) + y2 * (np.float32(8.3321608736e-3) + y2 * np.float32(-1.9515295891e-4))
  )
  cos_y = (1 - 0.5 * y2) + y2 * y2 * (
    np.float32(4.166664568298827e-2) + y2 * (np.float32(-1.388731625493765e-3) + y2 * np.float32(2.443315711809948e-5))
  )
  odd = (quadrant & 1) != 0
  sin_x = jnp.where(odd, cos_y, sin_y)
  cos_x = jnp.where(odd, sin_y, cos_y)
  # sin(k pi/2 + y) is negative-signed for k mod 4 in {2, 3}, cos for k mod 4 in {1, 2}.
  sign = np.int32(-(2**31))
  sin_sign = (quadrant << 30) & sign
  cos_sign = ((quadrant + 1) << 30) & sign
  return _flip_sign(sin_x, sin_sign), _flip_sign(cos_x, cos_sign)


def _flip_sign(x, sign_bit):
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.int32) ^ sign_bit, jnp.float32)


def _cody_waite(x):
  """``(y, quadrant)`` with ``x = k pi/2 + y``, ``k = round(x 2/pi)``, exact for ``|x| < 2**13``.

  ``x 2/pi + _ROUNDER`` holds ``k`` in its low bits: the quadrant is read from
  them and ``k`` converted from them as an integer (XLA:CPU rounds and
  converts a float to an integer with several comparisons for saturation; and
  it would fold ``(v + _ROUNDER) - _ROUNDER`` back to ``v``). Past ``2**22``
  quarter turns ``k`` and the quadrant are meaningless, as is the reduction
  (see :func:`sincos_fast`); ``inf`` and NaN give a NaN ``y``.
  """
  bits = jax.lax.bitcast_convert_type(x * np.float32(2 / np.pi) + _ROUNDER, jnp.int32)
  k = (bits - _ROUNDER_BITS).astype(jnp.float32) + x * 0  # x * 0: NaN for an infinite x
  y = x - k * _PIO2_HI - k * _PIO2_MID - k * _PIO2_LO
  return y, bits


def sincos_fast(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(sin(x), cos(x))`` in plain arithmetic, accurate for ``|x| < FAST_SINCOS_LIMIT``.

  XLA's CPU backend evaluates ``jnp.sin`` and ``jnp.cos`` as two separate
  scalar-heavy expansions and, inside a multi-output update, computes each of
  them once per output. This version reduces ``x = k pi/2 + y`` with
  ``|y| <= pi/4`` (Cody-Waite, exact for ``|x| < 2**13``) and evaluates
  minimax polynomials for sin and cos on the reduced argument, so XLA
  vectorises and fuses it like any product or sum. Absolute error <= 1.2e-7
  for float32 ``|x| < 2**13``. Larger arguments get a wrong angle (use
  :func:`sincos` for the exact one) but still a rotation: the reduced argument
  is clamped to ``[-pi/4, pi/4]``, so ``sin^2 + cos^2 = 1`` to rounding for
  every finite ``x``; ``inf`` and NaN give NaN. Other float dtypes use
  ``jnp.sin`` and ``jnp.cos``.
  """
  if x.dtype != jnp.float32:
    return jnp.sin(x), jnp.cos(x)
  y, quadrant = _cody_waite(x)
  return sincos_of_quarter_turns(jnp.clip(y, -_QUARTER_TURN, _QUARTER_TURN), quadrant)


def sincos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(sin(x), cos(x))`` for every finite ``x``, in plain arithmetic.

  As :func:`sincos_fast` for ``|x| < 2**13``; larger float32 arguments are
  reduced exactly (Payne-Hanek, with ``2/pi`` to 178 bits), so the values are
  those of the exact sine and cosine of the float32 ``x`` to an absolute
  error <= 1.2e-7 up to ``3.4e38`` (tested against float64), and
  ``sin^2 + cos^2 = 1`` to rounding. ``inf`` and NaN give NaN. The exact
  reduction costs about as much as the rest of a fused update on every entry,
  so hot paths call :func:`with_sincos`, which pays for it only when an
  argument needs it. Other float dtypes use ``jnp.sin`` and ``jnp.cos``
  (exact reduction in XLA).
  """
  if x.dtype != jnp.float32:
    return jnp.sin(x), jnp.cos(x)
  y, quadrant = _cody_waite(x)
  y_large, k_large = _reduce_large(x)
  large = ~(jnp.abs(x) < FAST_SINCOS_LIMIT)  # NaN too
  # k_large is a small integer (its quadrant mod 4 is what counts): exact as an int32.
  quadrant_large = k_large.astype(jnp.int32)
  return sincos_of_quarter_turns(jnp.where(large, y_large, y), jnp.where(large, quadrant_large, quadrant))


def max_abs(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
  """``max |x|`` over ``axis`` (all axes by default; 0 for no entries), ``inf`` wherever an entry is NaN.

  XLA:CPU's vectorised ``max`` reduction drops NaN (jax 0.10: ``jnp.max`` of a
  2-D float32 array with NaN entries returns the largest other entry, or
  ``-inf`` if all are NaN), so a check ``jnp.max(jnp.abs(defect)) <= tol``
  would pass a diverged, all-NaN iterate. Here NaN entries enter the
  reduction as ``inf``: one fused pass, as cheap as the plain maximum, after
  which every check ``max_abs(x) <= bound`` fails for non-finite input on
  every backend. Every decision and every residual in the library that
  reduces floats with a maximum goes through this function.
  """
  magnitude = jnp.abs(x)
  return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, magnitude), axis=axis, keepdims=keepdims, initial=0)


Carry = TypeVar("Carry")


def bounded_while_loop(
  not_done: Callable[[Carry], Any], step: Callable[[Carry], Carry], init: Carry, bound: int, fixed: bool
) -> Carry:
  """``lax.while_loop(not_done, step, init)``, or with ``fixed`` its masked form of ``bound`` iterations.

  The masked form is a ``lax.fori_loop`` of static length whose iterations
  leave the carry as it is once ``not_done`` is False: the same iterates
  (the same arithmetic, selected) without a test read by the host, always at
  the cost of ``bound`` iterations. It is exact for loops whose test fails
  within ``bound`` iterations (those that count their iterations against it).
  """
  if not fixed:
    return jax.lax.while_loop(not_done, step, init)

  def masked(_, carry):
    go = not_done(carry)
    return jax.tree.map(lambda new, old: jnp.where(go, new, old), step(carry), carry)

  return jax.lax.fori_loop(0, bound, masked, init)


def sin_cos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(sin(x), cos(x))``: ``jnp.sin`` and ``jnp.cos``, but on XLA:CPU :func:`sincos_fast`.

  :func:`sincos_fast` is a rotation for every finite ``x`` and exact below
  ``2**13``.
  """
  if x.dtype != jnp.float32:
    return jnp.sin(x), jnp.cos(x)
  return _platform.on_cpu("sincos", sincos_fast, _jnp_sincos, x)


def _jnp_sincos(x):
  return jnp.sin(x), jnp.cos(x)


def with_sincos(fn, x: jax.Array, *operands):
  """``fn(sincos, x, *operands)`` with an exact ``sincos``: ``jnp.sin`` and ``jnp.cos`` but on XLA:CPU.

  There the result with :func:`sincos_fast` is recomputed with the exact
  :func:`sincos` only if some ``|x| >= 2**13`` (or is NaN): a while loop of at
  most one iteration, which under ``vmap`` runs once if any member needs it
  (a ``lax.cond`` would become a select and run the exact path every step).
  """
  if x.dtype != jnp.float32:
    return fn(_jnp_sincos, x, *operands)
  return _platform.on_cpu(
    "sincos", lambda *args: _gated_sincos(fn, *args), lambda *args: fn(_jnp_sincos, *args), x, *operands
  )


def _gated_sincos(fn, x, *operands):
  needed = ~(max_abs(x) < FAST_SINCOS_LIMIT)
  result, _ = jax.lax.while_loop(
    lambda carry: carry[1],
    lambda carry: (fn(sincos, x, *operands), jnp.array(False)),
    (fn(sincos_fast, x, *operands), needed),
  )
  return result


def power_of_two_scale(m: jax.Array) -> jax.Array:
  """A power of two ``s`` with ``1 <= m s < 4`` for finite ``m >= tiny``; exact scaling.

  For overflow-safe norms: multiplying by ``s`` is exact (no rounding) and
  commutes with the rounding of sums and products, so ``|v s|^2`` neither
  overflows nor underflows and a direction ``v s / |v s|`` equals
  ``v / |v|`` wherever the latter is representable. ``m`` below the smallest
  normal number (zero, subnormals) gets ``s = 2**(emax - 1)``; ``inf`` and NaN
  get NaN, so that what is scaled by it shows up as NaN. Bit operations only
  (any IEEE float dtype: float16, bfloat16, float32, float64).
  """
  info = jnp.finfo(m.dtype)
  mantissa = info.nmant
  int_dtype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(m.dtype).itemsize]
  top = 2 * info.maxexp - 2  # biased exponent of the largest finite numbers
  exponent = jax.lax.bitcast_convert_type(m, int_dtype) >> mantissa
  scale = jax.lax.bitcast_convert_type(((top - jnp.clip(exponent, 1, top - 1)) << mantissa).astype(int_dtype), m.dtype)
  return jnp.where(exponent > top, jnp.asarray(np.nan, m.dtype), scale)


def concrete_float(value: Any) -> float | None:
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


def is_prng_key(x) -> bool:
  """Whether ``x`` is a JAX PRNG key: a typed key, or a raw ``uint32`` key (last axis 2)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return dtype == jnp.uint32 and getattr(x, "shape", ())[-1:] == (2,)


def explicit_sharding(x: jax.Array):
  """``x``'s sharding when its mesh has explicit axes, else None.

  For ``out_sharding=``: under explicit sharding an array created from a shape
  alone (noise) is replicated unless told otherwise, so every device would
  draw the whole array; with auto axes (or no mesh) XLA partitions it itself.
  """
  sharding = jax.typeof(x).sharding
  return sharding if sharding.mesh.explicit_axes else None
