"""On XLA:CPU with one device the update waits for the gradient, exactly, and keeps its temporaries small."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cola_jax import transforms

pytestmark = pytest.mark.skipif(not transforms._on_one_cpu_device(), reason="the ordering applies on one CPU device")

SPECIAL = [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 2.0])
def test_after_gradient_leaves_every_value_bit_for_bit(dtype, first):
  x = jnp.asarray(SPECIAL, dtype)
  grad = jnp.asarray([first, 1.0], dtype)
  y, count = jax.jit(transforms._after_gradient)(grad, (x, jnp.int32(7)))
  assert np.asarray(y).tobytes() == np.asarray(x).tobytes()
  assert int(count) == 7


def test_the_update_waits_for_the_gradient_with_noise_sharing_off_too(monkeypatch):
  # The ordering is a mechanism of its own: it stays with the sharing off (how the development notes'
  # grouping-off measurement ran), or a measurement of either would mix the two.
  monkeypatch.setattr(transforms, "_sharing_noise_pays", lambda: False)
  jaxpr = jax.make_jaxpr(lambda grad, x: transforms._after_gradient(grad, x))(jnp.ones(3), jnp.ones(4))
  assert any(eqn.primitive.name == "bitcast_convert_type" for eqn in jaxpr.jaxpr.eqns)
