#!/usr/bin/env python
r"""Projections onto the Stiefel manifold after one o-CoLA step: cost and dynamics.

Setup. ``Q_n`` of shape ``(r, s)`` has orthonormal columns (Q factor of a
Gaussian); the step is the Euler-Maruyama step of o-CoLA-od,
``D = -h G + sqrt(2 tau h) R``, with ``G`` gradient-like (rank
``min(128, s)``, the batch size of the paper's Fashion-MNIST model, entries of
RMS ``--grad-rms``) and ``R`` standard normal; ``Q_bar = Q_n + D``. Besides the
full step (``em``) the 512 x 512 case is also run with its tangential part alone
(``tangent``: ``D - Q_n sym(Q_n^T D)``) and its normal part alone (``normal``:
``Q_n sym(Q_n^T D)``). All in float32; every method must reach
``||Q^T Q - I||_F <= --tolerance``.

Methods with the paper's constraint force ``-Q_n Lambda`` (``Lambda``
symmetric), hence the same point (see ``cola_jax.constraints.stiefel_projection``):

* ``quasi_newton``: the paper's ``Q <- Q - 1/2 Q_n (Q^T Q - I)``, linear rate
  ``rho = ||skew(Q_n^T D)||_2``.
* ``newton_multiplier``: Newton on ``Lambda`` in ``s x s`` space, Lyapunov
  corrections by fixed-point sweeps.
* ``square_root``: ``X = Q_n^T Q = A + (K + A^2)^{1/2}``, ``A = skew(Q_n^T Q_bar)``,
  by a binomial series that converges at rate ``rho^2``; exact for square
  matrices, chord steps in ``s x s`` space remove the rest for tall ones.

Methods with other dynamics:

* ``polar``: the nearest point ``U V^T`` (SVD of ``Q_bar``). ``Q_bar = Q H``
  gives ``Q = Q_bar - Q (H - I)``: the force is normal at the END point
  ``Q_{n+1}``, not at ``Q_n``. The two differ by
  ``O(|D_tangential| |D_normal|)``, second order in the step: the same SDE in
  the limit ``h -> 0`` (both projections generate the Ito curvature drift), a
  different ``O(h)`` bias of the invariant measure (with noise ``D ~ sqrt(h)``
  the per-step difference is ``O(h)`` but has zero mean).
* ``qr_tangent``: the QR retraction ``qf(Q_n + xi)`` of the tangential part
  ``xi`` of ``D`` (positive diagonal of R). Agrees with the paper's point to
  first order; its second-order tangential term is mean-zero for isotropic
  noise.
* ``qr_ambient``: ``qf(Q_bar)``, the QR factor of the whole step. Not a
  projection: ``Q = Q_bar R^{-1}`` with a triangular multiplier, so the normal
  part of ``D`` leaks into tangential motion at FIRST order
  (``Q_n^T Q - I ~ L - L^T``, ``L`` the strict lower triangle of ``Q_n^T D``,
  instead of ``skew(Q_n^T D)``): on the square orthogonal group the
  tangential noise variance doubles and the gradient direction changes, a
  different SDE with a different invariant measure. Its distance to the
  paper's point scales like ``|D|``, not ``|D|^2``.
* ``cayley_tangent``: ``(I - W/2)^{-1}(I + W/2) Q_n`` with
  ``W = P xi Q_n^T - Q_n (P xi)^T``, ``P = I - Q_n Q_n^T / 2`` (Wen and Yin):
  ``Q_n cay(Q_n^T xi)`` for square matrices, a ``2s x 2s`` solve by the
  Woodbury identity for tall ones. Like ``qr_tangent`` it retracts the
  tangential part and discards the normal part; first-order agreement.

Measured per size, step size and step kind: time to the tolerance (jit,
``block_until_ready``, median of repetitions after a warm-up call),
iterations, the final defect, the distance to ``Q_bar`` and to the paper's
point (computed in float64), and the float32 floor (the defect, evaluated in
float32, of the float64 paper point rounded to float32; a tolerance near
it cannot be met reliably: where ``--tolerance`` is below 1.5 x floor,
1.5 x floor is used and reported). The SVD, QR and Cayley points are polished
by at most 5 steps ``Q <- Q - 1/2 Q (Q^T Q - I)`` (the polar iteration, which
leaves a polar factor in place): the factorizations alone stop at 2 to 7
times the floor (SVD polar: 5.7e-5 at 512 x 512). ``order`` is the slope of
``log ||Q_method - Q_paper||`` against ``log ||D||`` between the two step
sizes: 2 (or more) means the same first-order dynamics as the paper, 1
different ones (not computed where the distances are below 10 x tolerance,
i.e. rounding).

Batching: the hidden layers of deep MLPs (``8 x 100x100``, ``4 x 512x512``)
projected one by one (a Python loop inside one ``jit``, each layer its own
``while_loop``) and stacked under ``vmap`` (one batched ``while_loop`` that
runs until every layer has converged).

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.stiefel_projection --out results/cost
  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.stiefel_projection --smoke --out /tmp/s

Writes ``stiefel_projection.json`` (``meta``: command, argv, date, machine
and versions; ``config``; ``floors``; ``results``, one record per shape, h,
step kind and method; ``batching``; ``targets``) and ``stiefel_projection.png``
under ``--out``.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cost.stiefel_solvers import (
  METHODS,
  PAPER_FORCE,
  float32_floor,
  make_step,
  method_fn,
  normal_part,
  paper_point64,
  project_layers_loop,
  project_layers_vmap,
  random_orthonormal,
)
from benchmarks.harness.records import finite_list, provenance, write_json
from benchmarks.harness.timing import speed_output, speed_parser, started_run, target_lines, time_call
from cola_jax.constraints import stiefel_projection as sp

TOP_KEYS = ("meta", "config", "floors", "results", "batching", "targets")
RESULT_KEYS = (
  "shape",
  "h",
  "kind",
  "method",
  "force",
  "ms",
  "iterations",
  "converged",
  "defect",
  "distance_to_q_bar",
  "distance_to_paper",
  "rho",
  "order",
)
BATCH_METHODS = ("quasi_newton", "square_root")
FLOOR_MARGIN = 1.5  # the tolerance used is max(--tolerance, FLOOR_MARGIN x floor)


# ----------------------------------------------------------------------------
# Report.


def targets_from(results):
  out = []
  for h in sorted({r["h"] for r in results}):
    rows = {r["method"]: r for r in results if r["shape"] == [512, 512] and r["h"] == h and r["kind"] == "em"}
    if "polar" not in rows:
      continue
    best = min(
      (rows[m] for m in PAPER_FORCE if m in rows and rows[m]["converged"]), key=lambda r: r["ms"], default=None
    )
    value = None if best is None else best["ms"] / rows["polar"]["ms"]
    out.append(
      {
        "name": f"512x512, h={h}: fastest Q_n-force method time / SVD polar time",
        "method": None if best is None else best["method"],
        "value": value,
        "limit": 0.5,
        "met": None if value is None else bool(value <= 0.5),
      }
    )
  return out


def plot(results, batching, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
  ax = axes[0]
  hs = sorted({r["h"] for r in results})
  for i, method in enumerate(METHODS):
    for h, style in zip(hs, ("--", "-")):
      rows = sorted(
        (r for r in results if r["method"] == method and r["h"] == h and r["kind"] == "em"),
        key=lambda r: r["shape"][0] * r["shape"][1],
      )
      ns = [np.sqrt(r["shape"][0] * r["shape"][1]) for r in rows]
      ms = [r["ms"] if r["converged"] else np.nan for r in rows]
      ax.plot(ns, ms, style, marker="o", color=f"C{i}", label=method if h == hs[-1] else None)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sqrt(r s) (r x s matrix; square and tall)")
  ax.set_ylabel("ms to ||Q^T Q - I||_F <= tol (median)")
  ax.set_title(f"projection time; solid h={hs[-1]}, dashed h={hs[0]}")
  ax.legend(fontsize=7)
  ax = axes[1]
  labels = [f"{b['layers']}x{b['shape'][0]}x{b['shape'][1]}\n{b['method']}" for b in batching]
  xs = np.arange(len(batching))
  ax.bar(xs - 0.2, [b["loop_ms"] for b in batching], 0.4, label="loop in jit")
  ax.bar(xs + 0.2, [b["vmap_ms"] for b in batching], 0.4, label="vmap")
  ax.set_xticks(xs, labels, fontsize=7)
  ax.set_yscale("log")
  ax.set_ylabel("ms (median)")
  ax.set_title("projecting a deep MLP's hidden layers")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(floors, results, batching, targets, tolerance) -> str:
  lines = [f"{'shape':>9s} {'floor':>8s}  note"]
  for f in floors:
    if f["floor"] is None:
      lines.append(f"{f['shape'][0]:4d}x{f['shape'][1]:<4d} {'n/a':>8s}  no paper point")
      continue
    note = f"--tolerance below {FLOOR_MARGIN} x floor: {f['tolerance']:.2e} used" if f["tolerance"] > tolerance else ""
    lines.append(f"{f['shape'][0]:4d}x{f['shape'][1]:<4d} {f['floor']:8.1e}  {note}")
  lines.append("")
  lines.append(
    f"{'shape':>9s} {'h':>5s} {'kind':7s} {'rho':>5s} {'method':17s} {'ms':>9s} "
    f"{'it':>4s} {'ok':>3s} {'defect':>8s} {'|Q-Qbar|':>9s} {'|Q-Qpap|':>9s} "
    f"{'order':>5s}"
  )
  for r in results:
    fmt = lambda v, spec: "n/a".rjust(len(format(1.0, spec))) if v is None else format(v, spec)
    lines.append(
      f"{r['shape'][0]:4d}x{r['shape'][1]:<4d} {r['h']:5.2f} {r['kind']:7s} "
      f"{fmt(r['rho'], '5.2f')} {r['method']:17s} {r['ms']:9.2f} {r['iterations']:4d} "
      f"{'yes' if r['converged'] else 'NO':>3s} {fmt(r['defect'], '8.1e')} "
      f"{fmt(r['distance_to_q_bar'], '9.2e')} {fmt(r['distance_to_paper'], '9.2e')} "
      f"{fmt(r['order'], '5.2f')}"
    )
  lines.append("")
  lines.append(f"{'layers':>14s} {'method':13s} {'loop ms':>9s} {'vmap ms':>9s} {'loop/vmap':>9s} {'max |diff|':>10s}")
  for b in batching:
    lines.append(
      f"{b['layers']:3d} x {b['shape'][0]:4d}x{b['shape'][1]:<4d} {b['method']:13s} "
      f"{b['loop_ms']:9.2f} {b['vmap_ms']:9.2f} {b['ratio']:9.2f} "
      f"{b['max_difference']:10.1e}"
    )
  lines.append("")
  lines.extend(target_lines(targets, lambda t: f"{t['value']:.2f} ({t['method']})"))
  return "\n".join(lines)


def parse_args(argv=None):
  p = speed_parser(__doc__, "tiny sizes and one repetition: a check that runs in seconds", repetitions=15, budget_s=1.5)
  p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024], help="square sizes n")
  p.add_argument("--tall", nargs="*", default=["784x100", "1024x256"], help="tall shapes RxS")
  p.add_argument("--h", type=float, nargs="+", default=[0.01, 0.1], help="step sizes")
  p.add_argument("--temperature", type=float, default=2.5e-4, help="tau of the Euler-Maruyama noise sqrt(2 tau h) R")
  p.add_argument("--grad-rms", type=float, default=0.07, help="RMS of the gradient-like G's entries")
  p.add_argument("--tolerance", type=float, default=1e-5, help="on ||Q^T Q - I||_F")
  p.add_argument("--max-iterations", type=int, default=100)
  p.add_argument(
    "--split-shape", default="512x512", help="the shape RxS also run with the tangential / normal part alone"
  )
  return p.parse_args(argv)


def main(argv=None) -> dict:
  argv, args, start = started_run(parse_args, argv)
  if args.smoke:
    args.sizes, args.tall, args.split_shape = [], ["48x16"], "48x16"
    args.repetitions, args.budget = 1, 0.5
    batch_stacks = [(3, 16, 16)]
  else:
    batch_stacks = [(8, 100, 100), (4, 512, 512)]
  args.out = speed_output(args, "stiefel_projection")
  shapes = [(n, n) for n in args.sizes] + [tuple(int(v) for v in t.split("x")) for t in args.tall]

  key = jax.random.key(args.seed)
  floors, results = [], []
  for shape_index, (r, s) in enumerate(shapes):
    k_q, k_d = jax.random.split(jax.random.fold_in(key, shape_index))
    q_n = random_orthonormal(k_q, r, s)
    kinds = ["em", "tangent", "normal"] if f"{r}x{s}" == args.split_shape else ["em"]
    floor, tolerance = None, args.tolerance
    fns = {m: jax.jit(method_fn(m, tolerance, args.max_iterations)) for m in METHODS}
    for kind in kinds:
      per_h = {}
      for h in args.h:
        d = make_step(jax.random.fold_in(k_d, round(h * 1e6)), q_n, h, args.temperature, args.grad_rms, kind)
        q_bar = q_n + d
        y = np.asarray(q_n.T @ d, np.float64)
        rho = float(np.linalg.norm(0.5 * (y - y.T), 2))
        paper = paper_point64(q_n, q_bar)
        if floor is None and paper is not None:
          floor = float32_floor(paper)
          tolerance = max(args.tolerance, FLOOR_MARGIN * floor)
          fns = {m: jax.jit(method_fn(m, tolerance, args.max_iterations)) for m in METHODS}
        for method in METHODS:
          q, iterations, converged = fns[method](q_n, q_bar)
          samples = time_call(fns[method], (q_n, q_bar), args.repetitions, args.budget)
          seconds, reps = float(np.median(samples)), len(samples)
          q64 = np.asarray(q, np.float64)
          record = {
            "shape": [r, s],
            "h": h,
            "kind": kind,
            "method": method,
            "force": "Q_n"
            if method in PAPER_FORCE
            else {"polar": "Q_{n+1}", "qr_ambient": "Q_bar R^-1 (triangular)"}.get(method, "tangent retraction"),
            "tolerance": tolerance,
            "ms": seconds * 1e3,
            "repetitions": reps,
            "iterations": int(iterations),
            "converged": bool(converged),
            "defect": finite_list(sp.defect(q)),
            "distance_to_q_bar": finite_list(np.linalg.norm(q64 - np.asarray(q_bar))),
            "distance_to_paper": None if paper is None else finite_list(np.linalg.norm(q64 - paper)),
            "rho": rho,
            "step_norm": float(jnp.linalg.norm(d)),
            "tangential_norm": float(jnp.linalg.norm(d - normal_part(q_n, d))),
            "normal_norm": float(jnp.linalg.norm(normal_part(q_n, d))),
            "order": None,
          }
          per_h.setdefault(method, []).append(record)
          results.append(record)
      for records in per_h.values():  # slope of log |Q - Q_paper| against log |D|
        pts = [
          (rec["step_norm"], rec["distance_to_paper"])
          for rec in records
          if rec["distance_to_paper"] and rec["distance_to_paper"] > 10 * args.tolerance
        ]
        if len(pts) >= 2 and pts[-1][0] != pts[0][0]:
          order = np.log(pts[-1][1] / pts[0][1]) / np.log(pts[-1][0] / pts[0][0])
          for rec in records:
            rec["order"] = float(order)
    floors.append(
      {
        "shape": [r, s],
        "floor": floor,
        "tolerance": tolerance,
        "estimate_sqrt_s_times_s_eps": float(np.sqrt(s) * s * np.finfo(np.float32).eps),
      }
    )

  batching = []
  h_batch = max(args.h)
  for layers, r, s in batch_stacks:
    keys = jax.random.split(jax.random.fold_in(key, 1000 + r), layers)
    qs_n = jnp.stack([random_orthonormal(k, r, s) for k in keys])
    qs_bar = qs_n + jnp.stack(
      [make_step(jax.random.fold_in(k, 1), q, h_batch, args.temperature, args.grad_rms) for k, q in zip(keys, qs_n)]
    )
    for method in BATCH_METHODS:
      f = method_fn(method, args.tolerance, args.max_iterations)
      loop, vmapped = jax.jit(project_layers_loop(f)), jax.jit(project_layers_vmap(f))
      q_loop, it_loop, ok_loop = loop(qs_n, qs_bar)
      q_vmap, _, ok_vmap = vmapped(qs_n, qs_bar)
      t_loop = float(np.median(time_call(loop, (qs_n, qs_bar), args.repetitions, args.budget)))
      t_vmap = float(np.median(time_call(vmapped, (qs_n, qs_bar), args.repetitions, args.budget)))
      batching.append(
        {
          "layers": layers,
          "shape": [r, s],
          "h": h_batch,
          "method": method,
          "loop_ms": t_loop * 1e3,
          "vmap_ms": t_vmap * 1e3,
          "ratio": t_loop / t_vmap,
          "iterations_per_layer": [int(i) for i in it_loop],
          "converged": bool(jnp.all(ok_loop) & jnp.all(ok_vmap)),
          "max_difference": float(jnp.max(jnp.abs(q_loop - q_vmap))),
        }
      )

  targets = targets_from(results)
  report = {
    "meta": provenance(argv, start),
    "config": {
      "smoke": args.smoke,
      "shapes": [list(sh) for sh in shapes],
      "h": args.h,
      "temperature": args.temperature,
      "grad_rms": args.grad_rms,
      "gradient_rank": "min(128, s)",
      "tolerance": args.tolerance,
      "tolerance_norm": "Frobenius",
      "max_iterations": args.max_iterations,
      "split_shape": args.split_shape,
      "repetitions": args.repetitions,
      "budget_s": args.budget,
      "dtype": "float32",
      "methods": list(METHODS),
      "batch_stacks": [list(b) for b in batch_stacks],
      "timing": "jit; one warm-up call excluded; median of repetitions; jax.block_until_ready after every call",
      "distance_to_paper": "Frobenius distance to the paper's point computed in float64",
    },
    "floors": floors,
    "results": results,
    "batching": batching,
    "targets": targets,
  }
  json_path = os.path.join(args.out, "stiefel_projection.json")
  write_json(json_path, report)
  png_path = os.path.join(args.out, "stiefel_projection.png")
  plot(results, batching, png_path)
  print(table(floors, results, batching, targets, args.tolerance))
  print(f"\nwrote {json_path} and {png_path}")
  return report


if __name__ == "__main__":
  main()
