"""The written-out Threefry normal draws the numbers of ``jax.random.normal``; one-pass helper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola
from cola_jax import _noise
from cola_jax._numerics import computed_together

SHAPES = [(), (1,), (7,), (3, 4), (2, 300, 70), (3, 3, 8, 16)]
KEYS = {
  "key(0)": lambda: jax.random.key(0),
  "key(2**31 + 5)": lambda: jax.random.key(2**31 + 5),
  "raw PRNGKey(7)": lambda: jax.random.PRNGKey(7),
  "split key": lambda: jax.random.split(jax.random.key(11), 3)[2],
}


@pytest.mark.parametrize("key_name", sorted(KEYS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
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


def test_standard_normal_moments():
  z = np.asarray(_noise.normal(jax.random.key(0), (200_000,), jnp.float32), np.float64)
  n = z.size
  assert abs(z.mean()) < 4 / np.sqrt(n)
  assert abs(z.var() - 1) < 4 * np.sqrt(2 / n)
  assert abs(np.mean(z**4) - 3) < 4 * np.sqrt(96 / n)


def test_the_hash_is_not_a_loop_in_a_noisy_update():
  """JAX's CPU lowering of Threefry is a loop of passes over the array; ours is not."""
  params = {"w": jnp.zeros((64, 32))}
  tx = cola.c_cola_ud(0.3, friction=1.0, radius=0.05, temperature=1e-3, key=jax.random.key(0))
  state = tx.init(params)
  text = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  loops = [line for line in text.splitlines() if " while(" in line]
  assert loops, "expected the key split's small loops (the test would not see a change)"
  assert not any("[64,32]" in line for line in loops)


def test_computed_together_returns_its_arguments():
  x = jax.random.normal(jax.random.key(0), (3, 5))
  y = jnp.arange(15.0).reshape(3, 5) - 7
  n = jnp.arange(15, dtype=jnp.int32).reshape(3, 5)
  together = jax.jit(computed_together)(x, y, n)
  for a, b in zip(together, (x, y, n)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  batched = jax.vmap(computed_together)(x, y)
  np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(y))
  # The identity's derivative, under grad and jvp.
  grad = jax.grad(lambda a: jnp.sum(computed_together(a, a * a)[1]))(x)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(2 * x), rtol=1e-6)
  _, tangent = jax.jvp(lambda a: computed_together(a)[0], (x,), (y,))
  np.testing.assert_array_equal(np.asarray(tangent), np.asarray(y))
