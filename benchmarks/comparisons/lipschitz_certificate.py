"""What ``lipschitz.py`` measures of a trained network: the kernels its layers use, their exact spectral norms
and product ``L`` (an upper bound of the L2 Lipschitz constant), the accuracy certified at each radius by ``L``,
and two lower bounds of the constant (Jacobian norms, ratios over pairs of inputs)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.comparisons.lipschitz_model import LipschitzMLP
from benchmarks.harness import data


def used_kernels(model: LipschitzMLP, variables: dict, sample: jax.typing.ArrayLike) -> list[np.ndarray]:
  """The kernel each layer uses at evaluation, in order (``W / sigma_est`` under SpectralNorm), as float64."""
  _, sown = model.apply(variables, sample, mutable=["intermediates"])
  layers = sown["intermediates"]
  return [np.asarray(layers[f"layer{i}"]["kernel"][0], np.float64) for i in range(len(model.widths))]


def spectral_norms(kernels: Sequence[np.ndarray]) -> list[float]:
  """The exact largest singular value of each kernel (LAPACK's float64 SVD)."""
  return [float(np.linalg.svd(k, compute_uv=False)[0]) for k in kernels]


def certified(logits: np.ndarray, labels: np.ndarray, lipschitz: float, radii) -> tuple[float, list[float]]:
  """Clean accuracy, and per radius the fraction correct with ``margin / (sqrt(2) L) > radius``."""
  top2 = np.sort(logits.astype(np.float64), axis=-1)[:, -2:]
  margin = top2[:, 1] - top2[:, 0]
  correct = np.argmax(logits, -1) == labels
  return float(correct.mean()), [float(np.mean(correct & (margin / (math.sqrt(2) * lipschitz) > r))) for r in radii]


@functools.partial(jax.jit, static_argnums=0)
def logits_of(model: LipschitzMLP, variables: dict, x: jax.Array):
  """The logits of the rows of ``x``, in evaluation mode."""
  return model.apply(variables, x)


@functools.partial(jax.jit, static_argnums=0)
def jacobians(model: LipschitzMLP, variables: dict, x: jax.Array) -> jax.Array:
  """The Jacobian ``(outputs, inputs)`` of the logits with respect to the flattened input at each row of ``x``."""
  f = lambda xi: model.apply(variables, xi[None])[0]
  return jax.vmap(jax.jacrev(f))(x).reshape(len(x), model.widths[-1], -1)


def jacobian_norms(model: LipschitzMLP, variables: dict, x: jax.Array) -> np.ndarray:
  """The spectral norm of the Jacobian of the logits with respect to the input at each row of ``x``."""
  return np.linalg.norm(np.asarray(jacobians(model, variables, x), np.float64), ord=2, axis=(1, 2))


def pair_ratios(logits: np.ndarray, x: np.ndarray, pairs: int, seed: int) -> np.ndarray:
  """``|f(x_i) - f(x_j)| / |x_i - x_j|`` over ``pairs`` random pairs ``i != j`` of the rows of ``x``."""
  rng = np.random.default_rng(seed)
  i = rng.integers(0, len(x), pairs)
  j = (i + rng.integers(1, len(x), pairs)) % len(x)
  flat = x.reshape(len(x), -1).astype(np.float64)
  out = logits.astype(np.float64)
  return np.linalg.norm(out[i] - out[j], axis=1) / np.linalg.norm(flat[i] - flat[j], axis=1)


def measure(model: LipschitzMLP, variables: dict, dataset: data.Dataset, args, seed: int) -> dict:
  """What a trained network is measured by (the module docstring): one seed's values."""
  logits = np.asarray(logits_of(model, variables, dataset.x_test))
  norms = spectral_norms(used_kernels(model, variables, dataset.x_test[:1]))
  lipschitz = math.prod(norms)
  clean, robust = certified(logits, dataset.y_test, lipschitz, args.radii)
  jac = jacobian_norms(model, variables, jnp.asarray(dataset.x_test[: args.jacobian_points]))
  return {
    "test_accuracy": clean,
    "certified_accuracy": robust,
    "lipschitz_bound": lipschitz,
    "layer_norms": norms,
    "max_layer_norm": max(norms),
    "empirical_lipschitz_jacobian": float(jac.max()),
    "empirical_lipschitz_pairs": float(pair_ratios(logits, dataset.x_test, args.pairs, seed).max()),
  }
