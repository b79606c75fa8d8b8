"""Flax linen models of the reproductions.

Layers take PyTorch's default initialisation unless told otherwise (weights and
biases ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, what the paper's code used) and
name their parameters ``kernel`` and ``bias`` as Flax's own layers do, so a
constraint is declared by the parameter's path, e.g.
``cola.path_constraints([("^layer[1-8]/kernel$", cola.Orthogonal())])``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

Initializer = Callable[[jax.Array, tuple, Any], jax.Array]


def torch_uniform(fan_in: int) -> Initializer:
  """PyTorch's default ``nn.Linear``/``nn.Conv2d`` init: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class Dense(nn.Module):
  """``x @ kernel + bias``, kernel ``(fan_in, features)``; PyTorch's init unless ``kernel_init``."""

  features: int
  kernel_init: Initializer | None = None

  @nn.compact
  def __call__(self, x):
    fan_in = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init or torch_uniform(fan_in), (fan_in, self.features))
    bias = self.param("bias", torch_uniform(fan_in), (self.features,))
    return x @ kernel + bias


class MLP(nn.Module):
  """Dense layers ``layer0 .. layer{n-1}`` of ``widths`` (the last one the output), ``activation``
  between them. ``kernel_init(i)`` gives layer ``i``'s kernel initializer (None: PyTorch's)."""

  widths: Sequence[int]
  activation: Callable = nn.relu
  kernel_init: Callable[[int], Initializer | None] = lambda i: None

  @nn.compact
  def __call__(self, x):
    x = x.reshape(len(x), -1)
    for i, width in enumerate(self.widths):
      if i:
        x = self.activation(x)
      x = Dense(width, kernel_init=self.kernel_init(i), name=f"layer{i}")(x)
    return x


def param_path(path) -> str:
  """``"layer1/kernel"`` for the key path of a parameter leaf, as ``cola.path_constraints`` matches it."""
  return jax.tree_util.keystr(path, simple=True, separator="/")
