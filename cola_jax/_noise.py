r"""Standard normal noise, equal to ``jax.random.normal`` and cheaper to fuse.

JAX's default generator hashes each entry's index with Threefry-2x32 (20
rounds of add, rotate, xor; Salmon et al. 2011). On CPU, JAX lowers the 20
rounds as a loop of five iterations over the whole array, which keeps compile
times short but makes every draw five passes over memory, written and read
back. Inside a Langevin step that loop cost more than the rest of the
update. :func:`normal` computes the same hash written out round by round, so
that XLA fuses it, the conversion to a normal and its consumers into one pass;
the numbers are those of ``jax.random.normal(key, shape, dtype)``, bit for bit.

:func:`normal_pair` and :func:`normal_paired` draw from the same key and the
same counters a different stream, at half the cost: Threefry-2x32 hashes each
counter to two 32-bit words, which ``jax.random.normal`` xors into one number
and then transforms with an inverse error function; here both words are kept
and the Box-Muller transform turns them into two independent standard normal
numbers, so one hash, one logarithm and one square root serve two of them.

The hash is written out on XLA's CPU backend only
(:mod:`cola_jax._platform`); a program compiled for any other platform
computes the same words with JAX's own Threefry primitive
(``jax.extend.random.threefry2x32_p``, which
``jax_threefry_gpu_kernel_lowering`` lowers to one precompiled kernel per draw
on GPU). Every function below gives the same numbers on every backend.

References:
  Salmon, Moraes, Dror, Shaw, *Parallel random numbers: as easy as 1, 2, 3*,
  SC 2011 (Threefry).
  Box and Muller, *A note on the generation of random normal deviates*,
  Ann. Math. Statist. 29, 1958.
"""

import math

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np

from cola_jax import _platform
from cola_jax._numerics import sincos_of_quarter_turns

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)
# jax.random.normal draws u uniform on [nextafter(-1, 0), 1) and returns sqrt(2) erfinv(u).
_LOW = np.nextafter(np.float32(-1), np.float32(0))
_WIDTH = np.float32(1) - _LOW


def normal(key: jax.Array, shape: tuple[int, ...], dtype, out_sharding=None) -> jax.Array:
  """``jax.random.normal(key, shape, dtype, out_sharding=out_sharding)``, bit for bit.

  Written out for float32 and Threefry keys in JAX's default partitionable
  mode (``jax_threefry_partitionable``); anything else is passed to
  ``jax.random.normal``.
  """
  words = _threefry_words(key)
  if words is None or jnp.dtype(dtype) != jnp.float32 or math.prod(shape) >= 2**32:
    return jax.random.normal(key, shape, dtype, out_sharding=out_sharding)
  bits = jnp.bitwise_xor(*_threefry_2x32(words, _linear_index(shape, out_sharding)))
  mantissa = (bits >> np.uint32(9)) | np.float32(1).view(np.uint32)
  uniform = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1)
  uniform = jnp.maximum(_LOW, uniform * _WIDTH + _LOW)
  return np.float32(np.sqrt(2)) * jax.lax.erf_inv(uniform)


def fold_in(key: jax.Array, data: int) -> jax.Array:
  """``jax.random.fold_in(key, data)``, bit for bit, as one written-out hash.

  JAX runs a fold-in's Threefry rounds on CPU as a loop, a while loop of the
  compiled program that costs about a tenth of a second to compile; written
  out, the few scalar operations fuse with their consumer. Written out for
  Threefry keys in partitionable mode and ``0 <= data < 2**32``; anything else
  is passed to ``jax.random.fold_in``.
  """
  words = _threefry_words(key)
  if words is None or not 0 <= data < 2**32:
    return jax.random.fold_in(key, data)
  # Computed once: the consumers of the key read it rather than repeat the rounds.
  folded = jax.lax.optimization_barrier(jnp.stack(_threefry_2x32(words, jnp.uint32(data))))
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(folded, impl=jax.random.key_impl(key))
  return folded


def normal_pair(key: jax.Array, shape: tuple[int, ...], dtype, out_sharding=None) -> tuple[jax.Array, jax.Array]:
  r"""Two independent standard normal arrays of ``shape``: one Threefry hash per entry.

  The counter of an entry is its row-major index (as in ``jax.random.normal``);
  its hash's two words ``w0, w1`` give, by the Box-Muller transform,

  .. math::
    z_0 = \rho \cos\varphi, \quad z_1 = \rho \sin\varphi, \qquad
    \rho = \sqrt{-2 \log u},

  with ``u = (floor(w0 / 2**8) + 1) 2**-24``, uniform on ``(0, 1]``, and
  ``phi = q pi/2 + y``: ``q`` the top two bits of ``w1`` and ``y`` uniform on
  ``(-pi/4, pi/4)`` from its next 22 bits, so that ``phi`` is uniform on a
  whole turn. Exact in distribution up to the 24-bit grids of ``u`` and
  ``phi`` (``|z| <= 5.77``; ``jax.random.normal``'s 23-bit grid stops at 5.4).
  The numbers are not ``jax.random.normal``'s. Written out for float32 and
  Threefry keys in JAX's partitionable mode; otherwise two
  ``jax.random.normal`` draws from the two halves of a split key.

  Both arrays are computed in one pass and written to memory
  (:func:`~cola_jax._platform.computed_together`): every consumer reads them
  rather than hash again.
  """
  first, second = _platform.computed_together(*box_muller(key, shape, dtype, out_sharding))
  return first, second


