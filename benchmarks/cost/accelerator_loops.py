#!/usr/bin/env python
"""Loops on accelerators: the projection's ``while`` loops against their fixed-length masked form.

On a GPU the host reads the test of every ``while`` iteration before it
launches the next: o-CoLA's verified Stiefel projection (a few iterations per
kernel and step, plus the root check and the fallback's gates) and Implicit's
Newton loop each become a train of round trips.
``loop="fixed"`` runs every loop for its bound with the iterations after
convergence masked and computes the fallbacks (SVDs) every step: more
arithmetic, no round trip. Which is faster is what this measures.

For each model and method: one jitted, donated training step with
``loop="while"`` and one with ``loop="fixed"``, timed interleaved (median of repetitions),
their compile times, and after ``--steps`` steps from the same start the
largest difference between the two runs' parameters and the fraction of
projections flagged converged in each (the flag's promise, on the device).

Models: ``spiral8x100`` (the paper's spiral network at depth 8: 2-100, eight
100x100, 100-1, batch 25) and ``wide512`` (six 512x512 layers, batch 128).

Usage::

  python -m benchmarks.cost.accelerator_loops --out results/gpu/cost  # on the GPU: about a minute
  python -m benchmarks.cost.accelerator_loops --smoke                 # CPU check, seconds

Writes ``accelerator_loops.json`` under ``--out``: ``meta`` (command, date,
machine, versions, backend and device), ``config``, ``results`` (per model and
method: ``while_ms``, ``fixed_ms``, ``ratio`` fixed / while, the compile
seconds of each, ``max_param_difference``, ``converged_fraction`` of each).
"""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.harness.records import provenance, write_json
from benchmarks.harness.timing import compile_cost, measure_pair, pair_summary, speed_output, speed_parser, started_run

MODELS = {"spiral8x100": ((2,) + (100,) * 9 + (1,), 25), "wide512": ((512,) * 7, 128)}
SMOKE_MODELS = {"tiny": ((2, 8, 8, 1), 4)}


def _unit_sum_zero_norm_one(w):
  return jnp.stack([jnp.sum(w), jnp.sum(w**2) - 1])


UNIT_IMPLICIT = cola.Implicit(equality=_unit_sum_zero_norm_one, axis=0)


def _methods(temperature, key):
  """name -> (transform factory of the loop form, the form's context)."""
  every = {"mask": True, "temperature": temperature, "key": key}  # every leaf is a layer's matrix
  orthogonal_od = lambda loop: cola.o_cola_od(0.1, loop=loop, **every)
  orthogonal_ud = lambda loop: cola.o_cola_ud(0.3, friction=1.0, loop=loop, **every)

  def implicit_od(loop):
    constraint = cola.Implicit(equality=_unit_sum_zero_norm_one, axis=0, loop=loop)
    return cola.cola_od(
      0.1,
      constraints=lambda p: jax.tree.map(lambda x: constraint if x.ndim == 2 else None, p),
      temperature=temperature,
      key=key,
    )

  return {"o_cola_od": orthogonal_od, "o_cola_ud": orthogonal_ud, "implicit_od": implicit_od}


def _init(widths, batch, seed):
  keys = jax.random.split(jax.random.key(seed), len(widths) + 1)
  params = {
    f"layer{i:02d}": jax.random.normal(k, (a, b)) / np.sqrt(a)
    for i, (k, a, b) in enumerate(zip(keys, widths[:-1], widths[1:]))
  }
  x = jax.random.normal(keys[-1], (batch, widths[0]))
  y = jnp.sin(3 * x[:, :1]) * jnp.ones((1, widths[-1]))
  return params, x, y


def _loss(params, x, y):
  for name in sorted(params)[:-1]:
    x = jnp.tanh(x @ params[name])
  return jnp.mean((x @ params[sorted(params)[-1]] - y) ** 2)


def _on_manifold(method, params):
  if method.startswith("o_cola"):
    return cola.project_params(params, cola.orthogonal_constraints(mask=True))
  return cola.project_params(params, jax.tree.map(lambda x: UNIT_IMPLICIT if x.ndim == 2 else None, params))


def _converged(state):
  flags = [
    leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state) if "converged" in jax.tree_util.keystr(path)
  ]
  return float(np.mean([np.mean(np.asarray(f)) for f in flags])) if flags else None


def _one(method, factory, params, x, y, args):
  steps, compiled, costs = {}, {}, {}
  for loop in ("while", "fixed"):
    tx = factory(loop)

    def step(params, state, tx=tx):
      updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
      return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=(0, 1))
    start = jax.tree.map(jnp.copy, params)
    compiled[loop], costs[loop] = compile_cost(jitted, start, tx.init(start))
    steps[loop] = compiled[loop]
  fresh = lambda loop: jax.tree.map(jnp.copy, (params, factory(loop).init(params)))  # donated: the key too
  carries = [fresh(loop) for loop in ("while", "fixed")]
  t_while, t_fixed = measure_pair([steps["while"], steps["fixed"]], carries, args.warmup, args.repetitions, args.budget)
  runs = {}
  for loop in ("while", "fixed"):
    carry = fresh(loop)
    for _ in range(args.steps):
      carry = steps[loop](*carry)
    runs[loop] = jax.device_get(carry)
  summary = pair_summary(t_fixed, t_while)
  difference = max(
    float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(runs["while"][0]), jax.tree.leaves(runs["fixed"][0]))
  )
  return {
    "method": method,
    "while_ms": summary["baseline_ms"],
    "fixed_ms": summary["method_ms"],
    "ratio": summary["ratio"],
    "repetitions": summary["repetitions"],
    "while_compile_s": costs["while"]["compile_s"],
    "fixed_compile_s": costs["fixed"]["compile_s"],
    "max_param_difference": difference,
    "converged_fraction": {loop: _converged(runs[loop][1]) for loop in runs},
  }


def parse_args(argv=None):
  p = speed_parser(
    __doc__, "a tiny model, a few repetitions: a check that runs in seconds", repetitions=100, budget_s=10.0
  )
  p.add_argument("--temperature", type=float, default=1e-6)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--steps", type=int, default=50, help="steps of each form for the agreement check")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  argv, args, started = started_run(parse_args, argv)
  out = speed_output(args, "accelerator_loops")
  if args.smoke:
    args.repetitions, args.warmup, args.budget, args.steps = 5, 1, 2.0, 3
  models = SMOKE_MODELS if args.smoke else MODELS
  results = []
  report = {
    "meta": {},
    "config": vars(args) | {"models": {k: list(v[0]) for k, v in models.items()}},
    "results": results,
  }
  for model, (widths, batch) in models.items():
    base, x, y = _init(widths, batch, args.seed)
    for method, factory in _methods(args.temperature, jax.random.key(args.seed + 1)).items():
      row = {"model": model, **_one(method, factory, _on_manifold(method, base), x, y, args)}
      results.append(row)
      print(
        f"{model:12s} {method:12s} while {row['while_ms']:8.3f} ms  fixed {row['fixed_ms']:8.3f} ms  "
        f"fixed/while {row['ratio']:5.2f}  compile {row['while_compile_s']:.1f} / {row['fixed_compile_s']:.1f} s  "
        f"max |difference| {row['max_param_difference']:.1e}  converged {row['converged_fraction']}",
        flush=True,
      )
      report["meta"] = provenance(argv, started) | {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
      }
      write_json(str(pathlib.Path(out) / "accelerator_loops.json"), report)
  return report


if __name__ == "__main__":
  main()
