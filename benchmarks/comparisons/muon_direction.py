r"""Manifold Muon's direction: the cost of each way of finding it against how far from the steepest it is.

On the gradients of the 784-128-64-10 MLP of ``muon.py`` (Fashion-MNIST, batch
1024, every kernel ``Orthogonal``) along ``cola.manifold_muon(0.1)``'s first
steps (seed 0), per kernel and step: the direction ``d`` (Nesterov momentum
0.95, as the step uses it) and the kernel ``W``. Each variant gives a tangent
``A`` with ``|A|_2 <= 1``; its suboptimality is ``1 - <d, A> / <d, A*>``, with
``A*`` the ADMM direction certified to a gap of ``--exact-gap-tolerance``. The
variants:

* ``admm_gap_<tol>``: :func:`cola_jax.stiefel_direction.steepest_tangent_direction`
  stopped at a certified gap ``tol`` (its iterations and gap recorded);
* ``admm_<k>_iterations``: the same ADMM stopped after ``k`` iterations;
* ``projected_msign``: ``P_T(msign(d))`` scaled to unit spectral norm, the
  direction of ``cola.constrained(optax.contrib.muon)`` (its update is
  ``msign`` of the momentum, then the tangent projection);
* ``spel``: ``P_T(msign(P_T(d)))`` scaled so, the direction of the MCSD/SPEL
  step ``W <- msign(W - eta msign(P_T d))`` (arXiv 2601.21487) to first order
  in ``eta``.

``msign`` here is exact (an SVD). Cost: the median time of one jitted call per
step, summed over the three kernels; the variants timed in turn at each step
(interleaved), one process, ``OPENBLAS_NUM_THREADS=1`` recommended.

Run: ``python -m benchmarks.comparisons.muon_direction`` (``--smoke``: seconds).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import cola_jax as cola
from benchmarks.comparisons.muon_protocol import (
  BATCH,
  STIEFEL,
  apply,
  batch_orders,
  init_params,
  load_data,
  on_manifold,
)
from benchmarks.harness.records import write_report
from benchmarks.harness.train import SOFTMAX, seed_keys
from cola_jax.stiefel_direction import steepest_tangent_direction

BETA = 0.95
LEARNING_RATE = 0.1


def _msign(x):
  u, _, vt = jnp.linalg.svd(x, full_matrices=False)
  return u @ vt


def _unit_tangent(w, x):
  """``P_T(x) = x - W sym(W^T x)`` scaled to unit spectral norm."""
  t = x - w @ (0.5 * (w.T @ x + x.T @ w))
  return t / jnp.linalg.norm(t, 2)


def variants(gap_tolerances, iteration_counts) -> dict:
  """name: a function ``(w, d) -> (A, iterations, certified gap or NaN)``."""
  nan = jnp.array(jnp.nan)

  def admm(gap_tolerance, max_iterations):
    def direction(w, d):
      a, info = steepest_tangent_direction(w, d, gap_tolerance=gap_tolerance, max_iterations=max_iterations)
      return a, info.iterations, info.gap

    return direction

  out = {f"admm_gap_{tol:g}": admm(tol, 5000) for tol in gap_tolerances}
  # A tolerance below float32's certificates: it runs k iterations.
  out.update({f"admm_{k}_iterations": admm(1e-12, k) for k in iteration_counts})

  def projected_msign(w, d):
    return _unit_tangent(w, _msign(d)), jnp.zeros((), jnp.int32), nan

  def spel(w, d):
    return _unit_tangent(w, _msign(_unit_tangent(w, d))), jnp.zeros((), jnp.int32), nan

  return {**out, "projected_msign": projected_msign, "spel": spel}


def trajectory(steps: int, smoke: bool):
  """Per step, per kernel: ``(W, d)`` along ``cola.manifold_muon(0.1)`` from seed 0's initial weights."""
  _, final = load_data(None, smoke)
  params = on_manifold(init_params(seed_keys(0)[0]), STIEFEL)
  tx = cola.manifold_muon(LEARNING_RATE, constraints=cola.Orthogonal(), beta=BETA)
  state = tx.init(params)
  x, y = jnp.asarray(final.x_train), jnp.asarray(final.y_train)

  @jax.jit
  def step(params, state, idx):
    grads = jax.grad(lambda p: jnp.mean(SOFTMAX.loss(apply(p, x[idx]), y[idx])))(params)
    updates, new_state = tx.update(grads, state, params)
    momentum = jax.tree.map(lambda m, g: BETA * m + (1 - BETA) * g, state.momentum, grads)
    directions = jax.tree.map(lambda m, g: BETA * m + (1 - BETA) * g, momentum, grads)
    return jax.tree.map(lambda p, u: p + u, params, updates), new_state, directions

  order = batch_orders(0, len(final.x_train), 1)[0]
  pairs = []
  for b in range(min(steps, len(order) // BATCH)):
    new_params, state, directions = step(params, state, jnp.asarray(order[b * BATCH : (b + 1) * BATCH]))
    pairs.append({k: (params[k], directions[k]) for k in params})
    params = new_params
  return pairs


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  p.add_argument("--steps", type=int, default=12, help="training steps whose gradients are solved")
  p.add_argument("--exact-gap-tolerance", type=float, default=1e-5, help="the certified gap of the reference direction")
  p.add_argument("--out", default=None, help="output folder; default results/comparisons (--smoke: a temporary one)")
  p.add_argument("--smoke", action="store_true", help="two steps on a synthetic stand-in: seconds")
  args = p.parse_args(argv)
  started = time.perf_counter()
  steps = 2 if args.smoke else args.steps
  tolerances, counts = ((1e-2,), (10,)) if args.smoke else ((1e-2, 1e-3, 1e-4), (10, 30, 100, 300))
  fns = {name: jax.jit(f) for name, f in variants(tolerances, counts).items()}
  exact = jax.jit(
    functools.partial(steepest_tangent_direction, gap_tolerance=args.exact_gap_tolerance, max_iterations=10000)
  )
  pairs = trajectory(steps, args.smoke)
  layers = list(pairs[0])
  for w, d in pairs[0].values():  # compile
    jax.block_until_ready([f(w, d) for f in fns.values()])
  records = {
    name: {
      "ms": [],
      "suboptimality": {k: [] for k in layers},
      "iterations": {k: [] for k in layers},
      "certified_gap": {k: [] for k in layers},
    }
    for name in fns
  }
  exact_gaps = {k: [] for k in layers}
  for pair in pairs:
    best = {}
    for k, (w, d) in pair.items():
      a, info = exact(w, d)
      best[k] = float(jnp.sum(np.float64(d) * np.float64(a)))
      exact_gaps[k].append(float(info.gap))
    for name, f in fns.items():
      total = 0.0
      for k, (w, d) in pair.items():
        t0 = time.perf_counter()
        a, iterations, gap = jax.block_until_ready(f(w, d))
        total += time.perf_counter() - t0
        value = float(np.sum(np.float64(d) * np.float64(a)))
        r = records[name]
        r["suboptimality"][k].append(1 - value / best[k])
        r["iterations"][k].append(int(iterations))
        r["certified_gap"][k].append(float(gap) if np.isfinite(gap) else None)  # None: no certificate
      records[name]["ms"].append(1e3 * total)
  table = {}
  for name, r in records.items():
    table[name] = {
      "ms_median": float(np.median(r["ms"])),
      "suboptimality_max": {k: float(np.max(v)) for k, v in r["suboptimality"].items()},
      "suboptimality_median": {k: float(np.median(v)) for k, v in r["suboptimality"].items()},
      "iterations_median": {k: float(np.median(v)) for k, v in r["iterations"].items()},
      "iterations_max": {k: int(np.max(v)) for k, v in r["iterations"].items()},
      **r,
    }
    worst = max(table[name]["suboptimality_max"].values())
    print(
      f"{name:24s} {table[name]['ms_median']:8.2f} ms   worst suboptimality {worst:.1e}   "
      f"iterations (median) {list(table[name]['iterations_median'].values())}",
      flush=True,
    )
  config = {
    "layers": layers,
    "shapes": {k: list(w.shape) for k, (w, _) in pairs[0].items()},
    "steps": steps,
    "trajectory": f"cola.manifold_muon({LEARNING_RATE}, beta={BETA}) from seed 0, Fashion-MNIST, batch {BATCH}",
    "exact": f"steepest_tangent_direction(gap_tolerance={args.exact_gap_tolerance}, max_iterations=10000)",
    "suboptimality": "1 - <d, A> / <d, A_exact> (float64 sums); A_exact's own certified gap in exact_gap",
    "ms": "one jitted call per kernel, summed over the kernels; median over the steps; variants interleaved",
    "smoke": args.smoke,
    "machine_shared": "2 cores shared with other jobs",
  }
  out = args.out or (
    tempfile.mkdtemp(prefix="muon-direction-") if args.smoke else os.path.join("results", "comparisons")
  )
  os.makedirs(out, exist_ok=True)
  return write_report(out, "muon_direction.json", argv, started, config, exact_gap=exact_gaps, variants=table)


if __name__ == "__main__":
  main()
