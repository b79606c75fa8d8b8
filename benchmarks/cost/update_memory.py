#!/usr/bin/env python
"""Memory of the CoLA update: optimizer state and XLA's temporaries of a donated step, compile only.

Two settings, each method compiled on its own (nothing is run, so a deep model
costs only its compile time):

* ``model`` (default): the transformer LM of ``benchmarks/cost/scale.py`` (same
  flags, same constraint families on every block kernel) and its jitted
  training step (loss, gradient, update, apply; parameters and optimizer state
  donated) at the small batch;
* ``leaves``: ``--leaves`` leaves of ``--leaf-shape``, every one constrained,
  and a jitted ``update + apply_updates`` (parameters and state donated, the
  gradients an argument): the temporaries of the update alone, in leaf sizes.

Measured per method: the optimizer state's bytes and ``compiled.memory_analysis()``
(temporary, argument, output and aliased bytes), the compile's CPU seconds and
the compiled program's fusions (kernels) and while loops.
Target (issue 22, model setting): state + temporaries at most Adam's + the
parameters' bytes.

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.update_memory       # depth 12, width 512: 30-60 min on 2 cores
  python -m benchmarks.cost.update_memory --setting leaves --leaves 4  # seconds
  python -m benchmarks.cost.update_memory --smoke                      # a 1-block model, a temporary folder

Writes ``--json`` (default ``update_memory.json``) under ``--out``. JSON keys:
``meta`` (command, date, machine, versions, the cola_jax source and its git
commit), ``config``, ``params_bytes``, ``results`` (one record per method:
``name``, ``family``, ``dynamics``, ``temperature``, ``state_bytes``,
``temp_bytes``, ``argument_bytes``, ``output_bytes``, ``alias_bytes``,
``compile_cpu_s``, ``fusions`` and ``while_loops``: the compiled program's
kernels and loops, which its compile time follows), ``targets`` (model setting:
``name``, ``value``, ``limit``, ``met``).
"""

from __future__ import annotations

import os
import subprocess

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import optax

import cola_jax as cola
from benchmarks.cost import scale
from benchmarks.harness import report
from benchmarks.harness.records import provenance, write_json
from benchmarks.harness.timing import compile_cost, speed_output, speed_parser, started_run, target_lines, tree_bytes

RESULT_KEYS = (
  "name",
  "family",
  "dynamics",
  "temperature",
  "state_bytes",
  "temp_bytes",
  "argument_bytes",
  "output_bytes",
  "alias_bytes",
  "compile_cpu_s",
  "fusions",
  "while_loops",
)


def rows(args) -> list[tuple]:
  """(name, family, dynamics, temperature): the baselines, then every family with noise and without."""
  out = [(name, None, None, 0.0) for name in scale.BASELINES]
  for temperature in (args.temperature, 0.0):
    for family in args.families:
      for dynamics in args.dynamics:
        out.append((f"{dynamics}_{family}{'_noisy' if temperature > 0 else ''}", family, dynamics, temperature))
  return out


def source_commit() -> str | None:
  """The git commit of the cola_jax being measured (``+dirty`` with local changes), None outside a checkout."""
  where = os.path.dirname(cola.__file__)
  try:
    commit = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--", "."], capture_output=True, text=True)
  except (OSError, subprocess.CalledProcessError):
    return None
  return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def leaves_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def make_method(row, setting, scan: bool):
  """(transform, constraint spec or None): scale.py's, or in the leaves setting the family on every leaf."""
  name, family, dynamics, temperature = row
  if setting["kind"] == "model" or family is None:
    return scale.make_method(name, family, dynamics, temperature, scan)
  constraint = scale.family_constraint(family, False)
  noise = {"temperature": temperature, "key": jax.random.key(1)} if temperature > 0 else {}
  if dynamics == "od":
    return cola.cola_od(scale.H_OD, constraints=constraint, **noise), constraint
  return cola.cola_ud(scale.H_UD, friction=scale.FRICTION, constraints=constraint, **noise), constraint


def measure(row, setting, args) -> dict:
  name, family, dynamics, temperature = row
  tx, constraints = make_method(row, setting, args.scan)
  params = setting["params"]
  start = params if constraints is None else cola.project_params(params, constraints)
  state = tx.init(start)
  if setting["kind"] == "model":
    step, extra = scale.training_step(setting["model"], tx), setting["tokens"]
  else:
    step, extra = leaves_step(tx), jax.tree.map(lambda p: 0.1 * p, start)
  _, cost = compile_cost(step, start, state, extra)
  return {
    "name": name,
    "family": family,
    "dynamics": dynamics,
    "temperature": temperature,
    "state_bytes": tree_bytes(state),
    **{key: cost[key] for key in RESULT_KEYS[5:]},
  }


def targets_from(results, params_bytes: int) -> list[dict]:
  by_name = {r["name"]: r for r in results}
  if "adam" not in by_name:
    return []
  adam = by_name["adam"]
  limit = (adam["state_bytes"] + adam["temp_bytes"] + params_bytes) / 1e6
  return [
    {
      "name": f"{r['name']} state + temporaries (MB) / Adam's + parameters'",
      "value": (r["state_bytes"] + r["temp_bytes"]) / 1e6,
      "limit": round(limit, 1),
      "met": (r["state_bytes"] + r["temp_bytes"]) / 1e6 <= limit,
    }
    for r in results
    if r["family"] is not None
  ]


