#!/usr/bin/env python
r"""Riemannian Adam and SGD with momentum on Stiefel problems with known optima, against geoopt.

Problems (float32, ``W`` of shape ``(n, k)`` with orthonormal columns, the same
start ``qf(N(0, 1))`` for every optimizer):

* ``top_k``: maximise ``tr(W^T A W)``, ``A`` symmetric Gaussian ``n x n``; the
  optimum is the sum of ``A``'s ``k`` largest eigenvalues.
* ``procrustes``: maximise ``tr(W^T X^T Y)`` (orthogonal Procrustes, ``X``
  ``m x n`` with orthonormal columns so that ``|X W - Y|^2 = k + |Y|^2 - 2 tr``,
  ``Y = X W_0 + noise``); the optimum is the nuclear norm of ``X^T Y``.

Optimizers: ``cola.constrained(optax.adam(lr))`` and
``cola.constrained(optax.sgd(lr, momentum=0.9))`` (polar retraction); an
ablation of the first, with Adam's first moment transported to each new tangent
space by projection (as geoopt does) instead of the update projected; the
naive chain ``optax.chain(optax.scale_by_adam(), cola.cola_od(lr))`` (Adam fed
the Euclidean gradient, then o-CoLA-od's projection); geoopt's
``RiemannianAdam`` and ``RiemannianSGD(momentum=0.9)`` on an
``EuclideanStiefel`` ``ManifoldParameter`` (QR retraction, projection as
transport of the first moment), torch on CPU. Each runs at every learning rate
of ``--lrs``; reported: the fewest iterations to a relative gap
``(f* - f) / f*`` of ``--target`` (and its learning rate; an iterate off the
manifold, ``max |W^T W - I| > 1e-5``, does not count: there the objective
exceeds the optimum), and for the large problem the gap after
``--steps-large`` steps at the learning rate that ends closest to the optimum
among those whose every iterate stayed finite and on the manifold.

Time per step at the large size: a jitted step (gradient, update, apply) of
each JAX optimizer, against a torch step (forward, backward, ``step``), timed in
interleaved rounds (one step of each per round) so that the load of a shared
machine falls on all alike, median and minimum; plus the JAX step's compile
time and ``memory_analysis()``. ``constrained(..., retraction="projection")``
is timed too, with how often its projection fell back to the polar factor.

Writes ``riemannian.json`` and ``riemannian.png`` to ``--out``. Without torch
and geoopt the geoopt columns are skipped (said so in the JSON's
``geoopt_skipped``).

Run: ``python -m benchmarks.comparisons.riemannian`` (``--smoke``: tiny sizes, seconds).
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.comparisons.riemannian_geoopt import geoopt_available, torch_stepper, torch_trajectory
from benchmarks.harness.records import provenance, write_json
from cola_jax.constraints.orthogonal import polar_of_tangent_step

ON_MANIFOLD = 1e-5


def make_problem(kind, n, k, seed, m=None):
  """(A or M, optimum, start) in float64 numpy; the objective is tr(W^T A W) or tr(W^T M)."""
  rng = np.random.default_rng(seed)
  start = np.linalg.qr(rng.standard_normal((n, k)))[0].astype(np.float32)
  if kind == "top_k":
    x = rng.standard_normal((n, n))
    a = ((x + x.T) / 2).astype(np.float32)
    return a, float(np.sort(np.linalg.eigvalsh(a.astype(np.float64)))[-k:].sum()), start
  x = np.linalg.qr(rng.standard_normal((m, n)))[0]
  w_0 = np.linalg.qr(rng.standard_normal((n, k)))[0]
  y = x @ w_0 + 0.3 * rng.standard_normal((m, k))
  target = (x.T @ y).astype(np.float32)
  return target, float(np.linalg.svd(target.astype(np.float64), compute_uv=False).sum()), start


def jax_objective(kind, data):
  data = jnp.asarray(data)
  if kind == "top_k":
    return lambda w: jnp.sum(w * (data @ w))
  return lambda w: jnp.sum(w * data)


def transported_adam(lr, b1=0.9, b2=0.999, eps=1e-8):
  """Ablation: ``constrained(adam)`` with Adam's first moment transported (projected onto the new tangent space).

  geoopt's choice; ``constrained`` instead leaves ``inner``'s state as it is and
  projects the update. Same retraction (polar) as ``constrained``.
  """

  def init(w):
    return jnp.zeros_like(w), jnp.zeros_like(w), jnp.zeros([], jnp.int32)

  def update(grad, state, w):
    m, v, t = state
    t = t + 1
    sym = lambda a: (a + a.T) / 2
    tangent = lambda x: x - w @ sym(w.T @ x)
    rgrad = tangent(grad)
    m = b1 * tangent(m) + (1 - b1) * rgrad
    v = b2 * v + (1 - b2) * rgrad * rgrad
    direction = (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)
    return polar_of_tangent_step(w - lr * tangent(direction)) - w, (m, v, t)

  return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]


def jax_optimizers():
  orthogonal = cola.Orthogonal()
  return {
    "cola constrained(adam)": lambda lr: cola.constrained(optax.adam(lr), constraints=orthogonal),
    "cola constrained(sgd, momentum 0.9)": lambda lr: cola.constrained(
      optax.sgd(lr, momentum=0.9), constraints=orthogonal
    ),
    "naive chain: scale_by_adam -> cola_od": lambda lr: optax.chain(
      optax.scale_by_adam(), cola.cola_od(lr, constraints=orthogonal)
    ),
    "ablation: adam, first moment transported": transported_adam,
  }


def jax_trajectory(make_tx, objective, start, lr, steps):
  """(objective after every step, max |W^T W - I| after every step, seconds incl. compile)."""
  tx = make_tx(lr)
  loss = lambda w: -objective(w)

  def step(carry, _):
    w, s = carry
    updates, s = tx.update(jax.grad(loss)(w), s, w)
    w = optax.apply_updates(w, updates)
    defect = jnp.max(jnp.abs(w.T @ w - jnp.eye(w.shape[1], dtype=w.dtype)))
    return (w, s), (objective(w), defect)

  t = time.perf_counter()
  w0 = jnp.asarray(start)
  values, defects = jax.jit(lambda w: jax.lax.scan(step, (w, tx.init(w)), None, length=steps)[1])(w0)
  values = np.asarray(values, np.float64)
  return values, np.asarray(defects, np.float64), time.perf_counter() - t


def relative_gap(values, optimum):
  gap = (optimum - values) / abs(optimum)
  return np.where(np.isfinite(gap), gap, np.inf)


def summarise(values, defects, optimum, target):
  """An iterate counts as reaching the target only on the manifold (off it, tr(W^T A W) exceeds the optimum)."""
  gap = relative_gap(values, optimum)
  on_manifold = np.isfinite(defects) & (defects <= ON_MANIFOLD)
  reached = np.flatnonzero((gap <= target) & on_manifold)
  finite = bool(np.all(np.isfinite(values)) and np.all(np.isfinite(defects)))
  return {
    "iterations_to_target": int(reached[0]) + 1 if reached.size else None,
    "final_gap": float(gap[-1]) if np.isfinite(gap[-1]) else None,
    "finite_at_every_step": finite,
    "on_manifold_at_every_step": bool(np.all(on_manifold)),
    "max_defect": float(np.max(defects)) if finite else None,
    "gap_curve": [float(g) if np.isfinite(g) else None for g in gap],
  }


def best(runs, by_final_gap=False):
  """The learning rate with the fewest iterations to target (then the smallest final gap), or, for the
  large problem, the smallest final gap among runs that stayed finite and on the manifold."""

  def rank(item):
    _, r = item
    final = r["final_gap"] if r["final_gap"] is not None else np.inf
    if by_final_gap:
      return (not r["on_manifold_at_every_step"], final)
    return (r["iterations_to_target"] is None, r["iterations_to_target"] or 0, final)

  lr, run = min(runs.items(), key=rank)
  return {"lr": float(lr), **run}


def jax_stepper(make_tx, objective, start, lr):
  """(one timed step, facts): a compiled step of (gradient, update, apply), with its compile time and memory."""
  tx = make_tx(lr)
  loss = lambda w: -objective(w)

  def step(w, s):
    updates, s = tx.update(jax.grad(loss)(w), s, w)
    return optax.apply_updates(w, updates), s

  carry = [jnp.asarray(start), tx.init(jnp.asarray(start))]
  t = time.perf_counter()
  compiled = jax.jit(step).lower(*carry).compile()
  facts = {
    "compile_s": time.perf_counter() - t,
    "temp_bytes": getattr(compiled.memory_analysis(), "temp_size_in_bytes", None),
  }

  def run_once():
    carry[:] = compiled(*carry)
    jax.block_until_ready(carry[0])

  return run_once, facts


def interleaved_times(steppers: dict, repetitions: int) -> dict:
  """Milliseconds per step of each stepper, timed in rounds (one step of each per round, after 5 warm-up
  rounds), so that the load of a shared machine falls on all of them alike: median and minimum."""
  times = {name: [] for name in steppers}
  for round_ in range(repetitions + 5):
    for name, (run_once, _) in steppers.items():
      t = time.perf_counter()
      run_once()
      if round_ >= 5:
        times[name].append(1e3 * (time.perf_counter() - t))
  return {
    name: {"ms_per_step": float(np.median(times[name])), "ms_per_step_min": float(np.min(times[name])), **facts}
    for name, (_, facts) in steppers.items()
  }


def plot(report, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  problems = report["problems"]
  fig, axes = plt.subplots(1, len(problems), figsize=(5 * len(problems), 4))
  for ax, (label, problem) in zip(np.atleast_1d(axes), problems.items()):
    for name, run in problem["best"].items():
      curve = np.array([np.nan if g is None else g for g in run["gap_curve"]])
      ax.semilogy(np.arange(1, curve.size + 1), np.maximum(curve, 1e-8), label=f"{name} (lr {run['lr']:g})")
    ax.axhline(report["target"], color="grey", lw=0.8, ls=":")
    ax.set_title(label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("relative gap to the optimum")
  np.atleast_1d(axes)[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def markdown_table(report) -> str:
  """The guide's table: iterations to the target (best learning rate) per problem, the large problem's gap and speed."""
  problems = list(report["problems"])
  large = problems[-1]
  n, k = report["timing_shape"]
  header = [
    "optimizer",
    *(f"{p}: iterations to {report['target']:g} (lr)" for p in problems[:-1]),
    f"{large}: gap after {report['problems'][large]['steps']} steps (lr), on the manifold at every step",
    f"ms/step at {n}x{k}, lr 0.01 / 0.1: median (min)",
  ]
  rows = []
  for name in report["problems"][large]["best"]:
    cells = [name]
    for p in problems[:-1]:
      run = report["problems"][p]["best"][name]
      reached = run["iterations_to_target"]
      missed = f"not reached: gap {run['final_gap']:.2g}"
      cells.append(f"{reached if reached else missed} ({run['lr']:g})")
    run = report["problems"][large]["best"][name]
    gap = "NaN" if run["final_gap"] is None else f"{run['final_gap']:.2g}"
    cells.append(f"{gap} ({run['lr']:g}), {'yes' if run['on_manifold_at_every_step'] else 'no'}")
    timed = [report["timing"][f"{name} @ lr {lr:g}"] for lr in (1e-2, 1e-1)]
    cells.append(" / ".join(f"{t['ms_per_step']:.2f} ({t['ms_per_step_min']:.2f})" for t in timed))
    rows.append(cells)
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true", help="tiny sizes, few steps: a check that runs in seconds")
  p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
  p.add_argument("--steps", type=int, default=600, help="iterations at most on the small problems")
  p.add_argument("--steps-large", type=int, default=300)
  p.add_argument("--target", type=float, default=1e-3)
  p.add_argument("--repetitions", type=int, default=200, help="timed steps")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--torch-threads", type=int, default=1, help="torch.set_num_threads (XLA runs these sizes on one thread too)"
  )
  p.add_argument("--out", default="results/comparisons")
  return p.parse_args(argv)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  start_time = time.perf_counter()
  if args.smoke:
    args.lrs, args.steps, args.steps_large, args.repetitions = [1e-2, 1e-1], 50, 20, 5
  small, large = ((12, 3), (24, 4)) if args.smoke else ((48, 6), (512, 64))
  problems = {
    f"top-{small[1]} of {small[0]}": ("top_k", *small, None),
    f"Procrustes {4 * small[0] + 8}x{small[0]} -> {small[1]}": ("procrustes", *small, 4 * small[0] + 8),
    f"top-{large[1]} of {large[0]}": ("top_k", *large, None),
  }
  if not args.smoke:
    problems = {
      "top-6 of 48": ("top_k", 48, 6, None),
      "Procrustes 200x48 -> 6": ("procrustes", 48, 6, 200),
      "top-64 of 512": ("top_k", 512, 64, None),
    }
  skipped = geoopt_available()
  if skipped:
    print(f"geoopt columns skipped: {skipped} (pip install torch geoopt to run them)")
  names = list(jax_optimizers()) + ([] if skipped else ["geoopt RiemannianAdam", "geoopt RiemannianSGD, momentum 0.9"])
  report = {
    "meta": provenance(argv, start_time),
    "target": args.target,
    "lrs": args.lrs,
    "geoopt_skipped": skipped,
    "problems": {},
  }
  if not skipped:
    import geoopt
    import torch

    torch.set_num_threads(args.torch_threads)
    report["meta"]["versions"].update(torch=torch.__version__, geoopt=geoopt.__version__)
    report["meta"]["torch_threads"] = torch.get_num_threads()

  for label, (kind, n, k, m) in problems.items():
    data, optimum, start = make_problem(kind, n, k, args.seed, m)
    objective = jax_objective(kind, data)
    steps = args.steps_large if n == large[0] else args.steps
    runs = {}
    for name in names:
      runs[name] = {}
      for lr in args.lrs:
        if name.startswith("geoopt"):
          values, defects, seconds = torch_trajectory(name, kind, data, start, lr, steps)
        else:
          values, defects, seconds = jax_trajectory(jax_optimizers()[name], objective, start, lr, steps)
        runs[name][lr] = {**summarise(values, defects, optimum, args.target), "seconds": seconds}
      chosen = best(runs[name], by_final_gap=n == large[0])
      print(
        f"{label:24s} {name:40s} lr {chosen['lr']:<6g} iterations {chosen['iterations_to_target']} "
        f"final gap {chosen['final_gap']} finite {chosen['finite_at_every_step']} "
        f"on manifold {chosen['on_manifold_at_every_step']}",
        flush=True,
      )
    report["problems"][label] = {
      "kind": kind,
      "shape": [n, k],
      "optimum": optimum,
      "steps": steps,
      "best": {name: best(runs[name], by_final_gap=n == large[0]) for name in names},
      "all": {name: {str(lr): {**r, "gap_curve": None} for lr, r in runs[name].items()} for name in names},
    }

  kind, n, k, m = problems[f"top-{large[1]} of {large[0]}"]
  data, _, start = make_problem(kind, n, k, args.seed, m)
  objective = jax_objective(kind, data)
  timing_optimizers = {
    **jax_optimizers(),
    "cola constrained(adam), retraction='projection'": lambda lr: cola.constrained(
      optax.adam(lr), constraints=cola.Orthogonal(), retraction="projection"
    ),
  }
  steppers = {}
  for lr in (1e-2, 1e-1):
    for name, make_tx in timing_optimizers.items():
      steppers[f"{name} @ lr {lr:g}"] = jax_stepper(make_tx, objective, start, lr)
    if not skipped:
      for name in names[len(jax_optimizers()) :]:
        steppers[f"{name} @ lr {lr:g}"] = torch_stepper(name, kind, data, start, lr)
  timing = interleaved_times(steppers, args.repetitions)
  for name, t in timing.items():
    print(f"{name:60s} median {t['ms_per_step']:.3f} min {t['ms_per_step_min']:.3f} ms/step", flush=True)
  report["timing_shape"] = [n, k]
  report["timing"] = timing
  report["meta"]["wall_time_s"] = time.perf_counter() - start_time
  print(markdown_table(report))

  os.makedirs(args.out, exist_ok=True)
  write_json(os.path.join(args.out, "riemannian.json"), report)
  try:
    plot(report, os.path.join(args.out, "riemannian.png"))
  except ImportError as error:
    print(f"no plot: {error}")
  return report


if __name__ == "__main__":
  main()
