"""The paired Box-Muller draws: JAX's Threefry words, two standard normal, independent numbers per hash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config
from scipy import stats

from cola_jax import _noise

KEYS = {
  "key(0)": lambda: jax.random.key(0),
  "key(2**31 + 5)": lambda: jax.random.key(2**31 + 5),
  "raw PRNGKey(7)": lambda: jax.random.PRNGKey(7),
  "split key": lambda: jax.random.split(jax.random.key(11), 3)[2],
}


@pytest.mark.parametrize("key_name", sorted(KEYS))
@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 30, 7)], ids=str)
def test_the_hash_of_each_entry_is_jaxs_threefry_of_its_index(key_name, shape):
  # jax.random.bits xors the two words of the same hash of the same counters (partitionable mode).
  key = KEYS[key_name]()
  words = jax.jit(lambda k: _noise._threefry_2x32(_noise._threefry_words(k), _noise._linear_index(shape, None)))(key)
  np.testing.assert_array_equal(np.asarray(words[0] ^ words[1]), np.asarray(jax.random.bits(key, shape, jnp.uint32)))


def test_jaxs_threefry_kernel_lowering_leaves_the_numbers_as_they_are():
  """The flag lowers Threefry to JAX's kernel on GPU; the numbers of a seed stay those without it."""
  # The flag's context manager sets it for this thread only and restores it: no other test sees it.
  key = jax.random.key(3)
  draws = lambda k: _noise.normal_pair(k, (16, 8), jnp.float32)
  with jax_config.threefry_gpu_kernel_lowering(True):
    flagged = jax.jit(draws)(key)
  for a, b in zip(flagged, jax.jit(lambda k: draws(k))(key)):  # a new function: traced without the flag
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------
# Two numbers per hash (Box-Muller): a different stream from the same key.


def _pair(key, shape):
  first, second = jax.jit(lambda k: _noise.normal_pair(k, shape, jnp.float32))(key)
  return np.asarray(first, np.float64).ravel(), np.asarray(second, np.float64).ravel()


def _z(statistic, expected, variance, n):
  return (statistic - expected) / np.sqrt(variance / n)


def test_normal_pair_is_two_independent_standard_normal_arrays():
  first, second = _pair(jax.random.key(5), (400, 500))
  n = first.size
  for z in (first, second, (first + second) / np.sqrt(2), (first - second) / np.sqrt(2)):
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(_z(z.mean(), 0, 1, n)) < 4.5
    assert abs(_z(np.mean(z**2), 1, 2, n)) < 4.5
    assert abs(_z(np.mean(z**4), 3, 96, n)) < 4.5
  # Box-Muller's polar form: the squared radius is exponential with mean 2 and
  # the angle uniform, independently.
  radius2, angle = first**2 + second**2, np.arctan2(second, first)
  assert stats.kstest(radius2, "expon", args=(0, 2)).pvalue > 1e-3
  assert stats.kstest(angle, "uniform", args=(-np.pi, 2 * np.pi)).pvalue > 1e-3
  for a, b in ((first, second), (first**2, second**2), (radius2, np.cos(4 * angle))):
    assert abs(np.corrcoef(a, b)[0, 1]) < 4.5 / np.sqrt(n)
  # Different from jax.random.normal's numbers, and from one key to the next.
  assert not np.allclose(first, np.asarray(jax.random.normal(jax.random.key(5), (400 * 500,))))
  assert not np.allclose(first, _pair(jax.random.key(6), (400, 500))[0])


def test_normal_pair_is_a_function_of_the_key_and_the_counters():
  # Equal up to the rounding of differently fused programs (an FMA here or there).
  same = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  keys = jax.random.split(jax.random.key(3), 4)
  batched = jax.jit(jax.vmap(lambda k: _noise.normal_pair(k, (6, 7), jnp.float32)))(keys)
  for i, key in enumerate(keys):
    one = _noise.normal_pair(key, (6, 7), jnp.float32)
    same(batched[0][i], one[0])
    same(batched[1][i], one[1])
  # The counter is the row-major index: the shape only arranges the numbers.
  flat = _noise.normal_pair(keys[0], (42,), jnp.float32)
  same(np.asarray(flat[1]).reshape(6, 7), batched[1][0])


@pytest.mark.parametrize(
  "shape, axis", [((6, 5), 0), ((3, 4, 5), 1), ((2, 1), 0), ((1, 8, 2), 1), ((4, 2, 3, 3), 0)], ids=str
)
def test_normal_paired_takes_neighbours_along_the_first_even_outer_axis(shape, axis):
  key = jax.random.key(9)
  noise = np.asarray(jax.jit(lambda k: _noise.normal_paired(k, shape, jnp.float32))(key))
  assert noise.shape == shape and noise.dtype == np.float32
  half = shape[:axis] + (shape[axis] // 2,) + shape[axis + 1 :]
  first, second = (np.asarray(v) for v in _noise.normal_pair(key, half, jnp.float32))
  even = tuple(slice(None) if a != axis else slice(0, None, 2) for a in range(len(shape)))
  odd = tuple(slice(None) if a != axis else slice(1, None, 2) for a in range(len(shape)))
  # The same numbers, up to the rounding of a differently fused program (an FMA).
  np.testing.assert_allclose(noise[even], first, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(noise[odd], second, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(), (7,), (8,), (3, 5), (1, 3, 4)], ids=str)
def test_normal_paired_without_an_even_outer_axis_is_jax_random_normal(shape):
  key = jax.random.key(2)
  np.testing.assert_array_equal(
    np.asarray(_noise.normal_paired(key, shape, jnp.float32)), np.asarray(jax.random.normal(key, shape))
  )


def _two_jax_draws(key, shape, dtype):
  first, second = jax.random.split(key)
  return jax.random.normal(first, shape, dtype), jax.random.normal(second, shape, dtype)


def test_normal_pair_with_another_generator_is_two_jax_random_normal_draws():
  key = jax.random.key(1, impl="rbg")
  for ours, theirs in zip(_noise.normal_pair(key, (5, 4), jnp.float32), _two_jax_draws(key, (5, 4), jnp.float32)):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_normal_pair_in_the_original_threefry_mode_is_two_jax_random_normal_draws():
  key = jax.random.key(1)
  with jax.threefry_partitionable(False):
    for ours, theirs in zip(_noise.normal_pair(key, (5, 4), jnp.float32), _two_jax_draws(key, (5, 4), jnp.float32)):
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.skipif(not hasattr(jax, "enable_x64"), reason="jax.enable_x64 needs jax >= 0.8")
def test_normal_pair_in_float64_is_two_jax_random_normal_draws():
  with jax.enable_x64(True):
    key = jax.random.key(1)
    for ours, theirs in zip(_noise.normal_pair(key, (5, 4), jnp.float64), _two_jax_draws(key, (5, 4), jnp.float64)):
      assert ours.dtype == jnp.float64
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
