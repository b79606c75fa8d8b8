#!/usr/bin/env python
"""Step overhead of the four CoLA methods against plain SGD and SGD with momentum.

For each model and method this measures, in one process and interleaved with
its baseline:

* ``update``: the optimizer alone, ``tx.update`` + ``optax.apply_updates`` under
  one ``jit`` with fixed gradients;
* ``step``: the full training step, loss + gradient + update + apply, jitted.

Overdamped methods (``c_cola_od``, ``o_cola_od``) are compared with
``optax.sgd(h)``; underdamped ones (``c_cola_ud``, ``o_cola_ud``) with the
SGD-momentum they reduce to without constraints and noise,
``optax.sgd(h**2, momentum=exp(-gamma h))``. Each is measured at temperature 0
(no noise drawn) and at ``tau > 0`` (noise drawn every step). The per-unit
general constraint (``i_cola_od``, ``i_cola_ud``) puts every kernel under
``cola.Implicit(equality=..., axis=0)`` with two components per column (its
entries sum to zero, its norm is 1, about the norm of the initial columns);
its baseline is the same method with ``cola.MaxNorm(1.0)`` on the same kernels
(the closed-form per-unit geometry, at the same temperature and key), so its
ratio is Implicit's time over MaxNorm's. The reported ratio is the median time of the
method over the median time of its baseline, both over the same interleaved
repetitions after warm-up. Also reported: the optimizer state size in bytes.

Models:

* ``mlp784``: 784-1000-10 ReLU MLP, batch 128, softmax cross-entropy (the
  paper's Fashion-MNIST model), circle radii 0.05 (hidden) and 0.1 (output).
* ``spiral8x100``: 2 inputs, 8 hidden layers of 100 ReLU units, 1 output,
  batch 25, binary cross-entropy (the paper's spiral model).

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.step_overhead          # full run
  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.step_overhead --smoke  # seconds
  python -m benchmarks.cost.step_overhead --skip-heavy                    # no o-CoLA on mlp784
  python -m benchmarks.cost.step_overhead --models mlp784 --methods i_cola_od i_cola_ud \
      --repetitions 30                              # per-unit Implicit / MaxNorm only

Writes ``step_overhead.json`` (after every measurement, so that an
interrupted run keeps what it measured; ``config.complete`` says whether it
finished) and ``step_overhead.png`` under ``--out``.

JSON keys: ``meta`` (command, argv, date, machine, versions), ``config``
(hyperparameters, repetitions), ``results`` (one record per model, method,
temperature and kind, with ``method_ms``, ``baseline_ms``, ``ratio``,
``ratio_of_paired``, the per-sample spread and, for ``update``, the
``array_passes``: arrays of the largest leaf's shape read and written by the
compiled update, method and baseline), ``state_bytes`` (per model:
per method and baseline), ``targets`` (the issue's performance targets with
``value``, ``limit`` and ``met``), ``projection_floor`` (two matrix products per square
kernel of the spiral MLP against SGD's whole step: ``layers``, ``shape``,
``products_ms``, ``sgd_step_ms``, ``ratio_bound``; see :func:`projection_floor`).
"""

import math
import os
import re
import sys
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.cost.step_overhead_models import METHODS, init_mlp, make_batch, make_loss, make_pair, models
from benchmarks.cost.step_overhead_report import plot, summarize, table, targets_from
from benchmarks.harness.records import provenance, write_json
from benchmarks.harness.timing import measure_pair, speed_output, speed_parser, started_run, tree_bytes

RESULT_KEYS = (
  "model",
  "method",
  "baseline",
  "temperature",
  "kind",
  "method_ms",
  "baseline_ms",
  "ratio",
  "ratio_of_paired",
  "method_iqr_ms",
  "baseline_iqr_ms",
  "repetitions",
)
TOP_KEYS = ("meta", "config", "results", "state_bytes", "targets", "projection_floor")
KINDS = ("update", "step")
# --smoke measures only what the targets name (model, method, tau > 0,
# kind): compiling is what takes the time there.
SMOKE_JOBS = (
  ("mlp784", "c_cola_ud", False, "update"),
  ("mlp784", "c_cola_ud", False, "step"),
  ("mlp784", "c_cola_ud", True, "step"),
  ("spiral8x100", "o_cola_od", False, "step"),
  ("mlp784", "i_cola_ud", False, "step"),
)


