r"""Cost of the Stiefel retractions, alone and in the LSTM seq2seq step of Flax's addition example.

Part 1, the retractions. ``M = Q + xi`` with ``Q`` orthonormal and ``xi`` tangent at ``Q``, ``|xi|_2 =
--step-norm`` (0.05: Adam's first steps of 1e-3 per entry on a 512 x 512 kernel have about
``2e-3 sqrt(512) = 0.045``), for each shape of ``--shapes`` and input dtype (float32, bfloat16). Methods,
the public functions of ``cola_jax.constraints.stiefel_retraction``, and the matrix sign of Muon:

* ``polar``: ``polar_of_tangent_step``, the ``s x s`` eigendecomposition of ``M^T M`` (the baseline);
* ``newton_schulz``: ``newton_schulz_polar``, degree-5 Newton-Schulz to ``max(1e-6, 2 sqrt(r) eps)``;
* ``qr``: ``qr_retraction``, Householder QR with the sign fix, then the check ``Q^T Q``;
* ``matrix_sign``: ``benchmarks.cost.polar_express.matrix_sign`` (8 Polar Express steps), for reference: it
  does not use ``sigma >= 1`` and computes in the input's dtype; only up to 512 x 512 entries (seconds per call beyond).

Each is compiled once (``compile_s``, XLA's ``memory_analysis()`` temp bytes) and timed after warm-up,
the methods of a shape and dtype interleaved (one call of each per round, the order rotated): the median
of ``--repetitions`` rounds (``ms``) and its ratio to ``polar``. The
retractions compute in float32 for bfloat16 input (a bfloat16 point is ``2^-9`` off the manifold).
Every record carries the result's ``max |Q^T Q - I|`` (float32), and the iterations and flag where
there are some.

Part 2, the seq2seq step (``benchmarks.cost.seq2seq``: hidden 512, batch 128, 3-digit addition,
eight 512 x 512 hidden kernels Orthogonal): the jitted training step (loss, gradient, update) and the
optimizer's update alone, each method against its baseline, interleaved in the same process:
``constrained(optax.adam(1e-3), Orthogonal(retraction=r))`` for every ``r`` and with
``retraction="projection"`` against ``optax.adam(1e-3)``; ``o_cola_ud(1e-2, momentum=0.9)`` against
``optax.sgd(1e-2, momentum=0.9)``. Target (issue 39): the constrained Adam step within 1.5 x Adam's
with the default retraction.

The machine is shared: times are medians and every ratio is of two runs interleaved in one process;
the load average at the start and the end is recorded.

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.retractions
  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.retractions --smoke

Writes ``retractions.json`` (part 1) and ``seq2seq.json`` (part 2) under ``--out`` (default results/cost/).
"""

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.cost import polar_express, seq2seq
from benchmarks.harness import records, timing
from cola_jax.constraints import stiefel_retraction as sr

