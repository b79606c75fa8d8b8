"""Orthogonal convolutions: o-CoLA-ud against SGD-m (the paper's ResNet-34 / CIFAR-10 experiment).

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 "Orthogonality Constraints" (the figure labelled
``OG-OBA_Resnet``) and Appendix C (the text before ``CSGD_Resnet``). The
paper trains a ResNet-34 with BatchNorm on CIFAR-10 for 150 epochs, batch 128,
SGD-m with learning rate 0.1 (divided by 10 every 50 epochs) and momentum 0.9,
with and without weight decay, against o-CoLA-ud (gamma = 0.5, tau = 0, no
weight decay) whose step size is "re-scaled to match the parameters of SGD-m"
and follows the same schedule. It reports that o-CoLA-ud without weight decay
strongly outperforms SGD-m without weight decay (no numbers, only curves).

This script runs that comparison on a CPU-sized stand-in by default and the
paper's set-up when a GPU and the CIFAR-10 files are at hand.

* models (``--model``):

  - ``small`` (default): a CNN for 28x28x1 images, conv0 3x3 1->16 (stride 1),
    conv1 3x3 16->32 (stride 2), conv2 3x3 32->64 (stride 2), each with a bias
    and ReLU, PyTorch's padding 1 (28 -> 28 -> 14 -> 7), then one dense layer
    7*7*64 -> 10. No BatchNorm.
  - ``resnet18`` / ``resnet34``: CIFAR-style ResNets (He et al. 2016, the
    variant of the usual CIFAR-10 PyTorch code): a 3x3 stem conv (stride 1,
    no max-pool), BasicBlocks of two 3x3 convs with BatchNorm in 4 stages of
    ``--width`` x (1, 2, 4, 8) channels (2-2-2-2 or 3-4-6-3 blocks; stride 2
    at the first block of stages 2-4, with a 1x1 conv + BatchNorm shortcut
    there), global average pooling, one dense layer. Convs have no bias.
    BatchNorm as PyTorch's (momentum 0.1, eps 1e-5); its running statistics
    are Flax's ``batch_stats`` collection, updated in training mode and used
    for evaluation.

  Weights and biases: PyTorch's default init ``U(+-1/sqrt(fan_in))``
  (``fan_in = kh*kw*in`` for a conv), BatchNorm scale 1 and bias 0.
* constraints (o-CoLA-ud): every conv kernel **except the first** (``conv0``,
  the stem) is :class:`cola_jax.Orthogonal`: the ``(kh, kw, in, out)`` kernel
  viewed as the ``(kh*kw*in, out)`` matrix has orthonormal columns (tall) or
  rows (wide; the ResNets' 1x1 shortcut convs ``in -> 2 in``). The first conv,
  the dense layer, biases and BatchNorm parameters are free. In the small CNN
  the constrained kernels are conv1 (144 x 32) and conv2 (288 x 64); conv0
  (9 x 16, wide) is free. (The paper does not say which ResNet layers it
  constrained; leaving the input layer free follows its spiral experiment.)
* methods. Seed ``s`` fixes the initial parameters, the minibatch order and
  the augmentation, the same for every method (a paired comparison). Every
  method starts from the same parameters, PyTorch's init (the paper's SGD-m
  used it because orthogonal init hurt SGD-m); o-CoLA-ud's first update
  replaces each constrained kernel by its polar factor (the nearest
  orthonormal matrix) before it steps, so its run starts on the manifold.

  - ``ocola_ud``: ``cola.o_cola_ud(h, friction=0.5, mask=...)`` at ``tau = 0``,
    ``h = sqrt(lr)`` with ``lr`` SGD-m's scheduled learning rate (so ``h`` is
    divided by ``sqrt(10)`` at each decay and ``h**2`` always equals SGD-m's
    learning rate). With gamma = 0.5 the equivalent SGD momentum
    ``exp(-gamma h)`` is 0.854, then 0.951 and 0.984 after the decays (the
    paper's gamma, not the 0.333 that would give momentum 0.9 at h = 0.316).
  - ``sgdm``: ``optax.sgd(lr, momentum=0.9)``, ``lr`` 0.1 divided by 10 at the
    decay epochs;
  - ``sgdm_wd``: the same with weight decay 5e-4 on every parameter, added to
    the gradient before the momentum (PyTorch's ``SGD(weight_decay=...)``).
    The paper does not give its value; 5e-4 is the usual CIFAR-10 ResNet one.

* the paper's schedule mapped to ``--epochs`` E: the learning rate is divided
  by 10 after epochs round(E/3) and round(2E/3) (50 and 100 of 150).
* data (``--dataset``):

  - ``fashion_mnist`` (default for ``small``): IDX files as in
    ``fashion_mnist.py`` (the harness's reader). Training: the first ``--n-train``
    (default 10,000, the paper's Fashion-MNIST protocol: a small training set
    where regularisation matters, and what fits the CPU budget) of the
    official training images; test: the official 10,000 test images. Pixels
    scaled to [0, 1].
  - ``cifar10`` (default for the ResNets): the python (``data_batch_1`` ...
    ``test_batch``) or binary (``data_batch_1.bin`` ... ``test_batch.bin``)
    CIFAR-10 batches in ``--data-dir`` (or its ``cifar-10-batches-py`` /
    ``cifar-10-batches-bin`` folder); 50,000 training and 10,000 test images,
    pixels scaled to [0, 1] and standardised per channel with the training
    set's mean and std; training batches augmented by a random 32x32 crop of
    the image padded by 4 and a random horizontal flip (``--no-augment``: off).

  Minibatches of ``--batch-size`` (128) from a new permutation every epoch;
  the last ``n_train mod batch`` images of each permutation are skipped (full
  batches only, so that BatchNorm always sees a full batch).

Seeds run one after another (convolutions vmapped over seeds become grouped
convolutions, slower than sequential runs on a CPU), and each step is one
jitted call from Python (XLA's CPU convolutions are much slower inside a
``lax.scan``). Runs advance in rounds of ``--eval-every`` epochs, every
(method, seed) in turn, and the JSON is rewritten after each round.

Usage::

    python benchmarks/orthogonal_cnn.py                     # small CNN, Fashion-MNIST, 3 seeds, 18 epochs
    python benchmarks/orthogonal_cnn.py --smoke             # seconds (synthetic data with --synthetic)
    python benchmarks/orthogonal_cnn.py --smoke --model resnet18   # tiny ResNet on synthetic 32x32x3
    python benchmarks/orthogonal_cnn.py --model resnet34 --dataset cifar10 \\
        --data-dir ~/data/cifar-10 --epochs 150 --seeds 5   # the paper's set-up, on a GPU

Writes ``orthogonal_cnn.json`` and ``orthogonal_cnn.png`` under ``--out``;
prints a table.
"""

