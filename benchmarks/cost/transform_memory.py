#!/usr/bin/env python
"""Memory of the transforms beside the CoLA methods on the deep model: ``constrained``, ``manifold_muon``,
``hyperspherical_descent``.

``benchmarks.cost.scale`` and ``benchmarks.cost.update_memory`` measure ``cola_od`` and ``cola_ud``; this measures
the other transforms the driver runs, on the same transformer LM (12 blocks of width 512 by default), compile
only: each row's jitted training step (gradient, update, apply, donated) is lowered and compiled, and XLA's
``memory_analysis()`` recorded (temporaries, arguments, outputs) beside the optimizer state's bytes and the compile
time. Rows: ``optax.adam`` (the baseline), ``cola.constrained(optax.adam)`` with every block kernel under
``Circle(0.2)`` and under ``MaxNorm(1.0)``, ``cola.hyperspherical_descent`` and ``cola.manifold_muon`` on the
block kernels.

Run: ``OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.transform_memory`` (``--smoke``: a 1-block width-32
model, seconds). Writes ``transform_memory.json`` to ``--out`` (default ``results/cost/``).
"""

import argparse
import os

import jax
import optax

import cola_jax as cola
from benchmarks.cost import scale
from benchmarks.harness import report
from benchmarks.harness.records import provenance, write_json
from benchmarks.harness.timing import compile_cost, started_run, tree_bytes

KERNELS = r"^(layers|block_\d+)/.*/kernel$"
ROWS = ("adam", "constrained_adam_circle", "constrained_adam_max_norm", "hyperspherical_descent", "manifold_muon")


def make_transform(name: str):
  """(transform, constraint spec or None) of a row."""
  on_kernels = lambda c: cola.path_constraints([(KERNELS, c)])
  if name == "adam":
    return optax.adam(1e-3), None
  if name == "constrained_adam_circle":
    constraints = on_kernels(cola.Circle(0.2))
    return cola.constrained(optax.adam(1e-3), constraints=constraints), constraints
  if name == "constrained_adam_max_norm":
    constraints = on_kernels(cola.MaxNorm(1.0))
    return cola.constrained(optax.adam(1e-3), constraints=constraints), constraints
  if name == "hyperspherical_descent":
    constraints = on_kernels(cola.UnitNorm(axis="all"))
    return cola.hyperspherical_descent(0.01, constraints=constraints), constraints
  constraints = on_kernels(cola.Orthogonal())
  return cola.manifold_muon(0.01, constraints=constraints), constraints


def measure(name: str, model, params, tokens) -> dict:
  tx, constraints = make_transform(name)
  start = params if constraints is None else cola.project_params(params, constraints)
  state = tx.init(start)
  _, cost = compile_cost(scale.training_step(model, tx), start, state, tokens)
  keys = ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "compile_cpu_s", "fusions", "while_loops")
  return {"name": name, "state_bytes": tree_bytes(state), **{k: cost[k] for k in keys}}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="a 1-block width-32 model: a check that runs in seconds")
  p.add_argument("--out", default=None, help="output directory (default: results/cost/; --smoke: a temporary one)")
  scale.add_model_arguments(p)
  p.add_argument("--batch", default="8x128", help="BATCHxLENGTH tokens of the step")
  p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
  return p.parse_args(argv)


def main(argv=None) -> dict:
  argv, args, started = started_run(parse_args, argv)
  if args.smoke:
    for key, value in scale.SMOKE_MODEL.items():
      setattr(args, key, value)
    args.batch = "2x8"
  model = scale.transformer(argparse.Namespace(depth=args.depth, width=args.width, vocab=args.vocab, scan=False))
  tokens = jax.random.randint(jax.random.key(2), scale.batch_shape(args.batch), 0, args.vocab)
  params = jax.jit(lambda k: model.init(k, tokens[:, :-1])["params"])(jax.random.key(0))
  results = []
  for name in args.rows:
    results.append(measure(name, model, params, tokens))
    row = results[-1]
    print(
      f"{name:28s} temp {row['temp_bytes'] / 2**20:8.1f} MiB  state {row['state_bytes'] / 2**20:8.1f} MiB  "
      f"compile {row['compile_cpu_s']:6.1f} CPU s"
    )
  out = report.output_dir(args.out or (None if args.smoke else "results/cost/"), "transform_memory")
  record = {
    "meta": provenance(argv, started, ("flax",)),
    "config": {"depth": args.depth, "width": args.width, "vocab": args.vocab, "batch": args.batch},
    "params_bytes": tree_bytes(params),
    "results": results,
  }
  write_json(os.path.join(out, "transform_memory.json"), record)
  return record


if __name__ == "__main__":
  main()
