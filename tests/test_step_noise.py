"""Each leaf's noise comes from its own key: independent normals, the documented stream.

That the stream is the same however the draws are compiled (grouped on XLA:CPU, leaf by leaf elsewhere) is
tests/test_platform.py's; what the grouping buys, tests/test_canaries.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola
from cola_jax import langevin
from cola_jax.constraints import Euclidean


def free_noise(n_leaves: int, shape=(64, 32)) -> list[np.ndarray]:
  """The noise of one CoLA-od step of free leaves at zero gradient: update / sqrt(2 tau h)."""
  h, tau = 0.5, 2.0
  params = {f"w{i}": jnp.zeros(shape) for i in range(n_leaves)}
  tx = cola.cola_od(h, temperature=tau, key=jax.random.key(3))
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  return [np.asarray(updates[f"w{i}"]) / np.sqrt(2 * tau * h) for i in range(n_leaves)]


@pytest.mark.extended  # quick: test_transforms.py::test_noise_is_independent_across_leaves
def test_members_get_independent_standard_normal_noise():
  noise = free_noise(5)
  n = noise[0].size
  for z in noise:
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.var() - 1) < 5 * np.sqrt(2 / n)
  # Every member its own numbers (a slice given twice would correlate perfectly).
  flat = np.stack([z.ravel() for z in noise])
  correlation = np.corrcoef(flat)
  assert np.max(np.abs(correlation - np.eye(len(noise)))) < 5 / np.sqrt(n)
  np.testing.assert_array_equal(np.stack(free_noise(5)), np.stack(noise))  # a fixed key: the same run


def test_a_free_leaf_reads_the_draw_of_its_own_key():
  # The documented stream: the state's key split once per step, the step key split once per leaf.
  key = jax.random.key(3)  # free_noise's
  noise = free_noise(3)
  _, step_key = jax.random.split(key)
  for leaf_key, z in zip(jax.random.split(step_key, 3), noise):
    want = langevin.draw_noise(Euclidean(), leaf_key, jnp.zeros((64, 32)), "overdamped")
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-6)