import argparse
import functools
import math
import os
import pathlib
import pickle
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import cola_jax as cola

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
from _common import finite_list, mean_std, mean_std_fields, provenance, write_json
from harness import data as harness_data
from harness.report import output_dir

SCHEMA_VERSION = 1
METHODS = ("ocola_ud", "sgdm", "sgdm_wd")
# The paper's ResNet-34 / CIFAR-10 hyperparameters (caption of OG-OBA_Resnet, Appendix C).
SGD_LR = 0.1
MOMENTUM = 0.9
FRICTION = 0.5
DECAY_FACTOR = 0.1
PAPER_EPOCHS, PAPER_DECAY_EPOCHS = 150, (50, 100)
WEIGHT_DECAY = 5e-4  # not in the paper: the usual CIFAR-10 ResNet value
FREE_CONV = "conv0"  # the first conv, left unconstrained
MODELS = ("small", "resnet18", "resnet34")
DATASETS = ("fashion_mnist", "cifar10")
DEFAULT_EPOCHS, DEFAULT_SEEDS = 18, 3
SMOKE = dict(seeds=2, epochs=2, n_train=256, n_test=256, batch_size=64, width=4)
IDX_KEYS = ("train_images", "train_labels", "test_images", "test_labels")
CIFAR_FILES = {
  "py": ([f"data_batch_{i}" for i in range(1, 6)], "test_batch"),
  "bin": ([f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin"),
}

# main() leaves its runs here: LAST_RUN[method] = {'init': [variables per seed],
# 'final': [variables per seed], 'opt_state': [final optimizer state per seed]}.
LAST_RUN: dict = {}


def describe(method: str) -> str:
  h = math.sqrt(SGD_LR)
  return {
    "ocola_ud": f"o-CoLA-ud h={h:.3f} gamma={FRICTION:g} tau=0",
    "sgdm": f"SGD-m lr={SGD_LR:g} mom={MOMENTUM:g}",
    "sgdm_wd": f"SGD-m lr={SGD_LR:g} mom={MOMENTUM:g} WD {WEIGHT_DECAY:g}",
  }[method]


class Config(NamedTuple):
  model: str = "small"
  dataset: str = "fashion_mnist"
  seeds: int = DEFAULT_SEEDS
  epochs: int = DEFAULT_EPOCHS
  decay_epochs: tuple = (6, 12)
  methods: tuple = METHODS
  n_train: int = 10_000
  n_test: int = 10_000
  batch_size: int = 128
  eval_every: int = 1
  eval_batch: int = 1000
  width: int = 64
  augment: bool = False


# ----------------------------------------------------------------------------- models


def conv3x3(features: int, stride: int = 1, use_bias: bool = True, **kw):
  """A 3x3 conv with PyTorch's padding 1."""
  return nn.Conv(features, (3, 3), strides=stride, padding=((1, 1), (1, 1)), use_bias=use_bias, **kw)


class SmallCNN(nn.Module):
  """conv0 3x3 1->16, conv1 3x3 16->32 /2, conv2 3x3 32->64 /2, ReLU, dense -> classes."""

  channels: Sequence[int] = (16, 32, 64)
  strides: Sequence[int] = (1, 2, 2)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    """Logits; ``train`` is accepted for a common interface (no BatchNorm here)."""
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
  """CIFAR-style ResNet: 3x3 stem, 4 stages of BasicBlocks, global average pool, dense."""

  stage_sizes: Sequence[int]
  width: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = conv3x3(self.width, use_bias=False, name=FREE_CONV)(x)
    x = nn.relu(batch_norm(train, "bn0")(x))
    for stage, blocks in enumerate(self.stage_sizes):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(self.width * 2**stage, stride, name=f"stage{stage + 1}_block{block}")(x, train)
    return nn.Dense(self.num_classes, name="dense")(jnp.mean(x, axis=(1, 2)))


def make_model(name: str, width: int = 64) -> nn.Module:
  if name == "small":
    return SmallCNN()
  return ResNet({"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}[name], width)


def torch_init(key, shapes) -> tuple[dict, dict]:
  """PyTorch's default initial ``(params, batch_stats)`` for the shapes of a Flax model's variables.

  Kernels and the biases beside them are ``U(+-1/sqrt(fan_in))`` with
  ``fan_in = prod(kernel.shape[:-1])`` (``kh*kw*in`` for a conv); BatchNorm
  scale 1, bias 0, running mean 0 and variance 1. One uniform draw cut into
  leaves (XLA compiles one random draw per shape, slowly on a CPU).
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes["params"])
  draws = np.asarray(jax.random.uniform(key, (sum(s.size for _, s in leaves),), jnp.float32, -1, 1))
  kernels = {_path_name(path[:-1]): s.shape for path, s in leaves if _path_name(path[-1:]) == "kernel"}
  values, start = [], 0
  for path, s in leaves:
    module, name = _path_name(path[:-1]), _path_name(path[-1:])
    if module in kernels:
      bound = 1.0 / math.sqrt(math.prod(kernels[module][:-1]))
      values.append(bound * draws[start : start + s.size].reshape(s.shape))
      start += s.size
    else:  # BatchNorm
      values.append(np.full(s.shape, 1.0 if name == "scale" else 0.0, np.float32))
  batch_stats = jax.tree_util.tree_map_with_path(
    lambda path, s: jnp.full(s.shape, 1.0 if _path_name(path[-1:]) == "var" else 0.0, s.dtype),
    shapes.get("batch_stats", {}),
  )
  return jax.tree.map(jnp.asarray, treedef.unflatten(values)), batch_stats


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def orthogonal_mask(params) -> Any:
  """True on every conv kernel (4-d ``kernel`` leaf) but the first conv's."""
  return jax.tree_util.tree_map_with_path(
    lambda path, p: p.ndim == 4 and _path_name(path).endswith("kernel") and _path_name(path).split("/")[0] != FREE_CONV,
    params,
  )


def conv_kernels(params) -> dict:
  """``{'conv1/kernel': array, ...}``: every conv kernel, by path."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {_path_name(path): p for path, p in leaves if p.ndim == 4}


def orthogonality_defect(kernel) -> float:
  """``max |Q^T Q - I|`` of a kernel viewed as its tall matrix (float64)."""
  w = np.asarray(kernel, np.float64).reshape(-1, kernel.shape[-1])
  q = w if w.shape[0] >= w.shape[1] else w.T
  return float(np.max(np.abs(q.T @ q - np.eye(q.shape[1]))))


# ----------------------------------------------------------------------------- optimizers


def lr_schedule(scale: float, steps_per_epoch: int, decay_epochs: Sequence[int], factor: float):
  """``scale`` multiplied by ``factor`` after each epoch of ``decay_epochs``."""
  boundaries: dict = {}
  for epoch in decay_epochs:
    step = epoch * steps_per_epoch
    boundaries[step] = boundaries.get(step, 1.0) * factor
  return optax.piecewise_constant_schedule(scale, boundaries)


def make_optimizer(method: str, steps_per_epoch: int, decay_epochs: Sequence[int]):
  """The optax transformation of ``method`` with the paper's step-decay schedule."""
  if method == "ocola_ud":
    # h = sqrt(lr): divided by sqrt(10) when SGD-m's lr is divided by 10.
    h = lr_schedule(math.sqrt(SGD_LR), steps_per_epoch, decay_epochs, math.sqrt(DECAY_FACTOR))
    return cola.o_cola_ud(h, friction=FRICTION, mask=orthogonal_mask)
  sgd = optax.sgd(lr_schedule(SGD_LR, steps_per_epoch, decay_epochs, DECAY_FACTOR), momentum=MOMENTUM)
  if method == "sgdm_wd":
    return optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), sgd)
  if method == "sgdm":
    return sgd
  raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")


# ----------------------------------------------------------------------------- data


def synthetic_images(n_train: int, n_test: int, shape: tuple, seed: int = 0):
  """A stand-in data set: uint8 images of ``shape``, 10 classes, class prototypes + noise."""
  rng = np.random.default_rng(seed)
  prototypes = rng.uniform(0, 255, (10, *shape))

  def draw(n):
    y = rng.integers(0, 10, n).astype(np.int32)
    scale = rng.uniform(0.3, 1.0, (n,) + (1,) * len(shape))
    x = np.clip(prototypes[y] * scale + rng.normal(0, 60, (n, *shape)), 0, 255)
    return x.astype(np.uint8), y

  return draw(n_train), draw(n_test)


def find_cifar10(data_dir: str) -> tuple[str, dict] | None:
  """``(format, {'train': [paths], 'test': path})`` of the CIFAR-10 batches, or None."""
  for directory in (
    data_dir,
    os.path.join(data_dir, "cifar-10-batches-py"),
    os.path.join(data_dir, "cifar-10-batches-bin"),
  ):
    for fmt, (train, test) in CIFAR_FILES.items():
      paths = [os.path.join(directory, f) for f in (*train, test)]
      if all(os.path.isfile(p) for p in paths):
        return fmt, {"train": paths[:-1], "test": paths[-1]}
  return None


def read_cifar10_batch(path: str, fmt: str):
  """One CIFAR-10 batch as ``(uint8 (n, 32, 32, 3), int32 labels)``."""
  if fmt == "py":
    with open(path, "rb") as f:
      batch = pickle.load(f, encoding="bytes")
    x = np.asarray(batch[b"data"], np.uint8)
    y = np.asarray(batch[b"labels"], np.int32)
  else:
    raw = np.fromfile(path, np.uint8).reshape(-1, 1 + 3072)
    x, y = raw[:, 1:], raw[:, 0].astype(np.int32)
  return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y


def load_cifar10(data_dir: str | None):
  """The 50k training and 10k test images and labels, and the files read."""
  found = find_cifar10(data_dir) if data_dir else None
  if found is None:
    raise FileNotFoundError(
      f"CIFAR-10 batches not found in {data_dir!r}: pass --data-dir DIR holding the python "
      "(data_batch_1..5, test_batch) or binary (data_batch_1.bin..5.bin, test_batch.bin) "
      "batches, or their cifar-10-batches-py / cifar-10-batches-bin folder."
    )
  fmt, paths = found
  parts = [read_cifar10_batch(p, fmt) for p in paths["train"]]
  train = (np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))
  return train, read_cifar10_batch(paths["test"], fmt), {"format": fmt, **paths}


def make_data(config: Config, data_dir: str | None, synthetic: bool):
  """``(train, test, info)``: ``(uint8 images (n, h, w, c), int32 labels)`` each."""
  shape = (28, 28, 1) if config.dataset == "fashion_mnist" else (32, 32, 3)
  if synthetic:
    train, test = synthetic_images(config.n_train, config.n_test, shape)
    info = {
      "source": f"SYNTHETIC stand-in ({'x'.join(map(str, shape))} class prototypes + noise); "
      "numbers are meaningless for the paper",
      "synthetic": True,
    }
  elif config.dataset == "fashion_mnist":
    directory = data_dir or harness_data.FASHION_MNIST_DIR
    paths = harness_data.find_idx_files(directory)
    if paths is None:
      raise FileNotFoundError(f"Fashion-MNIST IDX files not found in {directory}. {harness_data.FASHION_MNIST_HINT}")
    x_tr, y_tr, x_te, y_te = (harness_data.read_idx(paths[k]) for k in IDX_KEYS)
    train, test = (x_tr.reshape(-1, *shape), y_tr.astype(np.int32)), (x_te.reshape(-1, *shape), y_te.astype(np.int32))
    info = {"source": "fashion-mnist IDX", "synthetic": False, "files": paths}
  else:
    train, test, paths = load_cifar10(data_dir)
    info = {"source": "CIFAR-10 batches", "synthetic": False, "files": paths}
  for name, (x, _), n in (("train", train, config.n_train), ("test", test, config.n_test)):
    if n > len(x):
      raise ValueError(f"--n-{name} {n} but the {name} set has {len(x)} images")
  train, test = (
    (train[0][: config.n_train], train[1][: config.n_train]),
    (test[0][: config.n_test], test[1][: config.n_test]),
  )
  if not synthetic:
    info.update(
      train=f"official training images 0..{config.n_train - 1}", test=f"official test images 0..{config.n_test - 1}"
    )
  return train, test, info


def pixel_stats(config: Config, x_train: np.ndarray):
  """Per-channel (mean, std) subtracted/divided after scaling to [0, 1] (CIFAR-10 only)."""
  channels = x_train.shape[-1]
  if config.dataset != "cifar10":
    return np.zeros(channels, np.float32), np.ones(channels, np.float32)
  x = x_train.reshape(-1, channels).astype(np.float64) / 255.0
  return x.mean(0).astype(np.float32), x.std(0).astype(np.float32)


def augment(key, x):
  """Random crop of the image padded by 4 (zeros) and random horizontal flip, per image."""
  n, height, width, _ = x.shape
  crop_key, flip_key = jax.random.split(key)
  offsets = jax.random.randint(crop_key, (n, 2), 0, 9)
  flips = jax.random.bernoulli(flip_key, 0.5, (n,))
  padded = jnp.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))

  def one(image, offset, flip):
    image = jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, x.shape[-1]))
    return jnp.where(flip, image[:, ::-1], image)

  return jax.vmap(one)(padded, offsets, flips)


