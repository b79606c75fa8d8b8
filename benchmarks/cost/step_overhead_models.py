"""The models and method pairs of :mod:`benchmarks.cost.step_overhead`: plain jnp MLPs, each CoLA method
beside the optax optimizer it reduces to."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import cola_jax as cola

METHODS = ("c_cola_od", "c_cola_ud", "o_cola_od", "o_cola_ud", "i_cola_od", "i_cola_ud")

# ----------------------------------------------------------------------------
# Models: plain jnp MLPs as dicts of layers {'Dense_i': {'kernel', 'bias'}}.


class Model(NamedTuple):
  name: str
  sizes: tuple
  batch: int
  loss: str  # 'softmax' or 'bce'
  radius: dict  # layer name -> circle radius


def init_mlp(key, sizes):
  """Glorot-uniform kernels, zero biases (Flax's Dense defaults are similar)."""
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    params[f"Dense_{i}"] = {
      "kernel": jax.random.uniform(sub, (fan_in, fan_out), jnp.float32, -bound, bound),
      "bias": jnp.zeros((fan_out,), jnp.float32),
    }
  return params


def apply_mlp(params, x):
  n = len(params)
  for i in range(n):
    layer = params[f"Dense_{i}"]
    x = x @ layer["kernel"] + layer["bias"]
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def make_loss(model: Model) -> Callable:
  if model.loss == "softmax":

    def loss(params, batch):
      x, y = batch
      return optax.softmax_cross_entropy_with_integer_labels(apply_mlp(params, x), y).mean()
  else:

    def loss(params, batch):
      x, y = batch
      return optax.sigmoid_binary_cross_entropy(apply_mlp(params, x)[:, 0], y).mean()

  return loss


def make_batch(model: Model, key):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (model.batch, model.sizes[0]), jnp.float32)
  if model.loss == "softmax":
    y = jax.random.randint(ky, (model.batch,), 0, model.sizes[-1])
  else:
    y = jax.random.bernoulli(ky, 0.5, (model.batch,)).astype(jnp.float32)
  return x, y


def models(smoke: bool) -> list[Model]:
  if smoke:
    return [
      Model("mlp784", (48, 64, 10), 16, "softmax", {"Dense_0": 0.05, "Dense_1": 0.1}),
      Model("spiral8x100", (2, 8, 8, 1), 5, "bce", {f"Dense_{i}": 0.3 for i in range(3)}),
    ]
  spiral = (2,) + (100,) * 8 + (1,)
  return [
    Model("mlp784", (784, 1000, 10), 128, "softmax", {"Dense_0": 0.05, "Dense_1": 0.1}),
    Model("spiral8x100", spiral, 25, "bce", {f"Dense_{i}": 0.3 for i in range(len(spiral) - 1)}),
  ]


# ----------------------------------------------------------------------------
# Methods and baselines.


def zero_sum_fixed_norm(radius: float):
  """Per unit: the entries sum to zero and the norm is ``radius`` (two components)."""
  return lambda unit: jnp.stack([jnp.sum(unit), jnp.sum(unit * unit) / radius**2 - 1])


def make_pair(method: str, model: Model, args, temperature: float):
  """(method transform, baseline transform, baseline name, hyperparameters)."""
  noise = {} if temperature == 0 else {"temperature": temperature, "key": jax.random.key(7)}
  if method in ("i_cola_od", "i_cola_ud"):
    # Norm 1: the first update projects the initial columns (norm about 1) from
    # nearby, as MaxNorm(1.0) leaves them in place.
    implicit = {
      layer: {"kernel": cola.Implicit(equality=zero_sum_fixed_norm(1.0), axis=0), "bias": None}
      for layer in model.radius
    }
    sphere = {layer: {"kernel": cola.MaxNorm(1.0), "bias": None} for layer in model.radius}
    # A key each: the timed calls donate their state, the key included.
    fresh = lambda: {k: jax.random.key(7) if k == "key" else v for k, v in noise.items()}
    if method == "i_cola_od":
      h = args.h_c_od
      make = lambda c: cola.cola_od(h, constraints=c, **fresh())
      hyper = {"h": h, "radius": 1.0}
    else:
      h, gamma = args.h_c_ud, args.friction
      make = lambda c: cola.cola_ud(h, friction=gamma, constraints=c, **fresh())
      hyper = {"h": h, "friction": gamma, "radius": 1.0}
    return (
      make(implicit),
      make(sphere),
      f"{method[2:]} MaxNorm, tau={temperature:g}",
      {**hyper, "constraint": "Implicit(zero sum, norm r; axis=0)"},
    )
  if method == "c_cola_od":
    h = args.h_c_od
    return (
      cola.c_cola_od(h, radius=model.radius, **noise),
      optax.sgd(h),
      f"sgd({h})",
      {"h": h, "radius": model.radius},
    )
  if method == "c_cola_ud":
    h, gamma = args.h_c_ud, args.friction
    lr, mom = cola.langevin_to_sgd_momentum(h, gamma)
    return (
      cola.c_cola_ud(h, friction=gamma, radius=model.radius, **noise),
      optax.sgd(lr, momentum=mom),
      f"sgd({lr:.4g}, momentum={mom:.4g})",
      {"h": h, "friction": gamma, "radius": model.radius},
    )
  kernels = {layer: {"kernel": True, "bias": False} for layer in model.radius}
  if method == "o_cola_od":
    h = args.h_o_od
    return (cola.o_cola_od(h, mask=kernels, **noise), optax.sgd(h), f"sgd({h})", {"h": h})
  if method == "o_cola_ud":
    h, gamma = args.h_o_ud, args.friction
    lr, mom = cola.langevin_to_sgd_momentum(h, gamma)
    return (
      cola.o_cola_ud(h, friction=gamma, mask=kernels, **noise),
      optax.sgd(lr, momentum=mom),
      f"sgd({lr:.4g}, momentum={mom:.4g})",
      {"h": h, "friction": gamma},
    )
  raise ValueError(method)
