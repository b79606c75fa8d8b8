"""On XLA:CPU with one device the update waits for the gradient, exactly, and keeps its temporaries small."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cola_jax import _numerics, transforms

pytestmark = pytest.mark.skipif(not _numerics.on_one_cpu_device(), reason="the ordering applies on one CPU device")

SPECIAL = [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 2.0])
def test_after_gradient_leaves_every_value_bit_for_bit(dtype, first):
  x = jnp.asarray(SPECIAL, dtype)
  grad = jnp.asarray([first, 1.0], dtype)
  y, count = jax.jit(transforms._after_gradient)(grad, (x, jnp.int32(7)))
  assert np.asarray(y).tobytes() == np.asarray(x).tobytes()
  assert int(count) == 7