# ----------------------------------------------------------------------------- training


def seed_keys(seed: int):
  """(init key, data-order key) of one seed, the same for every method."""
  init_key, order_key = jax.random.split(jax.random.key(seed))
  return init_key, order_key


def build(method: str, model: nn.Module, config: Config, stats, sample_shape):
  """``init(seed)``, the jitted ``train_step`` and ``eval_chunk`` of one method."""
  steps_per_epoch = config.n_train // config.batch_size
  tx = make_optimizer(method, steps_per_epoch, config.decay_epochs)
  mean, std = (jnp.asarray(s) for s in stats)
  prepare = lambda x: (x.astype(jnp.float32) / 255.0 - mean) / std

  shapes = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0), jnp.zeros((1, *sample_shape)))
  tx_init = jax.jit(tx.init)

  def init(seed):
    params, batch_stats = torch_init(seed_keys(seed)[0], shapes)
    return params, batch_stats, tx_init(params)

  def loss_fn(params, batch_stats, x, y):
    logits, mutated = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (jnp.mean(jnp.argmax(logits, -1) == y), mutated["batch_stats"])

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(carry, images, labels, order, step, augment_key):
    params, batch_stats, opt_state = carry
    idx = jax.lax.dynamic_slice_in_dim(order, step * config.batch_size, config.batch_size)
    x = prepare(images[idx])
    if config.augment:
      x = augment(jax.random.fold_in(augment_key, step), x)
    (loss, (acc, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, x, labels[idx])
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), (loss, acc)

  @jax.jit
  def eval_chunk(params, batch_stats, x, y, weight):
    logits = model.apply({"params": params, "batch_stats": batch_stats}, prepare(x), train=False)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce * weight), jnp.sum((jnp.argmax(logits, -1) == y) * weight)

  return init, train_step, eval_chunk


