#!/usr/bin/env python
"""Cost at scale: compile time, memory and step time of every CoLA method on a deep transformer LM.

The model is the harness's causal transformer language model
(:mod:`harness.transformer`, no dropout) with ``--depth`` post-norm blocks of
width ``--width`` (``--width / 64`` heads, feed-forward ``4 x width``), vocabulary
``--vocab``; by default each block has parameters of its own (``block_i/...``:
48 constrained kernels at depth 12), with ``--scan`` the blocks are one
``nn.scan`` (4 stacked kernels ``(depth, in, out)``). Every block kernel is
constrained (:func:`cola_jax.path_constraints`), the embedding, decoder, biases
and norms are free. Constraint families, each with CoLA-od and CoLA-ud, at
temperature 0 and ``--temperature``:

* ``circle`` ``Circle(0.2)`` and ``box`` ``Box(-0.2, 0.2)``: elementwise;
* ``sphere`` ``MaxNorm(1)`` (the ball; the family keeps the name it had as ``Sphere``) and
  ``unit_norm`` ``UnitNorm(1)`` (the sphere): per output unit;
* ``orthogonal`` ``Orthogonal()``: orthonormal columns or rows of each kernel;
* ``implicit``: ``Implicit`` per output unit, entries summing to 0 with norm 1;
* ``non_negative`` ``NonNegative()``: elementwise.

Baselines, in the same process: ``optax.sgd(0.01, momentum=0.9)`` (``sgd_m``)
and ``optax.adam(1e-3)``. CoLA-od runs with ``h = 0.01``, CoLA-ud with
``h = 0.1``, friction 1 (SGD-m with learning rate 0.01, momentum 0.905 at
temperature 0). The parameters start on each manifold
(:func:`cola_jax.project_params`).

For each method: one jitted training step (loss, gradient, update, apply;
parameters and optimizer state donated), compiled separately at the small
batch (``--small``, tokens ``batch x length``) and at the realistic one
(``--large``). Measured: compile time (``lower().compile()``, wall clock and
this process's CPU time, the steadier on a shared machine; the baseline
compiled once before the measurements so that no method pays the compiler's
first use), the optimizer state's bytes, XLA's temporary bytes
(``compiled.memory_analysis()``), and the step time at both batches, each
interleaved with SGD-m's step at the same batch (median of repetitions after
warm-up). Targets (issue 22): at temperature > 0 every method compiles in at
most 2x SGD-m's (CPU) time; state + temporaries at most Adam's + the parameters'
bytes; at the large batch the step takes at most 1.25x SGD-m's (1.5x for
``orthogonal``).

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.scale                       # depth 12, width 512: an hour on 2 cores
  python -m benchmarks.cost.scale --smoke                                      # seconds, tiny model, temporary folder
  python -m benchmarks.cost.scale --families circle orthogonal --dynamics ud --depth 24
  python -m benchmarks.cost.scale --markdown results/cost/scale.json           # the table of a run, in Markdown
  python -m benchmarks.cost.scale --replot results/cost/scale.json             # its PNG again
  python -m benchmarks.cost.scale --merge a/scale.json b/scale.json --out DIR  # runs that split the families

Writes ``scale.json`` and ``scale.png`` under ``--out``. JSON keys: ``meta``
(command, date, machine, versions), ``config``, ``params_bytes``, ``results``
(one record per method: ``name``, ``family``, ``dynamics``, ``temperature``,
``state_bytes``, ``small`` and ``large``, each with ``compile_s`` and ``compile_cpu_s``,
``temp_bytes``, the step's ``method_ms``, ``baseline_ms`` (SGD-m) and
``ratio``), ``targets`` (``name``, ``value``, ``limit``, ``met``). A merged
report (``--merge``: runs of one protocol, each with its own optax rows, that
measured some families or dynamics, as on a GPU lent for minutes at a time) keeps
the first run's optax rows, gives each method's ``small`` its own run's
``sgd_m_compile_cpu_s`` for the compile-time ratio, and lists the runs under
``merged_from``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax

import cola_jax as cola
from benchmarks.cost.scale_report import BASELINES, DYNAMICS, FAMILIES, markdown, merged, plot, table, targets_from
from benchmarks.harness import cli, report
from benchmarks.harness.records import provenance, write_json
from benchmarks.harness.timing import (
  compile_cost,
  measure_pair,
  pair_summary,
  speed_output,
  speed_parser,
  target_lines,
  tree_bytes,
)
from benchmarks.harness.transformer import TransformerLM

H_OD, H_UD, FRICTION = 0.01, 0.1, 1.0
SMOKE_MODEL = {"depth": 1, "width": 32, "vocab": 64, "small": "2x8", "large": "2x8"}  # one batch: half the compiles


def zero_sum_unit_norm(unit):
  """Per unit: the entries sum to zero and the norm is 1 (two components)."""
  return jnp.stack([jnp.sum(unit), jnp.sum(unit * unit) - 1])


def family_constraint(family: str, scan: bool):
  """The constraint of every block kernel: ``(in, out)``, or ``(depth, in, out)`` stacked by ``nn.scan``."""
  unit = 1 if scan else None  # the axes of one unit's incoming weights; None: every axis but the last
  return {
    "circle": lambda: cola.Circle(0.2),
    "box": lambda: cola.Box(-0.2, 0.2),
    "sphere": lambda: cola.MaxNorm(1.0, axis=unit),
    "unit_norm": lambda: cola.UnitNorm(1.0, axis=unit),
    "orthogonal": lambda: cola.Orthogonal(row_axes=1, column_axes=2) if scan else cola.Orthogonal(),
    "implicit": lambda: cola.Implicit(equality=zero_sum_unit_norm, axis=unit if scan else 0),
    "non_negative": lambda: cola.NonNegative(),
  }[family]()


def kernel_constraints(family: str, scan: bool):
  return cola.path_constraints([(r"^(layers|block_\d+)/.*/kernel$", family_constraint(family, scan))])


def make_method(name: str, family: str | None, dynamics: str | None, temperature: float, scan: bool, seed: int = 1):
  """(transform, constraint spec or None) of a result row; with noise, its key is ``jax.random.key(seed)``."""
  if name == "sgd_m":
    return optax.sgd(0.01, momentum=0.9), None
  if name == "adam":
    return optax.adam(1e-3), None
  assert family is not None
  constraints = kernel_constraints(family, scan)
  noise = {"temperature": temperature, "key": jax.random.key(seed)} if temperature > 0 else {}
  if dynamics == "od":
    return cola.cola_od(H_OD, constraints=constraints, **noise), constraints
  return cola.cola_ud(H_UD, friction=FRICTION, constraints=constraints, **noise), constraints


def lowered_step(args, name: str, family: str | None, dynamics: str | None, temperature: float, seed: int = 1):
  """``name``'s training step on a fresh model of ``args`` (``depth``, ``width``, ``vocab``, unscanned), lowered
  at ``args.batch`` tokens with the parameters on its manifold: what a process of its own compiles."""
  model = transformer(argparse.Namespace(depth=args.depth, width=args.width, vocab=args.vocab, scan=False))
  tokens = jax.random.randint(jax.random.key(2), batch_shape(args.batch), 0, args.vocab)
  params = jax.jit(lambda k: model.init(k, tokens[:, :-1])["params"])(jax.random.key(0))
  tx, constraints = make_method(name, family, dynamics, temperature, False, seed)
  start = params if constraints is None else cola.project_params(params, constraints)
  return training_step(model, tx).lower(start, tx.init(start), tokens)


def batch_shape(text: str) -> tuple[int, int]:
  batch, _, length = text.partition("x")
  return int(batch), int(length)


def training_step(model, tx):
  """``(params, state, tokens) -> (params, state, tokens)``: next-token cross-entropy, gradient, update."""

  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params, state, tokens):
    updates, state = tx.update(jax.grad(loss)(params, tokens), state, params)
    return optax.apply_updates(params, updates), state, tokens

  return jax.jit(step, donate_argnums=(0, 1))


def rows(args) -> list[tuple]:
  """(name, family, dynamics, temperature) of every measurement: baselines, with noise, without."""
  out = [(name, None, None, 0.0) for name in BASELINES]
  for temperature in (args.temperature, 0.0):  # with noise first: what the compile-time target is about
    for i, family in enumerate(args.families):
      for dynamics in args.dynamics:
        if args.smoke and len(args.dynamics) > 1 and dynamics != DYNAMICS[i % 2]:
          continue  # --smoke: each family once, od and ud in turn
        if args.smoke and temperature == 0 and family != args.families[0]:
          continue
        out.append((f"{dynamics}_{family}{'_noisy' if temperature > 0 else ''}", family, dynamics, temperature))
  return out


def measure_row(row, model, params, tokens, baselines, args) -> dict:
  """One method: state bytes, then per batch its compile cost and its step interleaved with SGD-m's."""
  name, family, dynamics, temperature = row
  tx, constraints = make_method(name, family, dynamics, temperature, args.scan)
  start = params if constraints is None else cola.project_params(params, constraints)
  record = {
    "name": name,
    "family": family,
    "dynamics": dynamics,
    "temperature": temperature,
    "state_bytes": tree_bytes(tx.init(start)),
  }
  step = training_step(model, tx)
  fresh = lambda tree: jax.tree.map(jnp.copy, tree)  # each call donates its own buffers, the PRNG key included
  for size in ("small", "large"):
    if size == "large" and args.large == args.small:
      record[size] = record["small"]
      break
    compiled, cost = compile_cost(step, start, tx.init(start), tokens[size])
    base_compiled, base_tx = baselines[size]
    carries = (
      (fresh(start), fresh(tx.init(start)), tokens[size]),
      (fresh(params), base_tx.init(params), tokens[size]),
    )
    t_method, t_base = measure_pair((compiled, base_compiled), carries, 1, args.repetitions, args.budget)
    record[size] = {**cost, **pair_summary(t_method, t_base)}
    del compiled, carries
  return record


