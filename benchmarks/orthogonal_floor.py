#!/usr/bin/env python
"""The floor of o-CoLA's step on a deep model: what the products of a verified Stiefel projection cost.

A projection onto the Stiefel manifold along the normal space at ``Q_n`` that
checks its own result needs, per kernel of tall shape ``(r, s)``, at least
three products of ``r s^2`` multiply-adds: the step's defect ``Qbar^T Qbar``
(the multiplier depends on it), the correction ``Q_n Lambda`` and the result's
check ``Q^T Q`` (one quasi-Newton iteration, verified); ``Orthogonal`` adds the
anchor's check ``Q_n^T Q_n`` (four). CoLA-ud's OBA step adds two projections
onto the cotangent space, ``V - Q sym(Q^T V)``: the kick's at ``Q_n`` and the
momentum's at the new point (eight). This script times, on the transformer LM
of ``benchmarks/scale.py`` at its realistic batch, SGD-m's training step with
``k`` such products per constrained kernel appended to its update (a chain:
``M = Q^T X``, then ``X <- X - Q M / 1000``, and so on, every product feeding
the next), interleaved with SGD-m's own step, and o-CoLA's steps beside them.

Usage::

  OPENBLAS_NUM_THREADS=1 python benchmarks/orthogonal_floor.py         # depth 12, width 512, 8 x 128 tokens: 15 min
  python benchmarks/orthogonal_floor.py --smoke                        # seconds, a tiny model, a temporary folder

Writes ``orthogonal_floor.json`` under ``--out``. JSON keys: ``meta``,
``config``, ``kernel_flops`` (multiply-adds of one product on every
constrained kernel), ``results`` (one record per row: ``name``, ``products``
(None for o-CoLA), ``temperature``, ``compile_cpu_s``, ``method_ms``,
``baseline_ms`` (SGD-m), ``ratio`` and the rest of the timing summary; o-CoLA's
rows also ``projection_iterations``, the fewest and the most solver iterations
of a kernel's projection at the fifth step).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax

import cola_jax as cola
from cola_jax.constraints.orthogonal import ProjectionInfo, from_tall_view, tall_view
from cola_jax.constraints.stiefel_projection import gram

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
import scale
from _common import provenance, write_json
from harness import report
from harness.timing import compile_cost, measure_pair, pair_summary, speed_parser

KERNEL = r"^(layers|block_\d+)/.*/kernel$"
ITERATION_STEPS = 5  # the projections' iterations are read after this many steps from the start
COLA_ROWS = (("od", 0.0), ("ud", 0.0), ("od", 1e-6), ("ud", 1e-6))


def with_products(count: int, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner``, then ``count`` chained ``r s^2`` products per constrained kernel of its update."""

  def chain(update, param):
    q, x = tall_view(param), tall_view(update)
    m = None
    for i in range(count):
      if i % 2 == 0:
        m = gram(q, x)
      else:
        x = x - 1e-3 * jnp.matmul(q, m, precision=jax.lax.Precision.HIGHEST)
    if count % 2:  # the last product's (s, s) result feeds the update too
      x = x * (1 + 1e-30 * jnp.trace(m))
    return from_tall_view(x, update)

  def update_fn(updates, state, params):
    updates, state = inner.update(updates, state, params)
    kernels = is_kernel(updates)
    new = [chain(u, p) if k else u for u, p, k in zip(jax.tree.leaves(updates), jax.tree.leaves(params), kernels)]
    return jax.tree.unflatten(jax.tree.structure(updates), new), state

  return optax.GradientTransformation(inner.init, update_fn)  # pyright: ignore[reportArgumentType]


def is_kernel(tree) -> list[bool]:
  """Per leaf of ``tree``: whether ``KERNEL`` matches its path (keys joined by ``/``)."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return [re.search(KERNEL, "/".join(str(getattr(k, "key", k)) for k in path)) is not None for path in paths]


def kernel_flops(params) -> int:
  """Multiply-adds of one ``r s^2`` product on every constrained kernel."""
  total = 0
  for leaf, kernel in zip(jax.tree.leaves(params), is_kernel(params)):
    if kernel:
      rows, columns = math.prod(leaf.shape[:-1]), leaf.shape[-1]
      total += max(rows, columns) * min(rows, columns) ** 2
  return total


def iterations_used(state) -> list[int]:
  """The fewest and the most solver iterations of the last step's projections (``ProjectionInfo.iterations``)."""
  counts = [
    int(info.iterations)
    for info in jax.tree.leaves(state.constraint_states, is_leaf=lambda x: isinstance(x, ProjectionInfo))
    if isinstance(info, ProjectionInfo)
  ]
  return [min(counts), max(counts)]