def eval_chunks(x: np.ndarray, y: np.ndarray, size: int):
  """The test set as device chunks of ``size`` images, the last padded with weight 0."""
  size = min(size, len(x))
  chunks = []
  for start in range(0, len(x), size):
    xb, yb = x[start : start + size], y[start : start + size]
    pad = size - len(xb)
    weight = np.r_[np.ones(len(xb)), np.zeros(pad)].astype(np.float32)
    xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
    chunks.append((jnp.asarray(xb), jnp.asarray(np.r_[yb, np.zeros(pad, yb.dtype)]), jnp.asarray(weight)))
  return chunks


def evaluate(eval_chunk, params, batch_stats, chunks, n: int):
  """(mean test loss, test accuracy)."""
  sums = [eval_chunk(params, batch_stats, *chunk) for chunk in chunks]
  loss, correct = (sum(float(s[i]) for s in sums) for i in (0, 1))
  return loss / n, correct / n


class Run:
  """One (method, seed): its state, the data order, and its history."""

  def __init__(self, method, seed, fns, config):
    self.method, self.seed, self.config = method, seed, config
    init, self.train_step, self.eval_chunk = fns
    self.carry = init(seed)
    self.init_variables = jax.device_get(self.carry[:2])
    self.order_key = seed_keys(seed)[1]
    self.epoch = 0
    self.history = {"epoch": [], "test_accuracy": [], "test_loss": [], "train_loss": [], "train_batch_accuracy": []}
    self.time_s = 0.0

  def train(self, epochs: int, images, labels, chunks) -> None:
    """``epochs`` epochs, then one evaluation on the test set."""
    t0 = time.perf_counter()
    steps = self.config.n_train // self.config.batch_size
    for _ in range(epochs):
      order_key, augment_key = jax.random.split(jax.random.fold_in(self.order_key, self.epoch))
      order = jax.random.permutation(order_key, self.config.n_train)
      metrics = []
      for step in range(steps):
        self.carry, m = self.train_step(self.carry, images, labels, order, jnp.int32(step), augment_key)
        metrics.append(m)
      self.epoch += 1
    loss, acc = (float(jnp.mean(jnp.stack([m[i] for m in metrics]))) for i in (0, 1))
    test_loss, test_acc = evaluate(self.eval_chunk, *self.carry[:2], chunks, self.config.n_test)
    for key, value in (
      ("epoch", self.epoch),
      ("test_accuracy", test_acc),
      ("test_loss", test_loss),
      ("train_loss", loss),
      ("train_batch_accuracy", acc),
    ):
      self.history[key].append(value)
    self.time_s += time.perf_counter() - t0


