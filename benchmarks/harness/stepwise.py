"""Training one seed at a time, one jitted call per minibatch, with BatchNorm's ``batch_stats``.

:mod:`.train` scans over minibatches and vmaps over seeds: right for MLPs and
on accelerators. On a CPU, XLA's convolutions run far slower inside a
``lax.scan`` (the small CNN's step: 25x on a 2-core machine) and vmapped over
seeds (grouped convolutions: 3-5x for 3 seeds). Here a :class:`Run` is one seed
of one method and each minibatch is one call of the method's jitted step, which
carries the model's ``batch_stats`` collection (BatchNorm's running averages,
updated in training mode, used for evaluation; empty for a model without
BatchNorm). Only full minibatches are taken (``n mod batch`` images skipped per
epoch), so BatchNorm always sees a whole batch. A :class:`Run` has the
``advance``/``eval_every``/``epochs_done`` of :class:`harness.train.Run`, so
:func:`harness.train.train` advances runs of either kind in rounds.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from . import report, vision
from .data import Dataset

CURVES = ("test_accuracy", "test_loss", "train_loss", "train_batch_accuracy")


def seed_keys(seed: int):
  """(init key, data-order key) of seed ``seed``: the same for every method."""
  return tuple(jax.random.split(jax.random.key(seed)))


class Method(NamedTuple):
  """The functions of one method, shared (and compiled once) by its seeds."""

  init: Callable  # seed -> (params, batch_stats, opt_state)
  step: Callable  # (carry, x_train, y_train, order, step, augment_key) -> (carry, (loss, accuracy))
  evaluate: Callable  # (params, batch_stats, x, y, weight) -> (summed loss, number correct)
  batch_size: int


def method(
  model: nn.Module,
  tx: optax.GradientTransformation,
  sample_shape: Sequence[int],
  batch_size: int,
  prepare: Callable = lambda x: x,
  augment: Callable | None = None,
) -> Method:
  """Softmax cross-entropy training of ``model`` (called as ``model.apply(variables, x, train=...)``)
  by ``tx``, from PyTorch's init (:func:`harness.vision.torch_init`) of seed ``s``'s init key.

  ``prepare(x)`` turns a stored batch into the model's input (e.g. :func:`harness.images.scaler`);
  ``augment(key, x)`` transforms each prepared training batch (``key`` folded with the step).
  """
  shapes = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(0), jnp.zeros((1, *sample_shape)))
  tx_init = jax.jit(tx.init)

  def init(seed):
    params, batch_stats = vision.torch_init(seed_keys(seed)[0], shapes)
    return params, batch_stats, tx_init(params)

  def loss_fn(params, batch_stats, x, y):
    variables = {"params": params, "batch_stats": batch_stats}
    logits, mutated = model.apply(variables, x, train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (jnp.mean(jnp.argmax(logits, -1) == y), mutated["batch_stats"])

  @functools.partial(jax.jit, donate_argnums=0)
  def step(carry, images, labels, order, i, augment_key):
    params, batch_stats, opt_state = carry
    idx = jax.lax.dynamic_slice_in_dim(order, i * batch_size, batch_size)
    x = prepare(images[idx])
    if augment is not None:
      x = augment(jax.random.fold_in(augment_key, i), x)
    (loss, (acc, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, x, labels[idx])
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), (loss, acc)

  @jax.jit
  def evaluate(params, batch_stats, x, y, weight):
    logits = model.apply({"params": params, "batch_stats": batch_stats}, prepare(x), train=False)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce * weight), jnp.sum((jnp.argmax(logits, -1) == y) * weight)

  return Method(init, step, evaluate, batch_size)


class DeviceData(NamedTuple):
  """A data set on the default device: the training arrays and the test set in weighted chunks."""

  x_train: jax.Array
  y_train: jax.Array
  test_chunks: list
  n_test: int


def device_data(dataset: Dataset, eval_batch: int = 1000) -> DeviceData:
  """``dataset`` on the device, its test set as chunks of ``eval_batch``, the last padded with weight 0."""
  x, y = dataset.x_test, dataset.y_test
  size, chunks = min(eval_batch, len(x)), []
  for start in range(0, len(x), size):
    xb, yb = x[start : start + size], y[start : start + size]
    pad = size - len(xb)
    weight = np.r_[np.ones(len(xb)), np.zeros(pad)].astype(np.float32)
    xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
    chunks.append((jnp.asarray(xb), jnp.asarray(np.r_[yb, np.zeros(pad, yb.dtype)]), jnp.asarray(weight)))
  return DeviceData(jnp.asarray(dataset.x_train), jnp.asarray(dataset.y_train), chunks, len(x))


class Run:
  """One seed of one method: ``carry = (params, batch_stats, opt_state)``, its data order and history.

  Epoch ``e`` visits the training set in the order ``permutation(k, n)`` and augments with ``a``,
  ``(k, a) = split(fold_in(order_key, e))``; after every ``eval_every`` epochs, the test set is
  evaluated and the last epoch's mean minibatch loss and accuracy are recorded.
  """

  def __init__(self, fns: Method, seed: int, data: DeviceData, eval_every: int):
    self.fns, self.seed, self.data, self.eval_every = fns, seed, data, eval_every
    self.carry = fns.init(seed)
    self.init_variables = jax.device_get(self.carry[:2])
    self.order_key = seed_keys(seed)[1]
    self.steps_per_epoch = len(data.x_train) // fns.batch_size
    if self.steps_per_epoch < 1:
      raise ValueError(f"{len(data.x_train)} training examples: fewer than a batch of {fns.batch_size}")
    self.epochs_done, self.time_s = 0, 0.0
    self.history: dict[str, list] = {"epoch": [], **{k: [] for k in CURVES}}

  @property
  def params(self):
    return self.carry[0]

  def advance(self) -> None:
    """``eval_every`` more epochs, then one evaluation."""
    t0 = time.perf_counter()
    n = len(self.data.x_train)
    for _ in range(self.eval_every):
      order_key, augment_key = jax.random.split(jax.random.fold_in(self.order_key, self.epochs_done))
      order = jax.random.permutation(order_key, n)
      metrics = []
      for i in range(self.steps_per_epoch):
        self.carry, m = self.fns.step(
          self.carry, self.data.x_train, self.data.y_train, order, jnp.int32(i), augment_key
        )
        metrics.append(m)
      self.epochs_done += 1
    loss, acc = (float(jnp.mean(jnp.stack([m[i] for m in metrics]))) for i in (0, 1))
    sums = [self.fns.evaluate(*self.carry[:2], *chunk) for chunk in self.data.test_chunks]
    test_loss, correct = (sum(float(s[i]) for s in sums) / self.data.n_test for i in (0, 1))
    for key, value in zip(("epoch", *CURVES), (self.epochs_done, correct, test_loss, loss, acc)):
      self.history[key].append(value)
    self.time_s += time.perf_counter() - t0


def entry(runs: Sequence[Run]) -> dict:
  """A method's JSON entry from its runs (one per seed): the last evaluation of each curve, the best
  test accuracy and lowest test loss with their epochs, the curves under ``"history"``, the times."""
  if not runs[0].history["epoch"]:
    return {}
  epochs = runs[0].history["epoch"]
  hist = {k: np.array([r.history[k] for r in runs], dtype=float).T for k in CURVES}
  at = lambda arg, values: [epochs[arg(c)] if np.any(np.isfinite(c)) else None for c in values.T]
  return {
    **{k: report.finite_list(v[-1]) for k, v in hist.items()},
    "best_test_accuracy": report.finite_list(np.nanmax(hist["test_accuracy"], 0)),
    "best_test_accuracy_epoch": at(np.nanargmax, hist["test_accuracy"]),
    "min_test_loss": report.finite_list(np.nanmin(hist["test_loss"], 0)),
    "min_test_loss_epoch": at(np.nanargmin, hist["test_loss"]),
    "history": {"epoch": list(epochs), **{k: report.finite_list(v) for k, v in hist.items()}},
    "time_s": [r.time_s for r in runs],
    "time_per_epoch_s": float(np.mean([r.time_s / r.epochs_done for r in runs])),
  }