def parse_args(argv=None):
  p = speed_parser(__doc__, "a 1-block width-32 model, a few repetitions: a check that runs in seconds")
  p.add_argument("--depth", type=int, default=12)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--batch", default="8x128", help="tokens, BATCHxLENGTH")
  p.add_argument("--products", type=int, nargs="+", default=[1, 3, 5, 7], help="product counts to time")
  p.add_argument("--repetitions", type=int, default=10)
  p.add_argument("--budget", type=float, default=40.0, help="seconds at most per row (at least 5 pairs)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  args.scan, args.seed = False, 0
  if min(args.products) < 1:
    p.error("--products must be positive")
  return args


def summary_line(record: dict) -> tuple:
  iterations = record.get("projection_iterations")
  return (
    record["name"],
    f"{record['method_ms']:.0f}",
    f"{record['baseline_ms']:.0f}",
    f"{record['ratio']:.3f}",
    "-" if iterations is None else "{}-{}".format(*iterations),
  )


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  started = time.perf_counter()
  if args.smoke:
    for key in ("depth", "width", "vocab"):
      setattr(args, key, scale.SMOKE_MODEL[key])
    args.batch, args.repetitions, args.budget, args.products = scale.SMOKE_MODEL["large"], 2, 0.5, [1, 3]
  args.out = report.output_dir(args.out or (None if args.smoke else "results/"), "orthogonal_floor")
  model = scale.transformer(args)
  key_params, key_tokens = jax.random.split(jax.random.key(0))
  tokens = jax.random.randint(key_tokens, scale.batch_shape(args.batch), 0, args.vocab)
  params = jax.jit(lambda k: model.init(k, tokens[:, :-1])["params"])(key_params)
  sgd_m = optax.sgd(0.01, momentum=0.9)
  baseline, _ = compile_cost(scale.training_step(model, sgd_m), params, sgd_m.init(params), tokens)
  constraints = cola.path_constraints([(KERNEL, cola.Orthogonal())])
  on_manifold = cola.project_params(params, constraints)
  fresh = lambda tree: jax.tree.map(jnp.copy, tree)

  todo = [(f"sgd_m + {k} products", k, 0.0) for k in args.products]
  todo += [(f"o_cola_{d}{'_noisy' if t > 0 else ''}", d, t) for d, t in COLA_ROWS]
  progress = report.progress(len(todo), args.quiet, unit="row")
  results = []
  for name, what, temperature in todo:
    progress.set_description(name)
    if isinstance(what, int):
      tx, start = with_products(what, sgd_m), params
    else:
      noise = {"temperature": temperature, "key": jax.random.key(1)} if temperature > 0 else {}
      if what == "od":
        tx = cola.cola_od(scale.H_OD, constraints=constraints, **noise)
      else:
        tx = cola.cola_ud(scale.H_UD, friction=scale.FRICTION, constraints=constraints, **noise)
      start = on_manifold
    compiled, cost = compile_cost(scale.training_step(model, tx), start, tx.init(start), tokens)
    carries = ((fresh(start), fresh(tx.init(start)), tokens), (fresh(params), sgd_m.init(params), tokens))
    t_method, t_base = measure_pair((compiled, baseline), carries, 1, args.repetitions, args.budget)
    record = {
      "name": name,
      "products": what if isinstance(what, int) else None,
      "temperature": temperature,
      "compile_cpu_s": cost["compile_cpu_s"],
      **pair_summary(t_method, t_base),
    }
    results.append(record)
    if record["products"] is None:
      carry = (fresh(start), fresh(tx.init(start)), tokens)
      for _ in range(ITERATION_STEPS):
        carry = compiled(*carry)
      record["projection_iterations"] = iterations_used(carry[1])
    progress.write(f"{name:22s} step {record['method_ms']:7.1f} ms, SGD-m's {record['baseline_ms']:7.1f} ms")
    progress.update()
  progress.close()
  result = {
    "meta": provenance(argv, started, packages=("flax",)),
    "config": {
      "model": {"depth": args.depth, "width": args.width, "vocab": args.vocab},
      "batch": args.batch,
      "repetitions": args.repetitions,
      "budget_s": args.budget,
      "timing": "steps jitted with donated params and state, interleaved with SGD-m's, median after one warm-up",
    },
    "kernel_flops": kernel_flops(params),
    "results": results,
  }
  json_path = os.path.join(args.out, "orthogonal_floor.json")
  write_json(json_path, result)
  print(report.table([summary_line(r) for r in results], ("row", "step ms", "SGD-m ms", "ratio", "iterations")))
  print(f"wrote {json_path}")
  return result


if __name__ == "__main__":
  main()