# ----------------------------------------------------------------------------- reporting


def _epoch_of(arg, values: np.ndarray, epochs: list) -> list:
  """Per seed (column), the epoch where ``arg`` (``np.nanargmax``/``nanargmin``) points; None if all NaN."""
  return [epochs[arg(column)] if np.any(np.isfinite(column)) else None for column in values.T]


def _entry(runs: list, method: str) -> dict:
  """The JSON entry of a method from its runs (one per seed)."""
  if not runs[0].history["epoch"]:
    return {}
  hist = {k: np.array([r.history[k] for r in runs], dtype=float).T for k in runs[0].history}
  epochs = [int(e) for e in hist["epoch"][:, 0]]
  acc, loss = hist["test_accuracy"], hist["test_loss"]
  kernels = [conv_kernels(r.carry[0]) for r in runs]
  init_kernels = [conv_kernels(r.init_variables[0]) for r in runs]
  entry = {
    "test_accuracy": finite_list(acc[-1]),
    "test_loss": finite_list(loss[-1]),
    "best_test_accuracy": finite_list(np.nanmax(acc, 0)),
    "best_test_accuracy_epoch": _epoch_of(np.nanargmax, acc, epochs),
    "min_test_loss": finite_list(np.nanmin(loss, 0)),
    "min_test_loss_epoch": _epoch_of(np.nanargmin, loss, epochs),
    "train_loss": finite_list(hist["train_loss"][-1]),
    "train_batch_accuracy": finite_list(hist["train_batch_accuracy"][-1]),
    "history": {"epoch": epochs, **{k: finite_list(hist[k]) for k in hist if k != "epoch"}},
    "orthogonality_defect": {name: [orthogonality_defect(k[name]) for k in kernels] for name in kernels[0]},
    "init_orthogonality_defect": {name: [orthogonality_defect(k[name]) for k in init_kernels] for name in kernels[0]},
    "init_param_l2": [
      float(np.sqrt(sum(np.sum(np.asarray(p, np.float64) ** 2) for p in jax.tree.leaves(r.init_variables[0]))))
      for r in runs
    ],
    "time_s": [r.time_s for r in runs],
    "time_per_epoch_s": float(np.mean([r.time_s / r.epoch for r in runs])),
  }
  if method == "ocola_ud":
    residuals = [cola.constraint_residuals(r.carry[0], r.carry[2]) for r in runs]
    flat = [{_path_name(p): float(v) for p, v in jax.tree_util.tree_flatten_with_path(res)[0]} for res in residuals]
    entry["constraint_residuals"] = {name: [f[name] for f in flat] for name in flat[0]}
  return entry


