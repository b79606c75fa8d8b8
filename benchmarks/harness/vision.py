"""Flax linen convolutional models: a small CNN and CIFAR-style ResNets with BatchNorm.

Convs use PyTorch's padding and, through :func:`torch_init`, PyTorch's default
initialisation; BatchNorm is PyTorch's (momentum 0.1, eps 1e-5), its running
statistics Flax's ``batch_stats`` collection (updated with ``train=True``, used
with ``train=False``). Parameters are named as Flax's layers name them
(``conv1/kernel``, ``stage2_block0/shortcut_conv/kernel``), so that constraints
are declared by path with :func:`cola_jax.path_constraints`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from .models import param_path

RESNET_STAGES = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


def conv3x3(features: int, stride: int = 1, use_bias: bool = True, **kw):
  """A 3x3 conv with PyTorch's padding 1."""
  return nn.Conv(features, (3, 3), strides=stride, padding=((1, 1), (1, 1)), use_bias=use_bias, **kw)


class SmallCNN(nn.Module):
  """``conv0`` 3x3 1->16, ``conv1`` 3x3 16->32 /2, ``conv2`` 3x3 32->64 /2, each with a bias and ReLU,
  then ``dense`` -> classes (28 -> 28 -> 14 -> 7 on Fashion-MNIST). No BatchNorm."""

  channels: Sequence[int] = (16, 32, 64)
  strides: Sequence[int] = (1, 2, 2)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    """Logits; ``train`` is accepted for the interface the ResNets share (nothing depends on it)."""
    del train
    for i, (features, stride) in enumerate(zip(self.channels, self.strides)):
      x = nn.relu(conv3x3(features, stride, name=f"conv{i}")(x))
    return nn.Dense(self.num_classes, name="dense")(x.reshape(x.shape[0], -1))


def batch_norm(train: bool, name: str):
  """BatchNorm as PyTorch's: running averages with momentum 0.1, eps 1e-5."""
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)


class BasicBlock(nn.Module):
  """Two 3x3 convs with BatchNorm; a 1x1 conv + BatchNorm shortcut when the shape changes."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    y = conv3x3(self.features, self.stride, use_bias=False, name="conv1")(x)
    y = nn.relu(batch_norm(train, "bn1")(y))
    y = conv3x3(self.features, use_bias=False, name="conv2")(y)
    y = batch_norm(train, "bn2")(y)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = nn.Conv(self.features, (1, 1), strides=self.stride, use_bias=False, name="shortcut_conv")(x)
      x = batch_norm(train, "shortcut_bn")(x)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """CIFAR-style ResNet (He et al. 2016): a 3x3 stem ``conv0`` + BatchNorm (no max-pool), stages of
  BasicBlocks with ``width`` x 1, 2, 4, 8 channels (stride 2 at the first block of stages 2-4),
  global average pooling, ``dense``. Convs have no bias."""

  stage_sizes: Sequence[int]
  width: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = conv3x3(self.width, use_bias=False, name="conv0")(x)
    x = nn.relu(batch_norm(train, "bn0")(x))
    for stage, blocks in enumerate(self.stage_sizes):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(self.width * 2**stage, stride, name=f"stage{stage + 1}_block{block}")(x, train)
    return nn.Dense(self.num_classes, name="dense")(jnp.mean(x, axis=(1, 2)))


def model(name: str, width: int = 64, num_classes: int = 10) -> nn.Module:
  """``"small"`` (:class:`SmallCNN`), ``"resnet18"`` or ``"resnet34"`` (2-2-2-2 or 3-4-6-3 blocks)."""
  if name == "small":
    return SmallCNN(num_classes=num_classes)
  if name not in RESNET_STAGES:
    raise ValueError(f"model must be 'small' or one of {', '.join(RESNET_STAGES)}, got {name!r}")
  return ResNet(RESNET_STAGES[name], width, num_classes)


def torch_init(key, shapes) -> tuple[dict, dict]:
  """PyTorch's default initial ``(params, batch_stats)`` for the shapes of a Flax model's variables
  (``jax.eval_shape`` of its ``init``).

  Kernels and the biases beside them are ``U(+-1/sqrt(fan_in))`` with ``fan_in =
  prod(kernel.shape[:-1])`` (``kh*kw*in`` for a conv); BatchNorm scale 1, bias 0,
  running mean 0 and variance 1. One uniform draw cut into leaves, in the order of
  the flattened parameters (XLA compiles one random draw per shape, slowly on a CPU).
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes["params"])
  draws = np.asarray(jax.random.uniform(key, (sum(s.size for _, s in leaves),), jnp.float32, -1, 1))
  kernels = {param_path(path[:-1]): s.shape for path, s in leaves if param_path(path[-1:]) == "kernel"}
  values, start = [], 0
  for path, s in leaves:
    module, name = param_path(path[:-1]), param_path(path[-1:])
    if module in kernels:
      bound = 1.0 / math.sqrt(math.prod(kernels[module][:-1]))
      values.append(bound * draws[start : start + s.size].reshape(s.shape))
      start += s.size
    else:  # BatchNorm
      values.append(np.full(s.shape, 1.0 if name == "scale" else 0.0, np.float32))
  batch_stats = jax.tree_util.tree_map_with_path(
    lambda path, s: jnp.full(s.shape, 1.0 if param_path(path[-1:]) == "var" else 0.0, s.dtype),
    shapes.get("batch_stats", {}),
  )
  return jax.tree.map(jnp.asarray, treedef.unflatten(values)), batch_stats


def orthogonality_defects(params) -> dict:
  """``{'conv1/kernel': max |Q^T Q - I|, ...}`` for every conv kernel (4-d leaf), by path: the
  ``(kh, kw, in, out)`` kernel viewed as its tall matrix ``Q`` (float64)."""
  defects = {}
  for path, kernel in jax.tree_util.tree_flatten_with_path(params)[0]:
    if np.ndim(kernel) == 4:
      w = np.asarray(kernel, np.float64).reshape(-1, kernel.shape[-1])
      q = w if w.shape[0] >= w.shape[1] else w.T
      defects[param_path(path)] = float(np.max(np.abs(q.T @ q - np.eye(q.shape[1]))))
  return defects