def transformer(args) -> TransformerLM:
  """The model of ``--depth``, ``--width`` (``width / 64`` heads, at least 1), ``--vocab`` and ``--scan``."""
  return TransformerLM(
    vocab_size=args.vocab,
    d_model=args.width,
    n_heads=max(1, args.width // 64),
    d_ff=4 * args.width,
    n_layers=args.depth,
    dropout=0.0,
    scan_layers=args.scan,
  )


def add_model_arguments(p) -> None:
  """``--depth``, ``--width`` and ``--vocab`` of the model (12 blocks of width 512, vocabulary 1024)."""
  p.add_argument("--depth", type=int, default=12, help="transformer blocks")
  p.add_argument("--width", type=int, default=512, help="model width (heads: width / 64, at least 1)")
  p.add_argument("--vocab", type=int, default=1024, help="vocabulary size")


def add_step_arguments(p) -> None:
  """The model's flags, ``--batch`` and ``--temperature``: a script that compiles one step per process."""
  add_model_arguments(p)
  p.add_argument("--batch", default="2x64", help="BATCHxLENGTH tokens of the step")
  p.add_argument("--temperature", type=float, default=1e-6, help="the temperature > 0 setting")


def smoke_step(args) -> None:
  """``--smoke``'s model and batch for such a script: one block of width 32, 2 x 8 tokens."""
  for key in ("depth", "width", "vocab"):
    setattr(args, key, SMOKE_MODEL[key])
  args.batch = "2x8"


def step_arguments(args) -> list[str]:
  """The flags of ``add_step_arguments`` as ``args`` has them, for a child process."""
  model = ["--depth", str(args.depth), "--width", str(args.width), "--vocab", str(args.vocab)]
  return [*model, "--batch", args.batch, "--temperature", str(args.temperature)]


def parse_args(argv=None):
  p = speed_parser(
    __doc__, "a 1-block width-32 model, a few repetitions: a check that runs in seconds", repetitions=10, budget_s=30.0
  )
  add_model_arguments(p)
  p.add_argument("--scan", action="store_true", help="the blocks as one nn.scan (stacked kernels)")
  p.add_argument("--small", default="2x64", help="the small batch, BATCHxLENGTH tokens")
  p.add_argument("--large", default="8x128", help="the realistic batch, BATCHxLENGTH tokens")
  p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
  p.add_argument("--dynamics", nargs="+", default=list(DYNAMICS), choices=DYNAMICS)
  p.add_argument("--temperature", type=float, default=1e-6, help="the temperature > 0 setting")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.add_argument("--markdown", metavar="JSON", help="print the results of a scale.json as a Markdown table, and exit")
  p.add_argument(
    "--replot", metavar="JSON", help="draw scale.png beside a scale.json (an interrupted run's too), and exit"
  )
  cli.merge_flag(
    p, "measure nothing: join the scale.json files of runs of one protocol that split its families or dynamics"
  )
  args = p.parse_args(argv)
  for flag in ("depth", "width", "vocab", "repetitions"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag} must be positive")
  for flag in ("small", "large"):
    try:
      if min(batch_shape(getattr(args, flag))) < 2:
        raise ValueError
    except ValueError:
      p.error(f"--{flag} must be BATCHxLENGTH with both at least 2, got {getattr(args, flag)!r}")
  return args


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.markdown or args.replot:
    with open(args.markdown or args.replot) as f:
      saved = json.load(f)
    if args.markdown:
      print(markdown(saved))
    else:
      plot(saved["results"], saved["params_bytes"], os.path.join(os.path.dirname(args.replot), "scale.png"))
    return saved
  if args.merge:
    result = merged(args.merge, argv)
    args.out = report.output_dir(args.out or "results/cost/", "scale")
    write_json(os.path.join(args.out, "scale.json"), result)
    plot(result["results"], result["params_bytes"], os.path.join(args.out, "scale.png"))
    print(table(result["results"], result["params_bytes"]))
    return result
  started = time.perf_counter()
  if args.smoke:
    for key, value in SMOKE_MODEL.items():
      setattr(args, key, value)
    args.repetitions, args.budget = min(args.repetitions, 2), 0.5
  args.out = speed_output(args, "scale")
  model = transformer(args)
  heads = model.n_heads
  key_params, key_tokens = jax.random.split(jax.random.key(args.seed))
  tokens = {
    size: jax.random.randint(jax.random.fold_in(key_tokens, i), batch_shape(getattr(args, size)), 0, args.vocab)
    for i, size in enumerate(("small", "large"))
  }
  params = jax.jit(lambda k: model.init(k, tokens["small"][:, :-1])["params"])(key_params)
  params_bytes = tree_bytes(params)

  sgd_m = optax.sgd(0.01, momentum=0.9)
  compile_cost(training_step(model, sgd_m), params, sgd_m.init(params), tokens["small"])  # the compiler's first use
  baselines = {
    size: (compile_cost(training_step(model, sgd_m), params, sgd_m.init(params), tokens[size])[0], sgd_m)
    for size in ("small", "large")
  }

  todo = rows(args)
  config = {
    "smoke": args.smoke,
    "model": {
      "depth": args.depth,
      "width": args.width,
      "heads": heads,
      "d_ff": 4 * args.width,
      "vocab": args.vocab,
      "scan": args.scan,
      "parameters": params_bytes // 4,
    },
    "batches": {"small": args.small, "large": args.large},
    "families": args.families,
    "dynamics": args.dynamics,
    "temperature": args.temperature,
    "hyperparameters": {"h_od": H_OD, "h_ud": H_UD, "friction": FRICTION},
    "threefry_gpu_kernel_lowering": jax.config.jax_threefry_gpu_kernel_lowering,  # pyright: ignore[reportAttributeAccessIssue]
    "repetitions": args.repetitions,
    "budget_s": args.budget,
    "timing": "each method compiled on its own (lower().compile(), wall clock and process CPU time; the "
    "baseline compiled once before, uncounted); steps jitted with donated params and state, interleaved "
    "with SGD-m's at the same batch, median after one warm-up call",
  }
  json_path = os.path.join(args.out, "scale.json")
  progress = report.progress(len(todo), args.quiet, unit="method")
  progress.write(
    f"{args.depth} blocks, width {args.width}, {heads} heads, vocabulary {args.vocab}"
    f"{' (scanned)' if args.scan else ''}: {params_bytes / 4e6:.1f}M parameters; {len(todo)} methods"
  )
  results = []
  for row in todo:
    progress.set_description(row[0])
    record = measure_row(row, model, params, tokens, baselines, args)
    results.append(record)
    small = record["small"]
    progress.write(
      f"{row[0]:24s} compile {small['compile_cpu_s']:5.1f} CPU s, state {record['state_bytes'] / 1e6:4.0f} MB, "
      f"temp {small['temp_bytes'] / 1e6:5.0f} MB, step {small['ratio']:.2f}x / {record['large']['ratio']:.2f}x sgd_m"
    )
    progress.update()
    result = {  # written after every method: an interrupted run keeps what it measured
      "meta": provenance(argv, started, packages=("flax",)),
      "config": {**config, "complete": len(results) == len(todo)},
      "params_bytes": params_bytes,
      "results": results,
      "targets": targets_from(results, params_bytes),
    }
    write_json(json_path, result)
  progress.close()
  plot(results, params_bytes, os.path.join(args.out, "scale.png"))
  print(table(results, params_bytes))
  print("\n".join(target_lines(result["targets"])))
  print(f"\nwrote {json_path} and {os.path.join(args.out, 'scale.png')}")
  return result


if __name__ == "__main__":
  main()
