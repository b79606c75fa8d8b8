"""The modular-manifolds reference (Thinking Machines, MIT) run by a small torch loop, for ``muon.py``.

The reference's update rules ``update(W, G, eta)`` (``manifold_muon``,
``hyperspherical_descent``) are loaded from the directory of its ``src/``
given by ``--reference`` (nothing of it is copied here); its ``main.py``'s
training semantics are reproduced: a bias-free MLP, cross-entropy, the
learning rate ``lr * (1 - step / steps)`` set before each update, the weights
first moved onto the manifold by ``update(W, 0, eta=0)``, torch's ``AdamW``
for the baseline (weight decay 0, ``main.py``'s default). The batches and
initial weights are those of the JAX runs (the kernels transposed to torch's
``(out, in)``).
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types

import numpy as np

RULES = ("manifold_muon", "hyperspherical_descent", "adamw")


def torch_available() -> bool:
  return importlib.util.find_spec("torch") is not None


def load_rules(src_dir: str) -> types.SimpleNamespace:
  """The reference's update rules from ``src_dir`` (its ``src/``), loaded by file path.

  ``manifold_muon.py`` does ``from msign import msign``: ``msign`` is registered
  in ``sys.modules`` first, so the module search path stays as it is.
  """

  def load(name: str):
    spec = importlib.util.spec_from_file_location(name, f"{src_dir}/{name}.py")
    if spec is None or spec.loader is None:
      raise FileNotFoundError(f"{src_dir}/{name}.py: not the reference's src/ directory")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

  load("msign")
  return types.SimpleNamespace(
    manifold_muon=load("manifold_muon").manifold_muon,
    hyperspherical_descent=load("hyperspherical_descent").hyperspherical_descent,
  )


def residual(kernels: list[np.ndarray], rule: str) -> float | None:
  """The largest over layers of ``max |W^T W - I|`` (tall ``W``) or, on the sphere, ``| |W|_F - 1 |``."""
  if rule == "adamw":
    return None
  worst = 0.0
  for w in kernels:
    w = np.asarray(w, np.float64)
    w = w if w.shape[0] >= w.shape[1] else w.T
    if rule == "hyperspherical_descent":
      worst = max(worst, abs(float(np.linalg.norm(w)) - 1.0))
    else:
      worst = max(worst, float(np.max(np.abs(w.T @ w - np.eye(w.shape[1])))))
  return worst


def train(
  rules: types.SimpleNamespace,
  rule: str,
  lr: float,
  kernels: list[np.ndarray],
  data,
  orders: np.ndarray,
  batch_size: int,
  max_steps: int | None = None,
) -> dict:
  """One reference run on one thread: test accuracy, median ms/step, residual.

  Args:
    rules: from :func:`load_rules`.
    rule: one of ``RULES``.
    lr: the initial learning rate.
    kernels: the JAX ``(in, out)`` kernels, layer by layer.
    data: ``(x_train, y_train, x_test, y_test)`` numpy arrays, inputs flattened and normalised.
    orders: ``(epochs, n_train)`` example indices, each epoch's order.
    batch_size: examples per step; the last batch of an epoch is the remainder.
    max_steps: stop after this many steps (a smoke run); the schedule still spans every epoch.
  """
  import torch

  torch.set_num_threads(1)
  x_train, y_train, x_test, y_test = (torch.from_numpy(np.asarray(a)) for a in data)
  y_train, y_test = y_train.long(), y_test.long()
  weights = [torch.tensor(np.asarray(k).T.copy(), dtype=torch.float32, requires_grad=True) for k in kernels]
  update = None if rule == "adamw" else getattr(rules, rule)
  optimizer = torch.optim.AdamW(weights, lr=lr, weight_decay=0.0) if update is None else None
  if update is not None:
    with torch.no_grad():
      for w in weights:
        w.data = update(w.data, torch.zeros_like(w.data), eta=0)

  def forward(x):
    for i, w in enumerate(weights):
      x = x @ w.T if i == 0 else torch.relu(x) @ w.T
    return x

  n = len(x_train)
  steps_per_epoch = -(-n // batch_size)
  steps = steps_per_epoch * len(orders)
  step, times = 0, []
  for order in orders:
    order = torch.from_numpy(np.asarray(order, np.int64))
    for b in range(steps_per_epoch):
      if max_steps is not None and step >= max_steps:
        break
      t0 = time.perf_counter()
      idx = order[b * batch_size : (b + 1) * batch_size]
      loss = torch.nn.functional.cross_entropy(forward(x_train[idx]), y_train[idx])
      for w in weights:
        w.grad = None
      loss.backward()
      eta = lr * (1 - step / steps)
      with torch.no_grad():
        if update is not None:
          for w in weights:
            w.data = update(w, w.grad, eta=eta)
        elif optimizer is not None:
          for group in optimizer.param_groups:
            group["lr"] = eta
          optimizer.step()
      times.append(time.perf_counter() - t0)
      step += 1
  with torch.no_grad():
    correct = sum(
      int((forward(x_test[i : i + 10_000]).argmax(-1) == y_test[i : i + 10_000]).sum())
      for i in range(0, len(x_test), 10_000)
    )
  final = [w.detach().numpy().T for w in weights]
  return {
    "test_accuracy": correct / len(x_test),
    "ms_per_step": float(np.median(times)) * 1e3,
    "residual": residual(final, rule),
    "steps": step,
    "torch_threads": torch.get_num_threads(),
  }
