"""Flax linen models of the reproductions and the path rules that declare their constraints.

Layers take PyTorch's default initialisation unless told otherwise (weights and
biases ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, what the paper's code used) and
name their parameters ``kernel`` and ``bias`` as Flax's own layers do, so a
constraint is declared by the parameter's path, e.g. ``{"layer[1-8]/kernel":
cola.Orthogonal()}``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
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
  """``"layer1/kernel"`` for the key path of a parameter leaf."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def path_rules(rules: Mapping[str, Any]) -> Callable[[Any], Any]:
  """``params -> tree of constraints``: each leaf gets the value of the first rule whose regular
  expression matches its whole path (``"layer1/kernel"``), ``None`` (free) where none does.

  The callable goes to ``constraints=`` of ``cola.cola_od``/``cola.cola_ud``, or ``radius=``/``mask=``
  of the named methods. It has the meaning of ``cola.path_constraints(rules)``, which replaces it
  once available.
  """
  compiled = [(re.compile(pattern), value) for pattern, value in rules.items()]

  def constraints(params):
    def pick(path, _):
      name = param_path(path)
      return next((value for pattern, value in compiled if pattern.fullmatch(name)), None)

    return jax.tree_util.tree_map_with_path(pick, params)

  return constraints
