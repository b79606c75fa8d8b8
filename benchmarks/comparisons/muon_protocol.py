"""The protocol of ``muon.py``: data, the bias-free MLP, manifolds, one method's runs and its step trace."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.harness import data as datasets
from benchmarks.harness.models import torch_uniform
from benchmarks.harness.train import SOFTMAX, Run, seed_keys

WIDTHS = (784, 128, 64, 10)
BATCH = 1024
STIEFEL, SPHERE = "stiefel", "sphere"


class Method(NamedTuple):
  """A method: its label, learning-rate grid, ``make(lr, schedule)`` and the manifold it keeps."""

  label: str
  grid: tuple[float, ...]
  make: Callable[[float, optax.Schedule], optax.GradientTransformation]
  manifold: str | None


def load_data(data_dir: str | None, smoke: bool) -> tuple[datasets.Dataset, datasets.Dataset]:
  """(validation: the training images but the last twelfth / that twelfth, final: training / official test),
  flattened and standardised by the mean and standard deviation of their training part."""
  n_train, n_test = (2048, 512) if smoke else (60_000, 10_000)
  full = datasets.fashion_mnist(data_dir, n_train, n_test, test_from="official", allow_synthetic=smoke)
  n_val = n_train // 12

  def standardised(x_train, y_train, x_test, y_test, info):
    mean, std = float(x_train.mean()), float(x_train.std())
    scale = lambda x: ((x.reshape(len(x), -1) - mean) / std).astype(np.float32)
    return datasets.Dataset(scale(x_train), y_train, scale(x_test), y_test, {**info, "mean": mean, "std": std})

  split = f"trained on training images 0..{n_train - n_val - 1}, validated on the last {n_val}"
  validation = standardised(
    full.x_train[:-n_val], full.y_train[:-n_val], full.x_train[-n_val:], full.y_train[-n_val:], {"split": split}
  )
  return validation, standardised(full.x_train, full.y_train, full.x_test, full.y_test, full.info)


def init_params(key) -> dict:
  """The bias-free MLP's kernels, ``(in, out)``, PyTorch's default initialisation."""
  keys = jax.random.split(key, len(WIDTHS) - 1)
  return {
    f"layer{i}": torch_uniform(fan_in)(k, (fan_in, fan_out), jnp.float32)
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, WIDTHS[:-1], WIDTHS[1:]))
  }


def apply(params: dict, x):
  for i in range(len(WIDTHS) - 1):
    x = (x if i == 0 else jax.nn.relu(x)) @ params[f"layer{i}"]
  return x


def on_manifold(params: dict, manifold: str | None) -> dict:
  """The starting point: the polar factor on the Stiefel manifold, ``W / |W|_F`` on the sphere."""
  if manifold == STIEFEL:
    return cola.project_params(params, cola.Orthogonal())
  if manifold == SPHERE:
    return jax.tree.map(lambda w: w / jnp.linalg.norm(w), params)
  return params


def residual(params: dict, manifold: str | None) -> float:
  """The largest over kernels of ``max |W^T W - I|`` (Stiefel, tall ``W``) or ``| |W|_F - 1 |`` (sphere), in
  float64 (float32's own rounding of ``W^T W`` for a 784 x 128 kernel is about 1e-6)."""
  worst = 0.0
  for w in params.values():
    w = np.asarray(w, np.float64)
    if manifold == SPHERE:
      worst = max(worst, abs(float(np.linalg.norm(w)) - 1))
    else:
      worst = max(worst, float(np.max(np.abs(w.T @ w - np.eye(w.shape[1])))))
  return worst


def batch_orders(seed: int, n: int, epochs: int) -> np.ndarray:
  """Each epoch's example order of seed ``seed`` as ``benchmarks.harness.train.Run`` draws it when one
  chunk spans every epoch (``eval_every = epochs``): for the torch runs and the step trace."""
  _, epoch_keys = jax.random.split(seed_keys(seed)[1])
  return np.stack([np.asarray(jax.random.permutation(k, n)) for k in jax.random.split(epoch_keys, epochs)])


def schedule_for(lr: float, data: datasets.Dataset, epochs: int) -> optax.Schedule:
  """``lr * (1 - step / steps)``, as the reference's ``main.py``."""
  return optax.linear_schedule(lr, 0.0, -(-len(data.x_train) // BATCH) * epochs)


def train(method: Method, lr: float, data: datasets.Dataset, seeds, epochs: int) -> dict:
  """Every seed of one method at one learning rate (one compiled ``vmap`` over seeds): test accuracy and
  the final residual per seed."""
  run = Run(
    init_params=lambda key, member: on_manifold(init_params(key), method.manifold),
    apply_fn=apply,
    make_tx=lambda member, key: method.make(lr, schedule_for(lr, data, epochs)),
    objective=SOFTMAX,
    data=data,
    members={"seed": list(seeds)},
    batch_size=BATCH,
    eval_every=epochs,
  )
  metrics = run.advance()
  final = jax.device_get(run.params)
  each = [{k: w[i] for k, w in final.items()} for i in range(len(seeds))]
  return {
    "test_accuracy": np.asarray(metrics["test_accuracy"]).tolist(),
    "residual": [residual(p, method.manifold) if method.manifold else None for p in each],
    "compile_s": run.compile_s,
    "run_s": run.run_s,
  }


def _seed_zero_step(method: Method, lr: float, data: datasets.Dataset, epochs: int):
  """Seed 0's jitted training step ``(params, state, batch indices) -> (params, state)`` and its start."""
  tx = method.make(lr, schedule_for(lr, data, epochs))
  params = on_manifold(init_params(seed_keys(0)[0]), method.manifold)
  x_train, y_train = jnp.asarray(data.x_train), jnp.asarray(data.y_train)

  @jax.jit
  def step(params, state, idx):
    loss = lambda p: jnp.mean(SOFTMAX.loss(apply(p, x_train[idx]), y_train[idx]))
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  return step, params, tx.init(params)


def timed_steps(method: Method, lr: float, data: datasets.Dataset, epochs: int) -> Callable:
  """A function of a batch's indices that takes one jitted training step of seed 0 (gradient, update,
  apply) from where the last left off, and returns its seconds."""
  step, params, state = _seed_zero_step(method, lr, data, epochs)
  carry = [params, state]

  def timed(idx) -> float:
    t0 = time.perf_counter()
    carry[:] = jax.block_until_ready(step(*carry, idx))
    return time.perf_counter() - t0

  return timed


def step_trace(method: Method, lr: float, data: datasets.Dataset, epochs: int, max_steps: int) -> dict:
  """Seed 0's first epoch (at most ``max_steps`` steps), one jitted step (gradient, update, apply) per call:
  the median ms of the steps after the first (which compiles) and, where the state has ``direction_info``
  (manifold Muon), its iterations and convergence per kernel and step."""
  step, params, state = _seed_zero_step(method, lr, data, epochs)

  order = batch_orders(0, len(data.x_train), epochs)[0]
  times, iterations, converged = [], [], []
  for b in range(min(max_steps, len(order) // BATCH)):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, jnp.asarray(order[b * BATCH : (b + 1) * BATCH])))
    times.append(time.perf_counter() - t0)
    info = getattr(state, "direction_info", None)
    if info is not None:
      iterations.append([int(i.iterations) for i in info.values()])
      converged.append([bool(i.converged) for i in info.values()])
  out = {"ms_per_step": float(np.median(times[1:])) * 1e3, "timed_steps": len(times) - 1}
  if iterations:
    its, ok = np.asarray(iterations), np.asarray(converged)
    out["dual"] = {
      "what": f"ADMM iterations of the direction per kernel ({', '.join(params)}), seed 0, first {len(its)} steps",
      "iterations_mean": its.mean(0).tolist(),
      "iterations_max": its.max(0).tolist(),
      "not_converged_steps": (~ok).sum(0).tolist(),
      "steps": len(its),
    }
  return out
