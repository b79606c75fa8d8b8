import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402


def mlp_params(key, sizes):
  """A plain MLP as a dict of layers, PyTorch-style uniform init."""
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, kw, kb = jax.random.split(key, 3)
    bound = 1 / jnp.sqrt(fan_in)
    params[f"layer{i}"] = {
        "w": jax.random.uniform(kw, (fan_in, fan_out), minval=-bound, maxval=bound),
        "b": jax.random.uniform(kb, (fan_out,), minval=-bound, maxval=bound),
    }
  return params


def mlp_apply(params, x):
  layers = [params[k] for k in sorted(params, key=lambda k: int(k[5:]))]
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ layers[-1]["w"] + layers[-1]["b"]


def regression_data(key, n, d_in, d_out):
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (n, d_in))
  y = jnp.tanh(x @ jax.random.normal(kw, (d_in, d_out)))
  return x, y


@pytest.fixture
def mlp_problem():
  """(params, loss_fn(params, batch_index)) for a small MLP regression."""
  params = mlp_params(jax.random.key(0), [5, 16, 16, 3])
  x, y = regression_data(jax.random.key(1), 64, 5, 3)

  def loss(p, i):
    start = (i * 8) % 64
    xb = jax.lax.dynamic_slice_in_dim(x, start, 8)
    yb = jax.lax.dynamic_slice_in_dim(y, start, 8)
    return jnp.mean((mlp_apply(p, xb) - yb) ** 2)

  return params, loss