def summarize(entry: dict) -> dict:
  out = mean_std_fields(entry, ("test_accuracy", "best_test_accuracy", "test_loss", "min_test_loss", "train_loss"))
  if "constraint_residuals" in entry:
    residual = max(max(v) for v in entry["constraint_residuals"].values())
    out["max_constraint_residual"] = None if math.isnan(residual) else residual
  return out


def summary_table(results: dict, methods: Sequence[str]) -> str:
  name_w = max(len(describe(m)) for m in methods)
  head = (
    f"{'method':<{name_w}}  {'final test acc %':>16}  {'best test acc %':>16}  "
    f"{'final test loss':>16}  {'min test loss':>16}  {'max|QtQ-I|':>10}"
  )
  lines = [head, "-" * len(head)]
  for m in methods:
    r, cells = results[m], []
    for key, scale in (("test_accuracy", 100), ("best_test_accuracy", 100), ("test_loss", 1), ("min_test_loss", 1)):
      mean, std = mean_std(r[key])
      cells.append(f"{scale * mean:6.2f} ± {scale * std:5.2f}" if scale == 100 else f"{mean:6.3f} ± {std:5.3f}")
    residual = summarize(r).get("max_constraint_residual")
    lines.append(
      f"{describe(m):<{name_w}}  "
      + "  ".join(f"{c:>16}" for c in cells)
      + f"  {'-' if residual is None else f'{residual:.1e}':>10}"
    )
  return "\n".join(lines)


