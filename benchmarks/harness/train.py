"""Training every seed of a method at once: ``vmap`` over seeds, ``lax.scan`` over minibatches.

A :class:`Run` holds one method's batch of *members* (seeds, or seeds times a
few hyperparameter values that share one compiled step) and advances them
``eval_every`` epochs per call of its jitted chunk (a scan over epochs of a
scan over minibatches, vmapped over members), then evaluates them on the whole
training and test sets. Nothing in it assumes a CPU: the data go to the default
device once and every step runs there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola

from .data import Dataset


class Objective(NamedTuple):
  """Per-example ``loss(outputs, y)`` and ``correct(outputs, y)`` (1.0 where right)."""

  loss: Callable
  correct: Callable


SOFTMAX = Objective(
  optax.softmax_cross_entropy_with_integer_labels, lambda logits, y: (jnp.argmax(logits, -1) == y).astype(jnp.float32)
)
BINARY = Objective(
  lambda logit, y: optax.sigmoid_binary_cross_entropy(logit[..., 0], y),
  lambda logit, y: ((logit[..., 0] > 0) == (y > 0.5)).astype(jnp.float32),
)


def seed_keys(seed):
  """(init key, shuffle key, noise key) of seed ``seed``: the same for every method."""
  return tuple(jax.random.split(jax.random.key(seed), 3))


def projection_fallbacks(opt_state) -> jax.Array:
  """How many orthogonal leaves of ``opt_state`` fell back to the polar factor this step."""
  infos = [
    leaf
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, cola.ProjectionInfo))
    if isinstance(leaf, cola.ProjectionInfo)
  ]
  return sum((jnp.sum(~info.converged) for info in infos), jnp.zeros((), jnp.int32))


def evaluate(apply_fn, objective: Objective, params, x, y, batch: int):
  """(mean loss, accuracy) over a whole data set, ``batch`` examples at a time."""
  n = x.shape[0]
  batch = min(batch, n)
  chunks = -(-n // batch)
  pad = chunks * batch - n
  xs = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(chunks, batch, *x.shape[1:])
  ys = jnp.pad(y, ((0, pad),) + ((0, 0),) * (y.ndim - 1)).reshape(chunks, batch, *y.shape[1:])
  ws = (jnp.arange(chunks * batch) < n).astype(jnp.float32).reshape(chunks, batch)

  def one(args):
    xb, yb, wb = args
    out = apply_fn(params, xb)
    return jnp.sum(objective.loss(out, yb) * wb), jnp.sum(objective.correct(out, yb) * wb)

  loss_sum, correct = jax.lax.map(one, (xs, ys, ws))
  return jnp.sum(loss_sum) / n, jnp.sum(correct) / n


class Run:
  """One method's members, trained together.

  Args:
    init_params: ``(init_key, member) -> params``; ``member`` maps each name of
      ``members`` to its (traced) value for this member.
    apply_fn: ``(params, x) -> outputs``, e.g. ``lambda p, x: model.apply({"params": p}, x)``.
    make_tx: ``(member, noise_key) -> optax.GradientTransformation``; called at
      init and inside every chunk with the same arguments (the transformation's
      PRNG key lives in its state).
    objective: per-example loss and correctness.
    data: the data set; the training set is reshuffled every epoch.
    members: arrays with one entry per member, ``"seed"`` among them.
    batch_size, eval_every: minibatch size and epochs per chunk. A last,
      smaller minibatch is kept (as PyTorch's ``drop_last=False``): a full
      batch whose padding has zero weight.
    eval_batch: examples per evaluation pass.
    probes: ``params -> {name: scalar}`` recorded at each evaluation, e.g. the
      largest weight or the orthogonality defect.
  """

  def __init__(
    self,
    *,
    init_params,
    apply_fn,
    make_tx,
    objective: Objective,
    data: Dataset,
    members: Mapping[str, Sequence],
    batch_size: int,
    eval_every: int,
    eval_batch: int = 10_000,
    probes: Callable | None = None,
  ):
    self.members = {k: jnp.asarray(v) for k, v in members.items()}
    if "seed" not in self.members:
      raise ValueError("members must include 'seed'")
    self.data = tuple(jax.device_put(a) for a in data[:4])
    n = len(data.x_train)
    steps = -(-n // batch_size)
    pad = steps * batch_size - n
    self.steps_per_epoch, self.last_batch_size, self.eval_every = steps, n - (steps - 1) * batch_size, eval_every

    def init_one(member):
      init_key, shuffle_key, noise_key = seed_keys(member["seed"])
      params = init_params(init_key, member)
      opt_state = make_tx(member, noise_key).init(params)
      return params, opt_state, shuffle_key, jnp.zeros((), jnp.int32)

    def loss_fn(params, x, y, w):
      return jnp.sum(objective.loss(apply_fn(params, x), y) * w) / jnp.sum(w)

    def chunk_one(carry, member, data):
      params, opt_state, shuffle_key, fallbacks = carry
      x_train, y_train, x_test, y_test = data
      tx = make_tx(member, seed_keys(member["seed"])[2])

      def step(inner, batch):
        params, opt_state, fallbacks = inner
        idx, w = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x_train[idx], y_train[idx], w)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, fallbacks + projection_fallbacks(opt_state)), loss

      def epoch(inner, key):
        order = jnp.concatenate([jax.random.permutation(key, n), jnp.zeros(pad, jnp.int32)])
        weight = (jnp.arange(steps * batch_size) < n).astype(jnp.float32)
        inner, losses = jax.lax.scan(step, inner, (order.reshape(steps, batch_size), weight.reshape(steps, batch_size)))
        return inner, jnp.mean(losses)

      shuffle_key, epoch_keys = jax.random.split(shuffle_key)
      (params, opt_state, fallbacks), batch_losses = jax.lax.scan(
        epoch, (params, opt_state, fallbacks), jax.random.split(epoch_keys, eval_every)
      )
      train_loss, train_acc = evaluate(apply_fn, objective, params, x_train, y_train, eval_batch)
      test_loss, test_acc = evaluate(apply_fn, objective, params, x_test, y_test, eval_batch)
      metrics = dict(
        train_loss=train_loss,
        train_accuracy=train_acc,
        test_loss=test_loss,
        test_accuracy=test_acc,
        epoch_mean_batch_loss=batch_losses[-1],
        projection_fallbacks=fallbacks,
        **(probes(params) if probes else {}),
      )
      return (params, opt_state, shuffle_key, fallbacks), metrics

    # Op by op: jitted, the vmapped init of ten orthogonal (QR) kernels deadlocked XLA:CPU (jaxlib 0.10.2's batched
    # LAPACK kernels block the pool threads their own tasks need; docs/development.md, "Batched LAPACK on XLA:CPU").
    self._init = jax.vmap(init_one)
    self._chunk = jax.jit(jax.vmap(chunk_one, in_axes=(0, 0, None)), donate_argnums=0)
    self.carry = None
    self.history: dict[str, list] = {}
    self.epochs_done = 0
    self.compile_s = self.run_s = 0.0

  @property
  def params(self):
    """The members' current parameters, each leaf with a leading member axis."""
    return self.carry[0]

  def advance(self) -> dict:
    """Trains ``eval_every`` more epochs, evaluates; returns this chunk's metrics (numpy, per member)."""
    if self.carry is None:
      t0 = time.perf_counter()
      self.carry = self._init(self.members)
      self._chunk = self._chunk.lower(self.carry, self.members, self.data).compile()
      self.compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    self.carry, metrics = self._chunk(self.carry, self.members, self.data)
    metrics = jax.device_get(metrics)
    self.run_s += time.perf_counter() - t0
    self.epochs_done += self.eval_every
    self.history.setdefault("epoch", []).append(self.epochs_done)
    for k, v in metrics.items():
      self.history.setdefault(k, []).append(np.asarray(v))
    return metrics

  def rows(self, select) -> dict:
    """The history of the members ``select`` (an index array or slice): name -> ``(evals, members)``."""
    return {k: (v if k == "epoch" else np.stack(v)[:, select]) for k, v in self.history.items()}


def train(runs: Mapping[str, Run], epochs: int, *, progress=None, after_round: Callable | None = None):
  """Advances every run ``epochs`` epochs, the runs in turn one chunk at a time (so an interrupted
  sweep leaves them at the same epoch); ``after_round(epochs_done)`` after each round."""
  for run in runs.values():
    if epochs % run.eval_every:
      raise ValueError(f"eval_every = {run.eval_every} must divide epochs = {epochs}")
  rounds = epochs // min(run.eval_every for run in runs.values())
  for _ in range(rounds):
    for name, run in runs.items():
      if run.epochs_done < epochs:
        run.advance()
        if progress is not None:
          progress.set_description(name)
          progress.update(1)
    if after_round is not None:
      after_round(min(run.epochs_done for run in runs.values()))
