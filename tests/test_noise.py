"""The written-out Threefry normal draws the numbers of ``jax.random.normal``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola
from cola_jax import _noise

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
      np.asarray(jax.random.normal(key, (64,), dtype), np.float32))


def test_other_generators_are_jax_random_normal():
  key = jax.random.key(1, impl="rbg")
  np.testing.assert_array_equal(
      np.asarray(_noise.normal(key, (64,), jnp.float32)),
      np.asarray(jax.random.normal(key, (64,), jnp.float32)))


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
