"""The XLA:CPU workarounds still buy what they exist for: each test compiles a step with the workaround and
without it (monkeypatched away) and compares the optimized HLO or the buffer assignment. A jax upgrade that
makes one unnecessary (or harmful) fails its test, and the workaround can go."""

import jax
import jax.numpy as jnp
import optax
import pytest

import cola_jax as cola
from cola_jax import _numerics, transforms
from cola_jax.constraints import circle

pytestmark = pytest.mark.skipif(not _numerics.on_one_cpu_device(), reason="workarounds of XLA:CPU on one device")

_INVERSE_SQRT_MAGIC = "1597463174"  # 0x5F375A86: inverse_sqrt's first guess, once per loop that inlines it


def _compiled_step(params, loss, tx):
  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  return jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile()


def _deep_circle_model(depth=8, width=512):
  params = {f"w{i}": jnp.full((width, width), 0.01) for i in range(depth)}
  x = jnp.ones((64, width))

  def loss(p):
    h = x
    for i in range(depth):
      h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.sum(h**2)

  return params, loss


def test_computed_together_normalises_a_circle_pair_once(monkeypatch):
  """Without it the new weight, slack and momentum loops each inline the normalisation of (theta, xi)."""
  params = {"w1": jnp.full((256, 256), 0.01), "w2": jnp.full((256, 256), 0.01)}
  x = jnp.ones((8, 256))
  loss = lambda p: jnp.sum(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)
  make = lambda: cola.cola_ud(0.1, friction=1.0, constraints=cola.Circle(0.5))
  together = _compiled_step(params, loss, make()).as_text().count(_INVERSE_SQRT_MAGIC)
  monkeypatch.setattr(circle, "computed_together", lambda *arrays: arrays)
  apart = _compiled_step(params, loss, make()).as_text().count(_INVERSE_SQRT_MAGIC)
  assert together < apart, (together, apart)  # measured with jax 0.10.2: 2 loops against 6


def test_computed_after_keeps_the_circle_points_out_of_the_backward_pass(monkeypatch):
  """Without it XLA computes every leaf's point before the forward pass and holds it through the backward pass."""
  params, loss = _deep_circle_model()
  make = lambda: cola.cola_ud(0.1, friction=1.0, constraints=cola.Circle(0.5), temperature=1e-4, key=jax.random.key(0))
  after = _compiled_step(params, loss, make()).memory_analysis().temp_size_in_bytes
  monkeypatch.setattr(transforms, "_after_gradient", lambda grad, tree: tree)
  early = _compiled_step(params, loss, make()).memory_analysis().temp_size_in_bytes
  assert after < early, (after, early)  # measured with jax 0.10.2: 12.5 MiB against 14.0 MiB