def plot(results: dict, config: dict, path: str, data_info: dict) -> None:
  """Train loss, test loss and test accuracy per method (mean ± std over seeds), as the paper's figure."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = {"ocola_ud": "black", "sgdm": "tab:blue", "sgdm_wd": "tab:orange"}
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
  for m in config["methods"]:
    if not results.get(m):
      continue
    h = results[m]["history"]
    for ax, key, scale in zip(axes, ("train_loss", "test_loss", "test_accuracy"), (1, 1, 100)):
      a = np.array([[np.nan if v is None else v for v in row] for row in h[key]], dtype=float) * scale
      mean, std = np.nanmean(a, axis=1), np.nanstd(a, axis=1)
      ax.plot(
        h["epoch"],
        mean,
        color=colors[m],
        lw=2 if m == "ocola_ud" else 1.2,
        label=describe(m),
        marker="o" if len(h["epoch"]) < 3 else None,
      )
      ax.fill_between(h["epoch"], mean - std, mean + std, color=colors[m], alpha=0.15)
  titles = ("train loss (mean over each epoch's minibatches)", "test loss", "test accuracy (%)")
  for ax, title in zip(axes, titles):
    for epoch in config["decay_epochs"]:
      ax.axvline(epoch, color="black", ls=":", lw=0.8)
    ax.set(xlabel="epoch", title=title)
    ax.grid(alpha=0.3)
  axes[2].legend(loc="lower right", fontsize=8)
  synthetic = " — SYNTHETIC DATA" if data_info.get("synthetic") else ""
  fig.suptitle(
    f"{config['model']} on {config['dataset']} ({config['n_train']} train / {config['n_test']} "
    f"test images), batch {config['batch_size']}, lr / 10 at epochs {config['decay_epochs']} "
    f"(dotted), mean ± std of {config['seeds']} seeds, {config['epochs_completed']} of "
    f"{config['epochs']} epochs{synthetic}"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv):
  p = argparse.ArgumentParser(
    description="Orthogonal convolutions: o-CoLA-ud (every conv kernel but the first orthonormal) "
    "against SGD-m with and without weight decay; the paper's ResNet-34 / CIFAR-10 "
    "set-up, or a small CNN on Fashion-MNIST as a CPU-sized stand-in.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--model", choices=MODELS, default="small", help="the small CNN (CPU-sized) or a CIFAR-style ResNet (GPU)"
  )
  p.add_argument(
    "--dataset",
    choices=DATASETS,
    default=None,
    help="default: fashion_mnist for the small CNN, cifar10 for the ResNets",
  )
  p.add_argument(
    "--data-dir",
    default=None,
    help=f"Fashion-MNIST IDX files (default {harness_data.FASHION_MNIST_DIR}) or the "
    "CIFAR-10 batches (required for cifar10)",
  )
  p.add_argument("--synthetic", action="store_true", help="synthetic stand-in data (testing only)")
  p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="number of seeds (0..seeds-1)")
  p.add_argument(
    "--epochs", type=int, default=DEFAULT_EPOCHS, help="training epochs (78 steps of 128 images on 10k training images)"
  )
  p.add_argument(
    "--decay-epochs",
    default=None,
    help="comma list of epochs after which the learning rate is divided by 10; "
    "default round(E/3), round(2E/3) (the paper: 50, 100 of 150)",
  )
  p.add_argument("--eval-every", type=int, default=1, help="epochs between test evaluations (must divide --epochs)")
  p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
  p.add_argument(
    "--n-train",
    type=int,
    default=None,
    help="training images (the first of the official set); default 10000 for fashion_mnist, 50000 for cifar10",
  )
  p.add_argument("--n-test", type=int, default=10_000, help="test images (the official test set)")
  p.add_argument("--batch-size", type=int, default=128, help="minibatch size (the paper's 128)")
  p.add_argument("--width", type=int, default=64, help="ResNet channels of the first stage")
  p.add_argument(
    "--no-augment", action="store_true", help="no random crop and flip on CIFAR-10 (never used on Fashion-MNIST)"
  )
  p.add_argument(
    "--out", default=None, help="output directory (default: results/; a --smoke run: a new temporary folder)"
  )
  p.add_argument(
    "--smoke",
    action="store_true",
    help=f"tiny run for tests: {SMOKE['seeds']} seeds, {SMOKE['epochs']} epochs, "
    f"{SMOKE['n_train']} train / {SMOKE['n_test']} test images, batch "
    f"{SMOKE['batch_size']}, ResNet width {SMOKE['width']}; synthetic data when "
    "the data files are missing",
  )
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  dataset = args.dataset or ("fashion_mnist" if args.model == "small" else "cifar10")
  n_train = args.n_train or (10_000 if dataset == "fashion_mnist" else 50_000)
  n_test, batch_size, width = args.n_test, args.batch_size, args.width
  if args.smoke:
    args.seeds, args.epochs = SMOKE["seeds"], SMOKE["epochs"]
    n_train, n_test, batch_size, width = (SMOKE[k] for k in ("n_train", "n_test", "batch_size", "width"))
  methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
  for m in methods:
    if m not in METHODS:
      p.error(f"unknown method {m!r}; one of {', '.join(METHODS)}")
  if min(args.seeds, args.epochs, n_train, n_test, batch_size, width) < 1 or n_train < batch_size:
    p.error("--seeds, --epochs, --n-test, --width must be positive and --n-train >= --batch-size")
  if args.eval_every < 1 or args.epochs % args.eval_every:
    p.error("--eval-every must be a positive divisor of --epochs")
  if args.decay_epochs is None:
    decay = tuple(e for e in (round(args.epochs / 3), round(2 * args.epochs / 3)) if 0 < e < args.epochs)
  else:
    try:
      decay = tuple(int(e) for e in args.decay_epochs.split(",") if e.strip())
    except ValueError:
      p.error("--decay-epochs must be a comma list of integers")
    if any(e < 1 for e in decay):
      p.error("--decay-epochs must be positive")
  config = Config(
    model=args.model,
    dataset=dataset,
    seeds=args.seeds,
    epochs=args.epochs,
    decay_epochs=decay,
    methods=methods,
    n_train=n_train,
    n_test=n_test,
    batch_size=batch_size,
    eval_every=args.eval_every,
    width=width,
    augment=dataset == "cifar10" and not args.no_augment,
  )
  return args, config


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the comparison, writes ``orthogonal_cnn.json`` and ``.png`` under ``--out``.

  Returns the dict written to ``orthogonal_cnn.json``.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args, config = parse_args(argv)
  args.out = output_dir(args.out or (None if args.smoke else "results/"), "orthogonal_cnn")
  start = time.perf_counter()
  synthetic = args.synthetic
  try:
    (x_train, y_train), (x_test, y_test), data_info = make_data(config, args.data_dir, synthetic)
  except FileNotFoundError as error:
    if not args.smoke:
      sys.exit(f"error: {error}")
    synthetic = True
    (x_train, y_train), (x_test, y_test), data_info = make_data(config, args.data_dir, synthetic)
  stats = pixel_stats(config, x_train)
  images, labels = jnp.asarray(x_train), jnp.asarray(y_train)
  chunks = eval_chunks(x_test, y_test, config.eval_batch)

  from tqdm.auto import tqdm

  model = make_model(config.model, config.width)
  runs = {}
  for m in config.methods:
    fns = build(m, model, config, stats, x_train.shape[1:])
    runs[m] = [Run(m, seed, fns, config) for seed in range(config.seeds)]
  params0 = runs[config.methods[0]][0].init_variables[0]
  constrained = [_path_name(p) for p, v in jax.tree_util.tree_flatten_with_path(orthogonal_mask(params0))[0] if v]
  steps_per_epoch = config.n_train // config.batch_size
  h_phases = [math.sqrt(SGD_LR * DECAY_FACTOR**i) for i in range(len(config.decay_epochs) + 1)]
  config_dict = {
    **config._asdict(),
    "methods": list(config.methods),
    "decay_epochs": list(config.decay_epochs),
    "steps_per_epoch": steps_per_epoch,
    "images_skipped_per_epoch": config.n_train - steps_per_epoch * config.batch_size,
    "pixel_mean": stats[0].tolist(),
    "pixel_std": stats[1].tolist(),
    "n_parameters": int(sum(np.size(p) for p in jax.tree.leaves(params0))),
    "constrained_kernels": constrained,
    "free_conv_kernel": f"{FREE_CONV}/kernel",
    "init": "PyTorch default U(+-1/sqrt(fan_in)) for kernels and biases, BatchNorm (1, 0); the same "
    "parameters for every method; o-CoLA-ud's first update replaces each constrained kernel "
    "by its polar factor (nearest orthonormal matrix)",
    "ocola_ud": {
      "learning_rate": h_phases,
      "friction": FRICTION,
      "temperature": 0.0,
      "sgd_momentum_equivalent": [
        dict(zip(("learning_rate", "momentum"), cola.langevin_to_sgd_momentum(h, FRICTION))) for h in h_phases
      ],
    },
    "sgdm": {"learning_rate": SGD_LR, "momentum": MOMENTUM, "decay_factor": DECAY_FACTOR},
    "weight_decay": f"{WEIGHT_DECAY} on every parameter for sgdm_wd (PyTorch SGD weight_decay)",
    "paper": {
      "model": "ResNet-34 with BatchNorm",
      "dataset": "CIFAR-10",
      "epochs": PAPER_EPOCHS,
      "decay_epochs": list(PAPER_DECAY_EPOCHS),
      "batch_size": 128,
      "seeds": 5,
    },
    "pairing": "seed s fixes init, minibatch order and augmentation, the same for every method",
  }
  json_path = os.path.join(args.out, "orthogonal_cnn.json")
  png_path = os.path.join(args.out, "orthogonal_cnn.png")

  def write(status: str) -> dict:
    results = {m: _entry(runs[m], m) for m in config.methods}
    done = [m for m in config.methods if results[m]]
    out = {
      "schema_version": SCHEMA_VERSION,
      "experiment": "orthogonal convolutions, o-CoLA-ud vs SGD-m (Leimkuhler et al., Constraint-Based "
      "Regularization of Neural Networks, Sec. 4 ResNet-34 / CIFAR-10 figure and Appendix C)",
      "status": status,
      "config": {**config_dict, "epochs_completed": min(r.epoch for rs in runs.values() for r in rs)},
      "data": data_info,
      "methods": {m: describe(m) for m in config.methods},
      "seeds": list(range(config.seeds)),
      "results": results,
      "summary": {m: summarize(results[m]) for m in done},
      **provenance(argv, start, ("flax",)),
    }
    write_json(json_path, out)
    if done:
      plot(results, out["config"], png_path, data_info)
    return out

  n_rounds = config.epochs // config.eval_every
  all_runs = [r for m in config.methods for r in runs[m]]
  bar = tqdm(total=n_rounds * len(all_runs), unit="run-round", disable=args.quiet, dynamic_ncols=True)
  for round_ in range(n_rounds):
    t0 = time.perf_counter()
    for run in all_runs:
      bar.set_description(f"epoch {(round_ + 1) * config.eval_every} {run.method} seed {run.seed}")
      run.train(config.eval_every, images, labels, chunks)
      bar.update(1)
    if round_ == 1 or n_rounds == 1:
      per_round = time.perf_counter() - t0
      bar.write(
        f"projection: {per_round:.1f} s per round of {config.eval_every} epoch(s), all methods "
        f"and seeds -> {config.epochs} epochs in {per_round * n_rounds / 60:.1f} min (this "
        "machine, now; round 1 included compilation)"
      )
    accs = "  ".join(
      f"{m}: {100 * np.mean([r.history['test_accuracy'][-1] for r in runs[m]]):.2f}%/"
      f"{np.mean([r.history['test_loss'][-1] for r in runs[m]]):.3f}"
      for m in config.methods
    )
    bar.write(f"epoch {(round_ + 1) * config.eval_every:4d}  test acc/loss  {accs}")
    write("running")
  bar.close()

  LAST_RUN.clear()
  LAST_RUN.update(
    {
      m: {
        "init": [r.init_variables for r in runs[m]],
        "final": [jax.device_get(r.carry[:2]) for r in runs[m]],
        "opt_state": [r.carry[2] for r in runs[m]],
      }
      for m in config.methods
    }
  )
  out = write("complete")
  print()
  print(summary_table(out["results"], config.methods))
  if data_info.get("synthetic"):
    print("NOTE: synthetic stand-in data")
  print(f"wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")
  return out


if __name__ == "__main__":
  main()