def table(results, unit: float, unit_name: str) -> str:
  header = ("method", "tau", "state", "temporaries", "state + temporaries", "compile CPU s", "fusions", "while loops")
  lines = [
    (
      r["name"],
      f"{r['temperature']:g}",
      f"{r['state_bytes'] / unit:.1f}",
      f"{r['temp_bytes'] / unit:.1f}",
      f"{(r['state_bytes'] + r['temp_bytes']) / unit:.1f}",
      f"{r['compile_cpu_s']:.1f}",
      str(r["fusions"]),
      str(r["while_loops"]),
    )
    for r in results
  ]
  return f"in {unit_name}\n" + report.table(lines, header)


def parse_args(argv=None):
  p = speed_parser(__doc__, "a 1-block width-32 model (or 2 leaves of 64x128): a check that runs in seconds")
  p.add_argument("--setting", choices=("model", "leaves"), default="model")
  p.add_argument("--depth", type=int, default=12, help="transformer blocks")
  p.add_argument("--width", type=int, default=512, help="model width (heads: width / 64, at least 1)")
  p.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
  p.add_argument("--scan", action="store_true", help="the blocks as one nn.scan (stacked kernels)")
  p.add_argument("--batch", default="2x64", help="BATCHxLENGTH tokens of the model's step")
  p.add_argument("--leaves", type=int, default=4, help="leaves of the leaves setting")
  p.add_argument("--leaf-shape", default="512x2048", help="ROWSxCOLUMNS of each leaf of the leaves setting")
  p.add_argument("--families", nargs="+", default=list(scale.FAMILIES), choices=scale.FAMILIES)
  p.add_argument("--dynamics", nargs="+", default=list(scale.DYNAMICS), choices=scale.DYNAMICS)
  p.add_argument("--temperature", type=float, default=1e-6, help="the temperature > 0 setting")
  p.add_argument("--json", default="update_memory.json", help="the results file's name under --out")
  args = p.parse_args(argv)
  for flag in ("depth", "width", "vocab", "leaves"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag} must be positive")
  return args


def main(argv=None) -> dict:
  argv, args, started = started_run(parse_args, argv)
  if args.smoke:
    for key in ("depth", "width", "vocab"):
      setattr(args, key, scale.SMOKE_MODEL[key])
    args.batch = scale.SMOKE_MODEL["small"]
    args.leaves, args.leaf_shape = 2, "64x128"
  args.out = speed_output(args, "update_memory")
  key_params, key_tokens = jax.random.split(jax.random.key(args.seed))
  if args.setting == "model":
    model = scale.transformer(args)
    tokens = jax.random.randint(key_tokens, scale.batch_shape(args.batch), 0, args.vocab)
    params = jax.jit(lambda k: model.init(k, tokens[:, :-1])["params"])(key_params)
    setting = {"kind": "model", "model": model, "tokens": tokens, "params": params}
    described = {
      "depth": args.depth,
      "width": args.width,
      "heads": model.n_heads,
      "vocab": args.vocab,
      "scan": args.scan,
    }
    described |= {"batch": args.batch, "parameters": tree_bytes(params) // 4}
  else:
    shape = tuple(int(n) for n in args.leaf_shape.split("x"))
    keys = jax.random.split(key_params, args.leaves)
    params = {f"w{i}": 0.05 * jax.random.normal(k, shape) for i, k in enumerate(keys)}
    setting = {"kind": "leaves", "params": params}
    described = {"leaves": args.leaves, "leaf_shape": list(shape)}
  params_bytes = tree_bytes(params)
  leaf_bytes = params_bytes / args.leaves
  compile_cost(leaves_step(optax.sgd(0.1)), params, optax.sgd(0.1).init(params), params)  # the compiler's first use

  todo = rows(args)
  config = {
    "setting": args.setting,
    "smoke": args.smoke,
    **described,
    "families": args.families,
    "dynamics": args.dynamics,
    "temperature": args.temperature,
    "hyperparameters": {"h_od": scale.H_OD, "h_ud": scale.H_UD, "friction": scale.FRICTION},
    "cola_jax_source": os.path.dirname(cola.__file__),
    "cola_jax_commit": source_commit(),
  }
  json_path = os.path.join(args.out, args.json)
  results = []
  for row in todo:
    results.append(measure(row, setting, args))
    r = results[-1]
    print(
      f"{r['name']:24s} state {r['state_bytes'] / 1e6:6.1f} MB, temporaries {r['temp_bytes'] / 1e6:6.1f} MB "
      f"({r['temp_bytes'] / leaf_bytes:.2f} leaves), compile {r['compile_cpu_s']:.1f} CPU s, "
      f"{r['fusions']} fusions, {r['while_loops']} while loops",
      flush=True,
    )
    result = {  # written after every method: an interrupted run keeps what it measured
      "meta": provenance(argv, started, packages=("flax",)),
      "config": {**config, "complete": len(results) == len(todo)},
      "params_bytes": params_bytes,
      "results": results,
      "targets": targets_from(results, params_bytes) if args.setting == "model" else [],
    }
    write_json(json_path, result)
  if args.setting == "model":
    print(table(results, 1e6, "MB"))
  else:
    print(table(results, leaf_bytes, f"leaf sizes ({leaf_bytes / 1e6:.1f} MB)"))
  print("\n".join(target_lines(result["targets"])))
  print(f"\nwrote {json_path}")
  return result


if __name__ == "__main__":
  main()
