"""The written-out Threefry normal draws the numbers of ``jax.random.normal``; the paired
Box-Muller draws are standard normal and independent; one-pass helper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import quick_or_extended
from jax._src import config as jax_config
from scipy import stats

from cola_jax import _noise

SHAPES = [(), (1,), (7,), (3, 4), (2, 300, 70), (3, 3, 8, 16)]
KEYS = {
  "key(0)": lambda: jax.random.key(0),
  "key(2**31 + 5)": lambda: jax.random.key(2**31 + 5),
  "raw PRNGKey(7)": lambda: jax.random.PRNGKey(7),
  "split key": lambda: jax.random.split(jax.random.key(11), 3)[2],
}


@pytest.mark.parametrize(  # quick: every shape with one key, every key with one shape
  ("key_name", "shape"),
  quick_or_extended(
    [(k, s) for k in sorted(KEYS) for s in SHAPES],
    {*(("key(0)", s) for s in SHAPES), *((k, (7,)) for k in KEYS)},
    ids=lambda k, s: f"{s}-{k}",
  ),
)
def test_bit_identical_to_jax_random_normal(key_name, shape):
  key = KEYS[key_name]()
  ours = jax.jit(lambda k: _noise.normal(k, shape, jnp.float32))(key)
  theirs = jax.random.normal(key, shape, jnp.float32)
  assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_bit_identical_under_vmap_over_keys():
  keys = jax.random.split(jax.random.key(3), 5)
  ours = jax.jit(jax.vmap(lambda k: _noise.normal(k, (40, 9), jnp.float32)))(keys)
  theirs = jax.vmap(lambda k: jax.random.normal(k, (40, 9)))(keys)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize(  # quick: one key (the others as test_bit_identical_to_jax_random_normal reads them)
  "key_name", [k if k == "key(0)" else pytest.param(k, marks=pytest.mark.extended) for k in sorted(KEYS)]
)
def test_fold_in_is_jax_random_fold_in_bit_for_bit(key_name):
  key = KEYS[key_name]()
  for data in (0, 1, 7, 2**31 + 3, 2**32 - 1):
    ours = jax.jit(lambda k, data=data: _noise.fold_in(k, data))(key)
    theirs = jax.random.fold_in(key, data)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if jnp.issubdtype(ours.dtype, jax.dtypes.prng_key):
      ours, theirs = jax.random.key_data(ours), jax.random.key_data(theirs)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_other_dtypes_are_jax_random_normal(dtype):
  key = jax.random.key(1)
  np.testing.assert_array_equal(
    np.asarray(_noise.normal(key, (64,), dtype), np.float32),
    np.asarray(jax.random.normal(key, (64,), dtype), np.float32),
  )


def test_other_generators_are_jax_random_normal():
  key = jax.random.key(1, impl="rbg")
  np.testing.assert_array_equal(
    np.asarray(_noise.normal(key, (64,), jnp.float32)), np.asarray(jax.random.normal(key, (64,), jnp.float32))
  )


def test_the_original_threefry_mode_is_jax_random_normal():
  key = jax.random.key(0)
  with jax.threefry_partitionable(False):
    ours = _noise.normal(key, (64,), jnp.float32)
    theirs = jax.random.normal(key, (64,), jnp.float32)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  assert not np.array_equal(np.asarray(ours), np.asarray(_noise.normal(key, (64,), jnp.float32)))


def test_jaxs_threefry_kernel_lowering_leaves_the_numbers_as_they_are():
  """The flag lowers Threefry to JAX's kernel on GPU; the numbers of a seed stay those without it."""
  # The flag's context manager sets it for this thread only and restores it: no other test sees it.
  key = jax.random.key(3)
  draws = lambda k: (_noise.normal(k, (16, 8), jnp.float32), *_noise.normal_pair(k, (16, 8), jnp.float32))
  with jax_config.threefry_gpu_kernel_lowering(True):
    flagged = jax.jit(draws)(key)
  for a, b in zip(flagged, jax.jit(lambda k: draws(k))(key)):  # a new function: traced without the flag
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.extended  # quick: test_bit_identical_to_jax_random_normal (jax.random.normal's numbers)
def test_standard_normal_moments():
  z = np.asarray(_noise.normal(jax.random.key(0), (200_000,), jnp.float32), np.float64)
  n = z.size
  assert abs(z.mean()) < 4 / np.sqrt(n)
  assert abs(z.var() - 1) < 4 * np.sqrt(2 / n)
  assert abs(np.mean(z**4) - 3) < 4 * np.sqrt(96 / n)


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


@pytest.mark.extended  # quick: test_normal_paired_takes_neighbours_along_the_first_even_outer_axis (pairs by counter)
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
  "shape, axis",
  [
    pytest.param((6, 5), 0, marks=pytest.mark.extended),
    ((3, 4, 5), 1),  # quick: an axis other than the first
    *(pytest.param(*c, marks=pytest.mark.extended) for c in (((2, 1), 0), ((1, 8, 2), 1), ((4, 2, 3, 3), 0))),
  ],
  ids=str,
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


@pytest.mark.parametrize(  # quick: an even last axis (not an outer one)
  "shape",
  [s if s == (8,) else pytest.param(s, marks=pytest.mark.extended) for s in [(), (7,), (8,), (3, 5), (1, 3, 4)]],
  ids=str,
)
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


@pytest.mark.extended  # quick: the other generator's test above (the same fallback: two jax.random.normal draws)
@pytest.mark.skipif(not hasattr(jax, "enable_x64"), reason="jax.enable_x64 needs jax >= 0.8")
def test_normal_pair_in_float64_is_two_jax_random_normal_draws():
  with jax.enable_x64(True):
    key = jax.random.key(1)
    for ours, theirs in zip(_noise.normal_pair(key, (5, 4), jnp.float64), _two_jax_draws(key, (5, 4), jnp.float64)):
      assert ours.dtype == jnp.float64
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
