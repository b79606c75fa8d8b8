"""Many seeds at once: ``jax.vmap`` over PRNG keys, one jitted training loop.

``train_seeds`` is the pattern docs/guides/many_seeds.md quotes: each seed draws its own
initial parameters and builds its own optimizer (whose key lives in its
state), and ``lax.scan`` runs the steps, so N seeds cost one compilation and
run as one batched program.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

SIZES = (4, 16, 16, 2)
SEEDS = 4
STEPS = 50


def init_mlp(key):
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:])):
    key, k = jax.random.split(key)
    bound = 1 / np.sqrt(fan_in)
    params[f"layer{i}"] = {
      "w": jax.random.uniform(k, (fan_in, fan_out), minval=-bound, maxval=bound),
      "b": jnp.zeros(fan_out),
    }
  return params


def loss_fn(params, batch):
  x, y = batch
  for i in range(len(SIZES) - 1):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    x = jnp.tanh(x) if i < len(SIZES) - 2 else x
  return jnp.mean((x - y) ** 2)


def batches(steps, batch_size=16):
  """The same data for every seed: (steps, batch, features) arrays."""
  kx, kw = jax.random.split(jax.random.key(1234))
  x = jax.random.normal(kx, (steps, batch_size, SIZES[0]))
  return x, jnp.sin(x @ jax.random.normal(kw, (SIZES[0], SIZES[-1])))


# --- the pattern -------------------------------------------------------------


def train_seeds(keys, make_tx, init_params, loss_fn, batches):
  """Trains one network per key, all at once; returns (params, opt_states).

  Every output leaf has a leading axis of len(keys).
  """

  def train_one(key):
    init_key, noise_key = jax.random.split(key)
    params = init_params(init_key)
    tx = make_tx(noise_key)  # e.g. cola.c_cola_ud(..., key=noise_key)

    def step(carry, batch):
      params, state = carry
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(step, (params, tx.init(params)), batches)
    return params, state

  return jax.jit(jax.vmap(train_one))(keys)


# -----------------------------------------------------------------------------


METHODS = {
  "c_cola_ud": lambda key: cola.c_cola_ud(0.3, friction=1.0, radius=0.2, temperature=1e-3, key=key),
  "o_cola_od": lambda key: cola.o_cola_od(0.05, temperature=1e-4, key=key),
}


# Slow: the quick suite has test_transforms.py's vmap over keys and the guide's page (tests/test_docs.py).
@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_seeds_trained_together_equal_seeds_trained_alone(method):
  make_tx = METHODS[method]
  data = batches(STEPS)
  keys = jax.random.split(jax.random.key(0), SEEDS)
  params, states = train_seeds(keys, make_tx, init_mlp, loss_fn, data)

  # Every leaf carries the seed axis.
  assert all(leaf.shape[0] == SEEDS for leaf in jax.tree.leaves(params))

  # Seed i equals the same run done alone (one seed: the pattern without vmap).
  alone = jax.jit(lambda key: train_seeds(key[None], make_tx, init_mlp, loss_fn, data))
  for i in range(SEEDS):
    single, _ = alone(keys[i])
    for batched, one in zip(jax.tree.leaves(params), jax.tree.leaves(single)):
      np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(one[0]), rtol=1e-5, atol=1e-6)

  # The seeds differ (initial weights and noise).
  w = np.asarray(params["layer1"]["w"])
  for i in range(SEEDS):
    for j in range(i):
      assert np.max(np.abs(w[i] - w[j])) > 1e-2

  # The constraints hold in every seed.
  residuals = jax.vmap(cola.constraint_residuals)(params, states)
  for leaf in jax.tree.leaves(residuals):
    assert leaf.shape == (SEEDS,)
    assert float(jnp.max(leaf)) <= 1e-5, leaf
  if method == "c_cola_ud":
    assert all(float(jnp.max(jnp.abs(params[k]["w"]))) <= 0.2 * (1 + 1e-6) for k in params)  # r in float32
  else:
    grams = jnp.einsum("nij,nik->njk", params["layer1"]["w"], params["layer1"]["w"])
    np.testing.assert_allclose(np.asarray(grams), np.broadcast_to(np.eye(16), grams.shape), atol=1e-5)
