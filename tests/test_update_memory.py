"""On XLA:CPU with one device the update waits for the gradient, exactly, and keeps its temporaries small."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax import transforms

pytestmark = pytest.mark.skipif(not transforms._sharing_noise_pays(), reason="the ordering applies on one CPU device")

SPECIAL = [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 2.0])
def test_after_gradient_leaves_every_value_bit_for_bit(dtype, first):
  x = jnp.asarray(SPECIAL, dtype)
  grad = jnp.asarray([first, 1.0], dtype)
  y, count = jax.jit(transforms._after_gradient)(grad, (x, jnp.int32(7)))
  assert np.asarray(y).tobytes() == np.asarray(x).tobytes()
  assert int(count) == 7


def _temporaries_in_leaves(tx, constraints, depth=6, width=256) -> float:
  """XLA's temporary bytes of a donated training step of a tanh chain, in kernel sizes."""
  params = {f"w{i}": 0.05 * jax.random.normal(jax.random.key(i), (width, width)) for i in range(depth)}
  if constraints is not None:
    params = cola.project_params(params, constraints)

  def loss(p, x):
    for i in range(depth):
      x = jnp.tanh(x @ p[f"w{i}"])
    return jnp.sum(x * x)

  def step(p, s, x):
    updates, s = tx.update(jax.grad(loss)(p, x), s, p)
    return optax.apply_updates(p, updates), s

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), jnp.ones((8, width))).compile()
  return compiled.memory_analysis().temp_size_in_bytes / (width * width * 4)


def test_circle_step_keeps_no_point_in_memory_through_the_backward_pass():
  # Each leaf's normalised point (two kernel-sized arrays) used to be written
  # to memory before the forward pass and held through it: 6.0 kernels above
  # SGD-m's temporaries with jax 0.10.2, 2.9 since.
  sgd = _temporaries_in_leaves(optax.sgd(0.1, momentum=0.9), None)
  circle = cola.Circle(0.2)
  assert _temporaries_in_leaves(cola.cola_od(0.1, constraints=circle), circle) <= sgd + 4
