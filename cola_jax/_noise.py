r"""Standard normal noise, equal to ``jax.random.normal`` and cheaper to fuse.

JAX's default generator hashes each entry's index with Threefry-2x32 (20
rounds of add, rotate, xor; Salmon et al. 2011). On CPU, JAX lowers the 20
rounds as a loop of five iterations over the whole array, which keeps compile
times short but makes every draw five passes over memory, written and read
back. Inside a Langevin step that loop cost more than the rest of the
update. :func:`normal` computes the same hash written out round by round, so
that XLA fuses it, the conversion to a normal and its consumers into one pass;
the numbers are those of ``jax.random.normal(key, shape, dtype)``, bit for bit.

References:
  Salmon, Moraes, Dror, Shaw, *Parallel random numbers: as easy as 1, 2, 3*,
  SC 2011 (Threefry).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

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
  bits = _threefry_2x32(words, _linear_index(shape, out_sharding))
  mantissa = (bits >> np.uint32(9)) | np.float32(1).view(np.uint32)
  uniform = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - np.float32(1)
  uniform = jnp.maximum(_LOW, uniform * _WIDTH + _LOW)
  return np.float32(np.sqrt(2)) * jax.lax.erf_inv(uniform)


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
  """Threefry-2x32 of the counters ``(0, counter_low)``; the xor of its two output words."""
  k0, k1 = words
  schedule = (k0, k1, k0 ^ k1 ^ _KEY_PARITY)
  x0 = jnp.zeros_like(counter_low) + schedule[0]
  x1 = counter_low + schedule[1]
  for group in range(1, 6):
    for distance in _ROTATIONS[(group - 1) % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, distance) ^ x0
    x0 = x0 + schedule[group % 3]
    x1 = x1 + schedule[(group + 1) % 3] + np.uint32(group)
  return x0 ^ x1
