r"""Muon and the manifold: manifold Muon, Muon and AdamW on the Stiefel manifold, o-CoLA-ud, hyperspherical descent.

The protocol of the modular-manifolds reference (Bernstein, Thinking Machines
2025; its ``src/main.py``) on Fashion-MNIST: a bias-free MLP 784-128-64-10,
batch 1024, 5 epochs, the learning rate decayed linearly to 0, cross-entropy,
the same data order and initial weights (PyTorch's default ``U(+-1/sqrt(fan_in))``)
for every method and framework; inputs standardised by the training set's mean
and standard deviation. Constrained methods start on their manifold (the polar
factor, or ``W / |W|_F`` on the sphere), as the reference's ``update(W, 0, eta=0)``.

Each cola/optax method picks its learning rate from a small grid by the
accuracy on a validation split (the last 5,000 training images, one seed,
trained on the other 55,000), then runs 5 seeds on the 60,000 training images,
tested on the official 10,000 test images. Reported: test accuracy, ms/step
(a jitted step of one seed: gradient, update, apply; compiled, median, every
method in the same process), the largest residual at the end, ``max |W^T W - I|``
over the kernels (``| |W|_F - 1 |`` on the sphere), and manifold Muon's
dual-iteration diagnostics where its state exposes them.

With ``--reference DIR`` (the reference's ``src/``, MIT, not part of this
project, and torch installed) its manifold Muon, hyperspherical descent and
AdamW run on the same batches and weights at its default learning rates
(``muon_reference.py``). Every invocation merges its methods into the results
JSON, so the slow reference can run in a process of its own.

Run: ``python -m benchmarks.comparisons.muon`` then
``python -m benchmarks.comparisons.muon --reference /tmp/manifolds_ref/src --methods reference``;
``--speed`` times manifold Muon against ``cola.constrained(optax.contrib.muon)``
step by step, interleaved; ``--smoke`` runs a few steps in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.comparisons import muon_reference as reference
from benchmarks.comparisons.muon_protocol import (
  BATCH,
  SPHERE,
  STIEFEL,
  Method,
  batch_orders,
  init_params,
  load_data,
  step_trace,
  timed_steps,
  train,
)
from benchmarks.comparisons.muon_report import merge, plot, replace_runs, table
from benchmarks.harness.records import mean_std, provenance
from benchmarks.harness.train import seed_keys

MOMENTUM = 0.9  # o-CoLA-ud's SGD-momentum equivalent
ORTHOGONAL = cola.Orthogonal()


def _o_cola_ud(lr, schedule):
  _, gamma = cola.sgd_momentum_to_langevin(lr, MOMENTUM)
  # The step size h_t = sqrt(SGD's learning rate), which decays linearly; the friction is fixed.
  return cola.o_cola_ud(lambda count: jnp.sqrt(schedule(count)), friction=gamma, constraints=ORTHOGONAL)


METHODS = {
  "manifold_muon": Method(
    "cola.manifold_muon (momentum 0.95, Nesterov)",
    (0.05, 0.1, 0.2),
    lambda lr, s: cola.manifold_muon(s, constraints=ORTHOGONAL),
    STIEFEL,
  ),
  "manifold_muon_m0": Method(
    "cola.manifold_muon (momentum 0: the reference's rule)",
    (0.05, 0.1, 0.2),
    lambda lr, s: cola.manifold_muon(s, beta=0.0, nesterov=False, constraints=ORTHOGONAL),
    STIEFEL,
  ),
  "muon_on_manifold": Method(
    "cola.constrained(optax.contrib.muon), Orthogonal",
    (0.05, 0.1, 0.2),
    lambda lr, s: cola.constrained(optax.contrib.muon(s), constraints=ORTHOGONAL),
    STIEFEL,
  ),
  "adamw_on_manifold": Method(
    "cola.constrained(optax.adamw), Orthogonal",
    (1e-3, 3e-3, 1e-2),
    lambda lr, s: cola.constrained(optax.adamw(s), constraints=ORTHOGONAL),
    STIEFEL,
  ),
  "o_cola_ud": Method(f"cola.o_cola_ud (SGD-m equivalent, momentum {MOMENTUM})", (0.1, 0.3, 1.0), _o_cola_ud, STIEFEL),
  "hyperspherical_descent": Method(
    "cola.hyperspherical_descent (whole-matrix sphere)",
    (0.05, 0.1, 0.2),
    lambda lr, s: cola.hyperspherical_descent(s),
    SPHERE,
  ),
  "adamw": Method(
    "optax.adamw (weight decay 0)", (1e-3, 3e-3, 1e-2), lambda lr, s: optax.adamw(s, weight_decay=0.0), None
  ),
  "muon": Method("optax.contrib.muon", (0.03, 0.1, 0.3), lambda lr, s: optax.contrib.muon(s), None),
}
REFERENCE = {  # name: (the reference's rule, its default learning rate, label)
  "reference_manifold_muon": (
    "manifold_muon",
    0.1,
    "reference manifold Muon (msign = Polar Express in bf16, 100 dual steps)",
  ),
  "reference_hyperspherical_descent": ("hyperspherical_descent", 0.1, "reference hyperspherical descent"),
  "reference_adamw": ("adamw", 1e-3, "reference AdamW (torch, weight decay 0)"),
}
LABELS = {**{k: v[2] for k, v in REFERENCE.items()}, **{k: m.label for k, m in METHODS.items()}}


def run_cola(args, path: str, names: list[str], validation, final) -> None:
  """Per method: the learning rate of the best validation accuracy (seed 0; a grid of one value is not
  trained), its step trace, then every seed on the final split."""
  for name in names:
    method = METHODS[name]
    grid = args.grid.get(name, method.grid[len(method.grid) // 2 :][:1] if args.smoke else method.grid)
    scores = {}
    if len(grid) > 1:
      for lr in grid:
        scores[lr] = train(method, lr, validation, [0], args.epochs)["test_accuracy"][0]
        print(f"{name:24s} lr {lr:g}: validation accuracy {100 * scores[lr]:.2f} %", flush=True)
    lr = max(grid, key=lambda v: scores.get(v, 0.0))
    trace = step_trace(method, lr, final, args.epochs, 8 if args.smoke else 60)
    out = train(method, lr, final, list(range(args.seeds)), args.epochs)
    rows = [
      {"method": name, "lr": lr, "seed": s, "test_accuracy": a, "residual": r, "ms_per_step": trace["ms_per_step"]}
      for s, (a, r) in enumerate(zip(out["test_accuracy"], out["residual"]))
    ]
    mean, std = mean_std(out["test_accuracy"])
    worst = max((r for r in out["residual"] if r is not None), default=float("nan"))
    print(
      f"{name:24s} lr {lr:g}: test {100 * mean:.2f} +- {100 * std:.2f} %, {trace['ms_per_step']:.1f} ms/step, "
      f"residual {worst:.1e}{', dual: ' + str(trace['dual']) if 'dual' in trace else ''}",
      flush=True,
    )
    grid_entry = {"validation_accuracy": {str(k): v for k, v in scores.items()}, "chosen_lr": lr}
    cost = {"compile_s": out["compile_s"], "run_s": out["run_s"], "timed_steps": trace["timed_steps"]}
    fields = dict(grid=grid_entry, cost=cost, **({"dual": trace["dual"]} if "dual" in trace else {}))
    merge(path, LABELS, lambda r: replace_runs(r, name, rows, **fields))


def retime(args, path: str, names: list[str], ref_names: list[str], final) -> None:
  """ms/step again, one method after another in this process (the same conditions for all): the step trace
  of every cola/optax method with runs in the JSON, at its learning rate, and the reference's rules over
  their first steps of seed 0 (30 for manifold Muon, 100 for the others)."""
  with open(path) as f:
    runs = json.load(f)["runs"]
  lrs = {r["method"]: r["lr"] for r in runs if r["method"] in names}
  traces = {n: step_trace(METHODS[n], lrs[n], final, args.epochs, 60) for n in names if n in lrs}
  if ref_names:
    rules = reference.load_rules(args.reference)
    data = (final.x_train, final.y_train, final.x_test, final.y_test)
    kernels = [np.asarray(w) for w in init_params(seed_keys(0)[0]).values()]
    orders = batch_orders(0, len(final.x_train), args.epochs)
    for n in ref_names:
      rule, lr, _ = REFERENCE[n]
      steps = 30 if rule == "manifold_muon" else 100
      out = reference.train(rules, rule, lr, kernels, data, orders, BATCH, max_steps=steps)
      traces[n] = {"ms_per_step": out["ms_per_step"], "timed_steps": steps}
  for n, trace in traces.items():
    print(f"{n:32s}: {trace['ms_per_step']:.1f} ms/step", flush=True)

  def update(r):
    for row in r["runs"]:
      if row["method"] in traces:
        if row["method"] in REFERENCE:  # the median over its whole run, under that run's load
          row.setdefault("ms_per_step_whole_run", row["ms_per_step"])
        row["ms_per_step"] = traces[row["method"]]["ms_per_step"]
    for n, trace in traces.items():
      r.setdefault("cost", {}).setdefault(n, {})["timed_steps"] = trace["timed_steps"]
      if "dual" in trace:
        r.setdefault("dual", {})[n] = trace["dual"]
    r["timing"] = {"retimed": sorted(traces), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

  merge(path, LABELS, update)


def speed(args, path: str, names: list[str], final) -> None:
  """ms/step of ``names`` interleaved: after two warm-up steps each (the first compiles), ``--speed-steps``
  rounds, each one step of every method on the same batch; the medians, and each one's ratio to
  ``muon_on_manifold``'s (``cola.constrained(optax.contrib.muon)``) when it is among them."""
  with open(path) as f:
    lrs = {r["method"]: r["lr"] for r in json.load(f)["runs"]}
  steppers = {n: timed_steps(METHODS[n], lrs.get(n, 0.1), final, args.epochs) for n in names}
  order = batch_orders(0, len(final.x_train), args.epochs)[0]
  batches = [jnp.asarray(order[b * BATCH : (b + 1) * BATCH]) for b in range(args.speed_steps + 2)]
  times = {n: [] for n in names}
  for b, idx in enumerate(batches):
    for n, stepper in steppers.items():
      t = stepper(idx)
      if b >= 2:
        times[n].append(1e3 * t)
  medians = {n: float(np.median(t)) for n, t in times.items()}
  base = medians.get("muon_on_manifold")
  entry = {
    "what": f"median ms of one jitted step (gradient, update, apply), {args.speed_steps} steps each after two "
    "warm-up steps, the methods interleaved step by step in one process, seed 0 from its initial weights",
    "lr": {n: lrs.get(n, 0.1) for n in names},
    "ms_per_step": medians,
    "ms_each_step": times,
    "ratio_to_muon_on_manifold": {n: m / base for n, m in medians.items()} if base else None,
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
  for n, m in medians.items():
    print(f"{n:24s}: {m:.1f} ms/step" + (f", {m / base:.2f} x muon_on_manifold" if base else ""), flush=True)
  merge(path, LABELS, lambda r: r.update(speed=entry))


def run_reference(args, path: str, names: list[str], final) -> None:
  """The reference's rules at their default learning rates, seed after seed (each merged as it ends)."""
  rules = reference.load_rules(args.reference)
  data = (final.x_train, final.y_train, final.x_test, final.y_test)
  for name in names:
    rule, lr, _ = REFERENCE[name]
    rows = []
    for seed in range(args.manifold_muon_seeds if rule == "manifold_muon" else args.seeds):
      kernels = [np.asarray(w) for w in init_params(seed_keys(seed)[0]).values()]
      orders = batch_orders(seed, len(final.x_train), args.epochs)
      out = reference.train(rules, rule, lr, kernels, data, orders, BATCH, max_steps=3 if args.smoke else None)
      rows.append({"method": name, "lr": lr, "seed": seed, **out})
      print(f"{name:32s} seed {seed}: test {100 * out['test_accuracy']:.2f} %, {out['ms_per_step']:.1f} ms/step")
      merge(path, LABELS, lambda r: replace_runs(r, name, list(rows)))


def cpu_model() -> str | None:
  try:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
  except (OSError, subprocess.CalledProcessError):
    return None
  return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), None)


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(
    description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument(
    "--methods",
    default=None,
    help="comma list of method names, 'cola' (every cola/optax method), 'reference' or 'all'; "
    "default 'cola' ('manifold_muon' with --smoke)",
  )
  p.add_argument("--seeds", type=int, default=5)
  p.add_argument("--epochs", type=int, default=5)
  p.add_argument("--reference", default=None, help="the reference's src/ directory (needs torch)")
  p.add_argument("--manifold-muon-seeds", type=int, default=3, help="seeds of the reference manifold Muon (slow)")
  p.add_argument("--data-dir", default=None, help="the Fashion-MNIST IDX files' folder")
  p.add_argument("--out", default=None, help="output folder; default results/comparisons (--smoke: a temporary one)")
  p.add_argument(
    "--grid",
    action="append",
    default=[],
    metavar="NAME=LR,LR",
    help="another learning-rate grid for a method (one value: no validation runs); repeatable",
  )
  p.add_argument(
    "--retime",
    action="store_true",
    help="only re-measure ms/step of the methods' runs in the JSON, at their learning rates, in this one process",
  )
  p.add_argument(
    "--speed",
    action="store_true",
    help="only the interleaved speed check of the methods (default: manifold_muon and muon_on_manifold)",
  )
  p.add_argument("--speed-steps", type=int, default=12, help="timed steps per method of --speed")
  p.add_argument("--fresh", action="store_true", help="start a new results JSON instead of merging into it")
  p.add_argument("--smoke", action="store_true", help="a few steps of one method (and of the reference's): seconds")
  args = p.parse_args(argv)
  try:
    pairs = (g.partition("=") for g in args.grid)
    args.grid = {k.strip(): tuple(float(v) for v in lrs.split(",")) for k, _, lrs in pairs}
  except ValueError:
    p.error("--grid takes NAME=LR,LR,...")
  started = time.perf_counter()
  if args.smoke:
    # Two seeds of cola's methods: the vmapped training loop over seeds runs (it once deadlocked manifold_muon).
    args.epochs, args.seeds, args.manifold_muon_seeds = 1, 2, 1
  out = args.out or (tempfile.mkdtemp(prefix="muon-") if args.smoke else os.path.join("results", "comparisons"))
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "muon.json")
  if args.fresh and os.path.exists(path):
    os.remove(path)

  requested = args.methods or (
    "manifold_muon" if args.smoke else "manifold_muon,muon_on_manifold" if args.speed else "cola"
  )
  expand = {"cola": list(METHODS), "reference": list(REFERENCE), "all": [*METHODS, *REFERENCE]}
  names = list(dict.fromkeys(n for w in requested.split(",") if w.strip() for n in expand.get(w.strip(), [w.strip()])))
  unknown = [n for n in names if n not in LABELS]
  if unknown:
    p.error(f"unknown methods {unknown}; choose from {', '.join(LABELS)}")
  cola_names = [n for n in names if n in METHODS]
  ref_names = [n for n in names if n in REFERENCE]
  skipped = {}
  if ref_names and (args.reference is None or not reference.torch_available()):
    why = "no --reference DIR given" if args.reference is None else "torch is not installed"
    skipped = dict.fromkeys(ref_names, why)
    ref_names = []
  if args.smoke and not cola_names:
    cola_names = ["muon_on_manifold"]

  validation, final = load_data(args.data_dir, args.smoke)
  config = {
    "widths": [784, 128, 64, 10],
    "batch_size": BATCH,
    "epochs": args.epochs,
    "seeds": args.seeds,
    "smoke": args.smoke,
    "schedule": "lr * (1 - step / steps), steps = epochs * ceil(n_train / batch)",
    "lr_selection": "each cola/optax method: the best validation accuracy over its grid, seed 0, trained on the "
    "training images but the last twelfth, validated on that twelfth; then every seed on all training images",
    "ms_per_step": "cola/optax: median over the steps of seed 0's first epoch, one jitted step (gradient, update, "
    "apply), every method in the same process; reference: median over each run's steps (torch, one thread)",
    "machine_shared": "2 cores shared with other jobs (other workers' runs), run under nice and taskset",
  }
  meta = provenance(argv, started, packages=("jaxlib", "flax"))
  if reference.torch_available():
    meta["versions"]["torch"] = __import__("torch").__version__
  meta["machine"]["lscpu_model_name"] = cpu_model()
  invocation = {"methods": cola_names + ref_names, "skipped": skipped, **meta}
  merge(
    path,
    LABELS,
    lambda r: (
      r.setdefault("invocations", []).append(invocation),
      r.update(config=config, data={"validation": validation.info, "final": final.info}),
    ),
  )
  for n, why in skipped.items():
    print(f"skipped {n}: {why}")
  if args.speed:
    speed(args, path, cola_names, final)
  elif args.retime:
    retime(args, path, cola_names, ref_names, final)
  else:
    run_cola(args, path, cola_names, validation, final)
    if ref_names:
      run_reference(args, path, ref_names, final)
  wall = time.perf_counter() - started
  mine = lambda r: next(i for i in reversed(r["invocations"]) if i["date"] == meta["date"] and i["argv"] == argv)
  results = merge(path, LABELS, lambda r: mine(r).update(wall_time_s=wall))
  plot(os.path.join(out, "muon.png"), results, LABELS)
  print(table(results, LABELS))
  print(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
