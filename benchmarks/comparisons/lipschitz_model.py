"""The MLP of ``lipschitz.py``: Dense layers with PyTorch's init and ReLU between them (1-Lipschitz when every
kernel is in the unit spectral-norm ball), optionally each wrapped in Flax's ``SpectralNorm``, and its training
step and scanned epoch."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from benchmarks.harness import models


class Dense(nn.Module):
  """``x @ kernel + bias`` with PyTorch's init, sowing the kernel it uses (``W / sigma_est`` under SpectralNorm)."""

  features: int

  @nn.compact
  def __call__(self, x):
    fan_in = x.shape[-1]
    kernel = self.param("kernel", models.torch_uniform(fan_in), (fan_in, self.features))
    bias = self.param("bias", models.torch_uniform(fan_in), (self.features,))
    self.sow("intermediates", "kernel", kernel)
    return x @ kernel + bias


class LipschitzMLP(nn.Module):
  """Dense layers ``layer0 ..`` of ``widths`` with ReLU between them, each wrapped in Flax's ``SpectralNorm``
  with ``spectral_norm`` (its power-iteration estimate updated when ``train``)."""

  widths: Sequence[int]
  spectral_norm: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape(len(x), -1)
    for i, width in enumerate(self.widths):
      if i:
        x = nn.relu(x)
      layer = Dense(width, name=f"layer{i}")
      x = nn.SpectralNorm(layer)(x, update_stats=train) if self.spectral_norm else layer(x)
    return x


def model_of(name: str, widths) -> LipschitzMLP:
  return LipschitzMLP(tuple(widths), spectral_norm=name == "flax_spectral_norm")


def initial_variables(name: str, widths, seed: int, sample: jax.typing.ArrayLike) -> dict:
  """Seed ``seed``'s parameters, the same for every method, and SpectralNorm's ``batch_stats`` (its random start
  vectors ``u``) for ``flax_spectral_norm``; ``{}`` for the others."""
  init_key, power_key = jax.random.split(jax.random.key(seed))
  params = model_of("adam", widths).init(init_key, sample)["params"]
  stats = model_of(name, widths).init(power_key, sample).get("batch_stats", {})
  return {"params": params, "batch_stats": stats}


def loss_fn(model: LipschitzMLP):
  """``(params, batch_stats, x, y) -> (mean cross-entropy, updated batch_stats)`` in training mode."""

  def loss(params, stats, x, y):
    logits, mutated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), mutated.get("batch_stats", stats)

  return loss


def training_step(model: LipschitzMLP, tx: optax.GradientTransformation):
  """``(params, stats, opt_state, x, y) -> (params, stats, opt_state, loss)``: one step, not jitted."""
  grad = jax.value_and_grad(loss_fn(model), has_aux=True)

  def step(params, stats, opt_state, x, y):
    (loss, stats), grads = grad(params, stats, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, loss

  return step


def epoch_fn(model: LipschitzMLP, tx: optax.GradientTransformation, batch: int, n: int):
  """A jitted epoch: ``((params, stats, opt_state), x, y, key) -> (carry, mean loss)``, minibatches in the
  order ``permutation(key, n)``, scanned."""
  step = training_step(model, tx)
  steps = n // batch

  def epoch(carry, x, y, key):
    order = jax.random.permutation(key, n)[: steps * batch].reshape(steps, batch)

    def one(carry, idx):
      params, stats, opt_state = carry
      params, stats, opt_state, loss = step(params, stats, opt_state, x[idx], y[idx])
      return (params, stats, opt_state), loss

    carry, losses = jax.lax.scan(one, carry, order)
    return carry, jnp.mean(losses)

  return jax.jit(epoch, donate_argnums=0)
