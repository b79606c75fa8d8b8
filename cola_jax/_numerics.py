"""Elementwise numerics shared by the constraints."""

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

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
# Just above pi/4: Cody-Waite leaves |y| <= pi/4 (to rounding) below FAST_SINCOS_LIMIT.
_QUARTER_TURN = np.float32(0.7854)


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


def angle_gate_as_select() -> bool:
  """Whether :func:`with_sincos` computes both paths and selects, rather than gating the exact one.

  Off XLA:CPU: there the host would read the gate's test before going on, and
  the exact path fused into the same elementwise pass costs nothing measurable
  (c-CoLA-ud on an H200, ``results/gpu/cost/accelerator_loops.json``). Decided by
  ``jax.default_backend()`` when the step is traced.
  """
  return jax.default_backend() != "cpu"


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


def with_sincos(fn, x: jax.Array, *operands):
  """``fn(sincos, x, *operands)``, evaluated with :func:`sincos_fast` whenever it is exact.

  The result with :func:`sincos_fast` is recomputed with the exact
  :func:`sincos` only if some ``|x| >= 2**13`` (or is NaN): a while loop of at
  most one iteration, which under ``vmap`` runs once if any member needs it
  (a ``lax.cond`` would become a select and run the exact path every step).
  Off CPU (:func:`angle_gate_as_select`) both are computed, elementwise in
  one pass, and selected.
  """
  if x.dtype != jnp.float32:
    return fn(sincos, x, *operands)
  needed = ~(max_abs(x) < FAST_SINCOS_LIMIT)
  if angle_gate_as_select():
    return jax.tree.map(
      lambda exact, fast: jnp.where(needed, exact, fast), fn(sincos, x, *operands), fn(sincos_fast, x, *operands)
    )
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
  a trailing axis of length two whose second entries are negative zeros
  (``x + (-0)`` is ``x`` exactly, and the compiler drops the addition): every
  intermediate they share is computed once and each array is written to
  memory once (on the CoLA-ud step of two 256 x 256 ``Circle`` kernels, the
  inverse square root of the pair's normalisation is in 2 loops instead of 6,
  jax 0.10.2; ``tests/test_xla_workarounds.py`` checks it). Other backends fuse
  multi-output loops themselves and get the arrays as they are.

  The reduction's loop runs over the arrays' shape with the last axis
  innermost and vectorised (a last axis of 10 leaves most of each row to
  scalar code), so with a single device the arrays are flattened first (a
  free reshape); with several, where an axis may be sharded and a reshape
  across it would move data between devices, they keep their shape.
  """
  if jax.default_backend() != "cpu" or not arrays:
    return arrays
  shape = arrays[0].shape
  if jax.device_count() == 1:
    arrays = tuple(x.reshape(-1) for x in arrays)
  zeros = tuple(np.array(-0.0 if jnp.issubdtype(x.dtype, jnp.inexact) else 0, x.dtype) for x in arrays)
  padded = tuple(jnp.stack([x, jnp.full_like(x, zero)], axis=-1) for x, zero in zip(arrays, zeros))
  summed = jax.lax.reduce(padded, zeros, lambda a, b: tuple(u + v for u, v in zip(a, b)), (arrays[0].ndim,))
  return tuple(x.reshape(shape) for x in summed)


@computed_together.defjvp
def _computed_together_jvp(primals, tangents):
  return computed_together(*primals), tuple(tangents)


def computed_after(grad: jax.Array, tree):
  """``tree`` unchanged, but computed from ``grad``: XLA schedules nothing of it before ``grad`` exists.

  XLA's CPU scheduler runs each operation as early as its operands allow (an
  ``optimization_barrier`` with ``grad`` left the 12-block transformer's
  schedule as it was: a data dependence is needed). Each array of ``tree``
  gains a zero made from the sign bit of ``grad``'s first entry, which the
  compiler cannot fold: floats ``-0.0`` (``x + -0.0`` is ``x`` for every
  float, signed zeros and NaN included), integers and PRNG keys' data ``0``
  by exclusive or.
  """
  if grad.size == 0:
    return tree
  first = grad[(0,) * grad.ndim]  # not grad.reshape(-1)[0]: a reshape of an explicitly sharded array needs its sharding
  sign = jax.lax.bitcast_convert_type(first.astype(jnp.float32), jnp.uint32) & np.uint32(2**31)
  high_bit = sign | np.uint32(2**31)
  negative_zero = jax.lax.bitcast_convert_type(high_bit, jnp.float32)
  zero_bits = high_bit ^ np.uint32(2**31)

  def after(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(after(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return x + negative_zero.astype(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.integer):
      return x ^ zero_bits.astype(x.dtype)
    return x

  return jax.tree.map(after, tree)


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


def on_one_cpu_device() -> bool:
  """Whether the step runs on XLA's CPU backend with one device, where the scheduling workarounds apply."""
  return jax.default_backend() == "cpu" and jax.device_count() == 1


def explicit_sharding(x: jax.Array):
  """``x``'s sharding when its mesh has explicit axes, else None.

  For ``out_sharding=``: under explicit sharding an array created from a shape
  alone (noise) is replicated unless told otherwise, so every device would
  draw the whole array; with auto axes (or no mesh) XLA partitions it itself.
  """
  sharding = jax.typeof(x).sharding
  return sharding if sharding.mesh.explicit_axes else None


def one_matrix_at_a_time(fn: Callable) -> Callable:
  """``fn`` (a LAPACK factorisation of one model's matrix) made to loop over a ``vmap`` batch on XLA:CPU.

  jaxlib 0.10.2's CPU LAPACK kernels (``eigh``, ``svd``, ``qr``, Cholesky,
  LU) split a batch of large matrices into tasks on XLA:CPU's intra-op thread
  pool and block the pool thread that runs them until the tasks are done:
  with every pool thread blocked so (two on two cores) no thread is left to
  run the tasks, and the program deadlocks (a step of ``manifold_muon`` over
  two seeds did, and so did the ``"qr"`` retraction of two conv kernels
  ``(3, 3, 64, 64)`` held as 9 matrices each, with or without ``vmap``).
  Given one matrix, LAPACK runs on the calling thread. Under ``jax.vmap``
  (seeds, or the stack of a leaf's matrices, which
  :class:`~cola_jax.Orthogonal` maps over) the result calls ``fn`` on one
  member at a time (``jax.custom_batching.sequential_vmap``); unbatched it
  computes what ``fn`` does, bit for bit. The steps took as long either way
  (0.92 to 1.04 times, medians on 2 shared cores: the polar and QR
  retractions of such a kernel, the polar one of 16 256 x 128 matrices and
  of two seeds' 784 x 128 or 512 x 512 kernels). Other backends' batched
  solvers are fine and get ``fn``. Decided by ``jax.default_backend()`` when
  the step is traced. ``fn`` takes its arrays positionally; its keyword
  defaults (``jnp.linalg.eigh``'s ``UPLO``) stay Python values
  (``custom_vmap`` would trace every argument it binds).
  """
  if jax.default_backend() != "cpu":
    return fn
  return jax.custom_batching.sequential_vmap(lambda *arrays: fn(*arrays))