def build(kind: str, tx, loss_fn, params, grads, batch):
  """A jitted step function and its initial carry ``(params, opt_state)``."""
  if kind == "update":

    def fn(params, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  else:

    def fn(params, state):
      g = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

  return jax.jit(fn, donate_argnums=(0, 1)), (jax.tree.map(jnp.copy, params), tx.init(params))


def array_passes(fn, carry, shape) -> dict | None:
  """Arrays of ``shape``'s size read and written by the compiled ``fn``'s top-level loops.

  An elementwise update is memory-bound at this size, so these counts (for the
  largest leaf) explain its time independently of the machine. An array counts
  whatever its shape (a flattened copy is as much traffic). Parsed from XLA's
  HLO text; None if the format is not understood.
  """
  text = fn.lower(*carry).compile().as_text()
  if "ENTRY" not in text:
    return None
  entry = text[text.index("ENTRY") :].split("\n}", 1)[0]
  size = math.prod(shape)

  def arrays(type_text: str) -> int:
    dims = re.findall(r"\w+\[([\d,]*)\]", type_text)
    return sum(math.prod(int(d) for d in found.split(",") if d) == size for found in dims)

  types = dict(re.findall(r"%(\S+) = (\S+) ", entry))
  reads = writes = 0
  for _name, out, op, args in re.findall(r"%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*?)\)", entry):
    if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
      continue
    writes += arrays(out)
    reads += sum(arrays(types.get(arg, "")) for arg in re.findall(r"%([\w.\-]+)", args))
  return {"reads": reads, "writes": writes}


def measure(args, fns, carries):
  """:func:`harness.timing.measure_pair` with the command line's warm-up, repetitions and budget."""
  return measure_pair(fns, carries, args.warmup, args.repetitions, args.budget)


def projection_floor(params, batch, loss_fn, h: float, args) -> dict:
  """Two matrix products per square kernel against SGD's whole training step.

  A verified projection onto the Stiefel manifold needs at least the Gram
  matrix of the moved kernel and one correction product per layer; their time
  alone bounds the o-CoLA-od / SGD step ratio from below on a machine where
  products run at their flop rate.
  """
  sgd_step, sgd_carry = build("step", optax.sgd(h), loss_fn, params, None, batch)
  # Orthogonal kernels: w (w^T w) = w, so the timed carry neither grows nor decays.
  squares = [
    jnp.linalg.qr(layer["kernel"])[0]
    for layer in params.values()
    if layer["kernel"].shape[0] == layer["kernel"].shape[1]
  ]

  @jax.jit
  def two_products(kernels):
    return [w @ (w.T @ w) for w in kernels]

  t_p, t_b = measure(args, (lambda *kernels: tuple(two_products(kernels)), sgd_step), (tuple(squares), sgd_carry))
  products_ms, sgd_ms = 1e3 * float(np.median(t_p)), 1e3 * float(np.median(t_b))
  return {
    "layers": len(squares),
    "shape": list(squares[0].shape) if squares else None,
    "products_ms": products_ms,
    "sgd_step_ms": sgd_ms,
    "ratio_bound": (sgd_ms + products_ms) / sgd_ms,
    "repetitions": len(t_p),
  }


def parse_args(argv=None):
  p = speed_parser(
    __doc__, "tiny models and a few repetitions: a check that runs in seconds", repetitions=300, budget_s=20.0
  )
  p.add_argument("--models", nargs="+", default=["mlp784", "spiral8x100"], choices=["mlp784", "spiral8x100"])
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument(
    "--skip-heavy", action="store_true", help="skip o-CoLA on mlp784 (quasi-Newton on a 784x1000 matrix, slow)"
  )
  p.add_argument("--temperature", type=float, default=1e-6, help="the tau > 0 setting")
  p.add_argument("--warmup", type=int, default=10)
  p.add_argument("--h-c-od", type=float, default=0.1)
  p.add_argument("--h-c-ud", type=float, default=0.3)
  p.add_argument("--h-o-od", type=float, default=0.1)
  p.add_argument("--h-o-ud", type=float, default=0.3)
  p.add_argument("--friction", type=float, default=1.0)
  p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  argv, args, start = started_run(parse_args, argv)
  if args.smoke:
    args.repetitions = min(args.repetitions, 5)
    args.warmup = min(args.warmup, 1)
  args.out = speed_output(args, "step_overhead")
  temperatures = [0.0, args.temperature]

  jobs = []
  for model in models(args.smoke):
    if model.name not in args.models:
      continue
    for method in args.methods:
      if args.skip_heavy and model.name == "mlp784" and method.startswith("o_"):
        continue
      for temperature in temperatures:
        for kind in KINDS:
          if args.smoke and (model.name, method, temperature > 0, kind) not in SMOKE_JOBS:
            continue
          jobs.append((model, method, temperature, kind))

  try:
    if args.no_progress:
      raise ImportError
    from tqdm import tqdm

    progress = tqdm(total=len(jobs), desc="step overhead", file=sys.stderr)
  except ImportError:
    progress = None

  config = {
    "smoke": args.smoke,
    "repetitions": args.repetitions,
    "warmup": args.warmup,
    "budget_s": args.budget,
    "temperatures": temperatures,
    "models": {
      m.name: {"sizes": list(m.sizes), "batch": m.batch, "loss": m.loss, "radius": m.radius} for m in models(args.smoke)
    },
    "methods": args.methods,
    "skip_heavy": args.skip_heavy,
    "timing": "median over interleaved repetitions after warm-up; jit with donated "
    "params and state; jax.block_until_ready after every call",
  }
  json_path = os.path.join(args.out, "step_overhead.json")
  results, state_bytes = [], {}

  def written(products=None, complete=False) -> dict:
    """The report so far, written to ``step_overhead.json``: an interrupted run keeps what it measured."""
    report = {
      "meta": provenance(argv, start),
      "config": {**config, "complete": complete},
      "results": results,
      "state_bytes": state_bytes,
      "targets": targets_from(results),
      "projection_floor": products,
    }
    write_json(json_path, report)
    return report

  key = jax.random.key(args.seed)
  cache: dict[str, Any] = {}
  baselines: dict[tuple, Any] = {}
  for model, method, temperature, kind in jobs:
    if model.name not in cache:
      kp, kb, kg = jax.random.split(jax.random.fold_in(key, len(cache)), 3)
      params = init_mlp(kp, model.sizes)
      batch = make_batch(model, kb)
      loss_fn = make_loss(model)
      grads = jax.grad(loss_fn)(params, batch)
      cache[model.name] = (params, batch, loss_fn, grads)
    params, batch, loss_fn, grads = cache[model.name]
    tx, base_tx, base_name, hyper = make_pair(method, model, args, temperature)
    if temperature == 0:
      state_bytes.setdefault(model.name, {})[method] = {
        "method": tree_bytes(tx.init(params)),
        "baseline": tree_bytes(base_tx.init(params)),
        "baseline_name": base_name,
        "params": tree_bytes(params),
      }
    f_m, c_m = build(kind, tx, loss_fn, params, grads, batch)
    base_key = (model.name, base_name, kind)
    if base_key not in baselines:  # one compiled baseline serves several methods
      baselines[base_key] = build(kind, base_tx, loss_fn, params, grads, batch)[0]
    f_b = baselines[base_key]
    c_b = (jax.tree.map(jnp.copy, params), base_tx.init(params))
    t_m, t_b = measure(args, (f_m, f_b), (c_m, c_b))
    record = summarize(model.name, method, base_name, temperature, kind, t_m, t_b)
    record["hyperparameters"] = hyper
    if kind == "update":
      largest = max(jax.tree.leaves(params), key=lambda leaf: leaf.size).shape
      record["array_passes"] = {
        "shape": list(largest),
        "method": array_passes(f_m, c_m, largest),
        "baseline": array_passes(f_b, c_b, largest),
      }
    results.append(record)
    written()
    if progress is not None:
      progress.set_postfix_str(f"{model.name} {method} tau={temperature:g} {kind}: {record['ratio']:.2f}x")
      progress.update()
  if progress is not None:
    progress.close()

  products = None
  if "spiral8x100" in cache and "o_cola_od" in args.methods:
    params, batch, loss_fn, _ = cache["spiral8x100"]
    products = projection_floor(params, batch, loss_fn, args.h_o_od, args)

  report = written(products, complete=True)
  targets = report["targets"]
  plot(results, os.path.join(args.out, "step_overhead.png"))
  print(table(results, state_bytes, targets))
  if products is not None:
    print(
      f"two products per square kernel ({products['layers']} x {products['shape']}): "
      f"{products['products_ms']:.3f} ms, SGD's whole step {products['sgd_step_ms']:.3f} ms: "
      f"o-CoLA-od / SGD >= {products['ratio_bound']:.2f}"
    )
  print(f"\nwrote {json_path} and {os.path.join(args.out, 'step_overhead.png')}")
  return report


if __name__ == "__main__":
  main()
