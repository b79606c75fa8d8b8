import importlib
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax
import pytest


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


def cnn_params(key):
  """A conv kernel (3,3,2,4) = 18x4 tall, then tall, wide and square dense layers."""
  k = jax.random.split(key, 5)
  return {
    "conv": {"kernel": 0.3 * jax.random.normal(k[0], (3, 3, 2, 4)), "bias": jnp.zeros(4)},
    "tall": {"kernel": 0.3 * jax.random.normal(k[1], (16, 6)), "bias": jnp.zeros(6)},
    "wide": {"kernel": 0.3 * jax.random.normal(k[2], (6, 10)), "bias": jnp.zeros(10)},
    "square": {"kernel": 0.3 * jax.random.normal(k[3], (10, 10)), "bias": jnp.zeros(10)},
    "out": {"kernel": 0.3 * jax.random.normal(k[4], (10, 3)), "bias": jnp.zeros(3)},
  }


def cnn_apply(p, x):
  x = jax.lax.conv_general_dilated(x, p["conv"]["kernel"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  x = jax.nn.relu(x + p["conv"]["bias"]).reshape(x.shape[0], -1)  # 2x2x4 = 16
  for name in ("tall", "wide", "square"):
    x = jnp.tanh(x @ p[name]["kernel"] + p[name]["bias"])
  return x @ p["out"]["kernel"] + p["out"]["bias"]


@pytest.fixture(scope="session")
def cnn_problem():
  """(params, loss_fn(params, step)) for a small CNN classifier on random 4x4x2 images."""
  kx, ky = jax.random.split(jax.random.key(42))
  x = jax.random.normal(kx, (256, 4, 4, 2))
  labels = jax.random.randint(ky, (256,), 0, 3)

  def loss(p, i):
    start = (i * 16) % 256
    xb = jax.lax.dynamic_slice_in_dim(x, start, 16)
    yb = jax.lax.dynamic_slice_in_dim(labels, start, 16)
    return optax.softmax_cross_entropy_with_integer_labels(cnn_apply(p, xb), yb).mean()

  return cnn_params(jax.random.key(0)), loss


@pytest.fixture(scope="session")
def load_benchmark():
  """Imports ``benchmarks.NAME`` (``"paper.spiral"``, ``"cost.scale"``): the scripts' package, from the clone."""
  return lambda name: importlib.import_module(f"benchmarks.{name}")
