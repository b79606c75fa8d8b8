"""geoopt's side of :mod:`benchmarks.comparisons.riemannian`: its Riemannian Adam and SGD with momentum on an
``EuclideanStiefel`` parameter, torch on CPU (imported only when these run)."""

import time

import numpy as np


def geoopt_available():
  """None where torch and geoopt import, else the import error's text."""
  try:
    import geoopt  # noqa: F401
    import torch  # noqa: F401
  except ImportError as error:
    return str(error)
  return None


def _optimizer(name, kind, data, start, lr):
  """The parameter (at ``start``), geoopt's optimizer ``name`` on it, and the problem's objective."""
  import geoopt
  import torch

  w = geoopt.ManifoldParameter(torch.tensor(start), manifold=geoopt.EuclideanStiefel())
  d = torch.tensor(data)
  if name == "geoopt RiemannianAdam":
    opt = geoopt.optim.RiemannianAdam([w], lr=lr)
  else:
    opt = geoopt.optim.RiemannianSGD([w], lr=lr, momentum=0.9)
  objective = (lambda w: (w * (d @ w)).sum()) if kind == "top_k" else (lambda w: (w * d).sum())
  return w, opt, objective


def torch_trajectory(name, kind, data, start, lr, steps):
  """The objective and ``max |W^T W - I|`` after each of ``steps`` steps, and the seconds they took."""
  import torch

  w, opt, objective = _optimizer(name, kind, data, start, lr)
  eye = torch.eye(start.shape[1])
  values, defects = np.empty(steps), np.empty(steps)
  t = time.perf_counter()
  for i in range(steps):
    opt.zero_grad()
    (-objective(w)).backward()
    opt.step()
    with torch.no_grad():
      values[i] = float(objective(w))
      defects[i] = float((w.T @ w - eye).abs().max())
  return values, defects, time.perf_counter() - t


def torch_stepper(name, kind, data, start, lr):
  """One step per call, for the interleaved timing, and no facts of its own."""
  w, opt, objective = _optimizer(name, kind, data, start, lr)

  def run_once():
    opt.zero_grad()
    (-objective(w)).backward()
    opt.step()

  return run_once, {}