def box_muller(key: jax.Array, shape: tuple[int, ...], dtype, out_sharding=None) -> tuple[jax.Array, jax.Array]:
  """The two arrays of :func:`normal_pair`, as expressions for XLA to place."""
  words = _threefry_words(key)
  if words is None or jnp.dtype(dtype) != jnp.float32 or math.prod(shape) >= 2**32:
    first, second = jax.random.split(key)
    return (
      jax.random.normal(first, shape, dtype, out_sharding=out_sharding),
      jax.random.normal(second, shape, dtype, out_sharding=out_sharding),
    )
  w0, w1 = _threefry_2x32(words, _linear_index(shape, out_sharding))
  u = (_to_float(w0 >> np.uint32(8)) + 1) * np.float32(2.0**-24)
  rho = jnp.sqrt(-2 * jnp.log(u))
  steps = _to_float((w1 >> np.uint32(8)) & np.uint32(2**22 - 1))
  y = (steps + np.float32(0.5)) * np.float32(2.0**-22 * np.pi / 2) - np.float32(np.pi / 4)
  sin, cos = sincos_of_quarter_turns(y, jax.lax.bitcast_convert_type(w1 >> np.uint32(30), jnp.int32))
  return rho * cos, rho * sin


def normal_paired(key: jax.Array, shape: tuple[int, ...], dtype, out_sharding=None) -> jax.Array:
  """A standard normal array of ``shape`` at half the hashes of :func:`normal`.

  Entries ``2i`` and ``2i + 1`` along the first axis of even length other than
  the last are the two numbers of one :func:`normal_pair` draw (of the shape
  with that axis halved), computed in one loop. The pairs lie along an outer
  axis, so that the loops that read the noise stay contiguous and
  vectorised, and a pair never straddles a shard of an evenly split axis.
  Shapes without such an axis get :func:`normal` (``jax.random.normal``'s
  numbers).
  """
  axis = next((a for a in range(len(shape) - 1) if shape[a] % 2 == 0), None)
  if axis is None:
    return normal(key, shape, dtype, out_sharding=out_sharding)
  half = shape[:axis] + (shape[axis] // 2,) + shape[axis + 1 :]
  first, second = normal_pair(key, half, dtype, out_sharding=out_sharding)
  return jnp.stack([first, second], axis=axis + 1).reshape(shape)


def _to_float(bits):
  """A uint32 below ``2**31`` as float32 (through int32: CPUs convert signed integers natively)."""
  return jax.lax.bitcast_convert_type(bits, jnp.int32).astype(jnp.float32)


def _threefry_words(key):
  """The two key words of a Threefry key, or None for other generators and modes."""
  if not jax.config.jax_threefry_partitionable:  # pyright: ignore[reportAttributeAccessIssue]
    return None
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != () or "threefry" not in str(jax.random.key_impl(key)):
      return None
    key = jax.random.key_data(key)
  elif jax.config.jax_default_prng_impl != "threefry2x32" or key.shape != (2,):  # pyright: ignore[reportAttributeAccessIssue]
    return None
  return key[0], key[1]


def _linear_index(shape, out_sharding) -> jax.Array:
  """Each entry's row-major index, as uint32 (JAX's counter for arrays below 2**32 entries)."""
  index = jnp.zeros(shape, jnp.uint32, out_sharding=out_sharding)
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis, out_sharding=out_sharding)
    index = index + iota * np.uint32(stride)
    stride *= shape[axis]
  return index


def _rotate_left(x, distance: int):
  return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def _threefry_2x32(words, counter_low):
  """Threefry-2x32 of the counters ``(0, counter_low)``: its two output words.

  Written out round by round on XLA:CPU, which lowers JAX's primitive to a
  loop of five passes over the whole array; elsewhere that primitive.
  """
  return _platform.on_cpu("threefry", _threefry_rounds, _threefry_primitive, *words, counter_low)


def _threefry_primitive(k0, k1, counter_low):
  x0, x1 = jax.extend.random.threefry2x32_p.bind(k0, k1, jnp.zeros_like(counter_low), counter_low)
  return x0, x1


def _threefry_rounds(k0, k1, counter_low):
  schedule = (k0, k1, k0 ^ k1 ^ _KEY_PARITY)
  x0 = jnp.zeros_like(counter_low) + schedule[0]
  x1 = counter_low + schedule[1]
  for group in range(1, 6):
    for distance in _ROTATIONS[(group - 1) % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, distance) ^ x0
    x0 = x0 + schedule[group % 3]
    x1 = x1 + schedule[(group + 1) % 3] + np.uint32(group)
  return x0, x1