METHODS = {
  "polar": sr.polar_of_tangent_step,
  "newton_schulz": lambda m: sr.newton_schulz_polar(m),
  "qr": lambda m: sr.qr_retraction(m),
  "matrix_sign": polar_express.matrix_sign,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
RETRACTIONS = ("newton_schulz", "qr", "polar")
DEFAULT_RETRACTION = cola.Orthogonal().retraction
RATIO_LIMIT = 1.5
SIGN_MAX_ENTRIES = 512 * 512  # matrix_sign (8 steps of r s^2 products, bfloat16 emulated on CPU) up to this size


def tangent_start(shape, step_norm, seed=0):
  """``Q + xi``: ``Q`` orthonormal ``(r, s)``, ``xi`` tangent at ``Q`` with ``|xi|_2 = step_norm``."""
  key_q, key_xi = jax.random.split(jax.random.key(seed))
  q, _ = jnp.linalg.qr(jax.random.normal(key_q, shape))
  xi = jax.random.normal(key_xi, shape)
  sym = jnp.matmul(q.T, xi, precision="highest")
  xi = xi - 0.5 * jnp.matmul(q, sym + sym.T, precision="highest")
  return q + xi * (step_norm / jnp.linalg.norm(xi, 2))


def _outcome(method, out) -> dict:
  """The point's ``max |Q^T Q - I|`` in float32, and the method's iterations and flag."""
  iterations = converged = None
  if method == "newton_schulz":
    out, iterations, converged = out
  elif method == "qr":
    out, converged = out
  tall = out.astype(jnp.float32)
  tall = tall if tall.shape[0] >= tall.shape[1] else tall.T
  return {
    "residual": float(sr.max_abs(sr.gram_defect(tall))),
    "iterations": None if iterations is None else int(iterations),
    "converged": None if converged is None else bool(converged),
  }


def interleaved(calls: dict, repetitions: int, budget_s: float) -> dict:
  """``{name: seconds per call}``: the median over rounds in which each call runs once, in rotated order (on a
  shared machine every method then sees the same load), after one warm-up round; at least 3 rounds."""
  names = list(calls)
  for name in names:
    jax.block_until_ready(calls[name]())
  samples = {name: [] for name in names}
  start = time.perf_counter()
  for round_ in range(repetitions):
    for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(calls[name]())
      samples[name].append(time.perf_counter() - t0)
    if round_ >= 2 and time.perf_counter() - start > budget_s:
      break
  return {name: (float(np.median(t)), len(t)) for name, t in samples.items()}


def measure_retractions(shapes, step_norm, repetitions, budget_s, seed) -> list[dict]:
  rows = []
  for shape in shapes:
    start = tangent_start(shape, step_norm, seed)
    for dtype_name, dtype in DTYPES.items():
      m = start.astype(dtype)
      methods = {k: f for k, f in METHODS.items() if k != "matrix_sign" or shape[0] * shape[1] <= SIGN_MAX_ENTRIES}
      compiled, costs = {}, {}
      for method, fn in methods.items():
        compiled[method], costs[method] = timing.compile_cost(jax.jit(fn), m)
      times = interleaved({k: functools.partial(c, m) for k, c in compiled.items()}, repetitions, budget_s)
      for method, (seconds, calls) in times.items():
        cost = costs[method]
        row = {"shape": list(shape), "dtype": dtype_name, "method": method, "ms": seconds * 1e3, "calls": calls}
        row |= {"ratio_to_polar": seconds / times["polar"][0], "compile_s": cost["compile_s"]}
        row |= {"temp_bytes": cost["temp_bytes"]} | _outcome(method, compiled[method](m))
        rows.append(row)
        print(
          f"{shape[0]:>5}x{shape[1]:<5} {dtype_name:8} {method:13} {row['ms']:9.2f} ms  x{row['ratio_to_polar']:.2f}"
          f"  compile {cost['compile_s']:.2f} s  temp {cost['temp_bytes']}  residual {row['residual']:.1e}"
          f"  iterations {row['iterations']}  converged {row['converged']}",
          flush=True,
        )
  return rows


def _constraints(retraction):
  return cola.path_constraints([(seq2seq.HIDDEN_KERNELS, cola.Orthogonal(retraction=retraction))])


def seq2seq_methods(lr_adam, lr_sgd) -> dict:
  """``{name: (method, baseline, baseline name)}`` of optax transformations."""
  adam, sgd = optax.adam(lr_adam), optax.sgd(lr_sgd, momentum=0.9)
  methods = {
    f"constrained_adam/{r}": (cola.constrained(adam, constraints=_constraints(r)), adam, "adam") for r in RETRACTIONS
  }
  methods["constrained_adam/projection"] = (
    cola.constrained(adam, constraints=_constraints(DEFAULT_RETRACTION), retraction="projection"),
    adam,
    "adam",
  )
  methods["o_cola_ud"] = (
    cola.o_cola_ud(lr_sgd, momentum=0.9, constraints=_constraints(DEFAULT_RETRACTION)),
    sgd,
    "sgd_momentum",
  )
  return methods


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def measure_seq2seq(hidden, batch, digits, repetitions, budget_s, lr_adam=1e-3, lr_sgd=1e-2) -> list[dict]:
  model, params, data = seq2seq.model_and_params(hidden, batch, digits)
  grads = jax.grad(lambda p: seq2seq.loss_fn(model, p, data))(params)
  rows = []
  for name, (tx, baseline, baseline_name) in seq2seq_methods(lr_adam, lr_sgd).items():
    for kind in ("step", "update"):
      fns, carries = [], []
      for t in (tx, baseline):
        if kind == "step":
          step = seq2seq.training_step(model, t)
          fns.append(lambda p, s, b, step=step: (*step(p, s, b)[:2], b))
          carries.append((_copy(params), t.init(params), data))
        else:
          update = seq2seq.update_only(t)
          fns.append(lambda p, s, g, update=update: (*update(p, s, g), g))
          carries.append((_copy(params), t.init(params), grads))
      t_method, t_baseline = timing.measure_pair(fns, carries, 2, repetitions, budget_s)
      row = {"method": name, "baseline": baseline_name, "kind": kind} | timing.pair_summary(t_method, t_baseline)
      rows.append(row)
      print(
        f"{kind:6} {name:30} {row['method_ms']:8.1f} ms  {baseline_name:12} {row['baseline_ms']:8.1f} ms"
        f"  ratio {row['ratio']:.2f} (paired {row['ratio_of_paired']:.2f}, {row['repetitions']} reps)",
        flush=True,
      )
  return rows


def product_floor(kernels, grads):
  """The seven ``s x s x s`` products a verified step of any Riemannian Adam makes per square kernel ``W``: the
  gradient's tangent projection (``W^T g``, ``W sym``), the update's (two more), and a retraction by matrix
  products alone (``M^T M``, ``M p(M^T M)``, the check ``X^T X``), here with the update = the gradient."""
  outs = []
  for w, g in zip(kernels, grads):
    for _ in range(2):
      sym = jnp.matmul(w.T, g, precision="highest")
      g = g - 0.5 * jnp.matmul(w, sym + sym.T, precision="highest")
    m = w - 1e-3 * g
    x = jnp.matmul(m, 1.5 * jnp.eye(m.shape[1]) - 0.5 * jnp.matmul(m.T, m, precision="highest"), precision="highest")
    outs.append(jnp.matmul(x.T, x, precision="highest"))
  return outs


def measure_floor(hidden, batch, digits, repetitions, budget_s) -> dict:
  """The Adam step against the Adam step followed by ``product_floor`` on the hidden kernels, interleaved:
  the ratio a constrained Adam step cannot go below while it makes those products."""
  model, params, data = seq2seq.model_and_params(hidden, batch, digits)
  adam = optax.adam(1e-3)
  step = seq2seq.training_step(model, adam)
  floor = jax.jit(product_floor)
  kernels = seq2seq.hidden_kernels(params)

  def plain(p, s, b):
    return *step(p, s, b)[:2], b

  def with_floor(p, s, b):  # one after the other: the two programs must not share the cores
    p, s, _ = jax.block_until_ready(step(p, s, b))
    jax.block_until_ready(floor(kernels, kernels))
    return p, s, b

  carries = [(_copy(params), adam.init(params), data) for _ in range(2)]
  t_floor, t_adam = timing.measure_pair([with_floor, plain], carries, 2, repetitions, budget_s)
  summary = timing.pair_summary(t_floor, t_adam)
  print(f"floor: adam step + {len(kernels)} kernels x 7 products: ratio {summary['ratio']:.2f}", flush=True)
  return {"kernels": len(kernels), "products_per_kernel": 7} | summary


def residual_after_steps(hidden, batch, digits, steps) -> dict:
  """``max |W^T W - I|`` over the hidden kernels after ``steps`` constrained-Adam steps, per retraction."""
  out = {}
  for r in RETRACTIONS:
    model, params, data = seq2seq.model_and_params(hidden, batch, digits)
    tx = cola.constrained(optax.adam(1e-3), constraints=_constraints(r))
    step, state = seq2seq.training_step(model, tx), tx.init(params)
    for _ in range(steps):
      params, state, _ = step(params, state, data)
    residuals = cola.constraint_residuals(params, state)
    out[r] = max(float(v) for v in jax.tree.leaves(residuals))
  return out


def main(argv=None) -> dict:
  p = timing.speed_parser(__doc__, "tiny sizes, 3 repetitions: checks that everything runs", repetitions=15, budget_s=8)
  p.add_argument("--shapes", default="512x512,1024x256,4096x1024", help="retraction shapes r x s")
  p.add_argument("--step-norm", type=float, default=0.05, help="|xi|_2 of the tangent step")
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--batch", type=int, default=128)
  argv, args, started = timing.started_run(p.parse_args, argv)
  shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
  hidden, batch, repetitions = args.hidden, args.batch, args.repetitions
  if args.smoke:
    shapes, hidden, batch, repetitions = [(16, 16), (24, 8)], 16, 8, 3
  out = timing.speed_output(args, "retractions")
  config = {"smoke": args.smoke, "shapes": shapes, "step_norm": args.step_norm, "repetitions": repetitions}
  config |= {"budget_s": args.budget, "seed": args.seed, "default_retraction": DEFAULT_RETRACTION}
  load = {"at_start": os.getloadavg()}

  rows = measure_retractions(shapes, args.step_norm, repetitions, args.budget, args.seed)
  load["at_end"] = os.getloadavg()
  records.write_report(out, "retractions.json", argv, started, config, results=rows, load=load)

  started = time.perf_counter()
  config = {"smoke": args.smoke, "hidden": hidden, "batch": batch, "digits": 3, "repetitions": repetitions}
  config |= {"budget_s": args.budget, "default_retraction": DEFAULT_RETRACTION, "lr_adam": 1e-3, "lr_sgd": 1e-2}
  load = {"at_start": os.getloadavg()}
  steps = measure_seq2seq(hidden, batch, 3, repetitions, args.budget)
  floor = measure_floor(hidden, batch, 3, repetitions, args.budget)
  trained = 5 if args.smoke else 20
  config["residual_steps"] = trained
  residuals = residual_after_steps(hidden, batch, 3, trained)
  default = next(r for r in steps if r["method"] == f"constrained_adam/{DEFAULT_RETRACTION}" and r["kind"] == "step")
  targets = [
    {
      "name": f"constrained(adam, Orthogonal(retraction={DEFAULT_RETRACTION!r})) step / adam step",
      "value": default["ratio"],
      "limit": RATIO_LIMIT,
      "met": default["ratio"] <= RATIO_LIMIT,
    }
  ]
  print("\n".join(timing.target_lines(targets)))
  body = {"results": steps, "product_floor": floor, "residual_after_steps": residuals, "targets": targets}
  load["at_end"] = os.getloadavg()
  report = records.write_report(out, "seq2seq.json", argv, started, config, **body, load=load)
  return {"retractions": rows, "seq2seq": report}


if __name__ == "__main__":
  main()
