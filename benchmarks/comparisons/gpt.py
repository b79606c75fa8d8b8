"""A GPT of the project's own on character-level KJV: Adam against cola's constrained training (issue 48).

The model (``gpt_model.py``): 4 pre-norm blocks of width 128 around Flax NNX's
``nnx.MultiHeadAttention`` (4 heads of 32, causal), a feed-forward layer of 512
with GELU, learned token and position embeddings, no dropout: the size of the
JAX AI Stack miniGPT tutorial's CPU run, 0.82 M parameters. The data: the King
James Bible from Debian's ``bible-kjv`` as characters, split as the harness's
word-level corpus (blocks of 100 verses, 18 of every 20 train, 1 validation, 1
test; verses joined by newlines), the vocabulary every character of the
training text. Training windows of ``--length`` characters in ``--batch``
columns spread over the training text, taken in order
(:func:`benchmarks.harness.text.windows`); validation and test: the first
``EVAL_WINDOWS`` windows of 16 such columns of each split. Every method runs
the same seeds (the initialisation) and windows, seeds vmapped
(:class:`benchmarks.harness.lm.LMRun`), methods interleaved chunk by chunk.

Methods, each with ``optax.adam(--adam-lr)`` on every leaf it leaves free:

* ``adam``: ``optax.adam``, every leaf;
* ``orthogonal``: ``cola.constrained(optax.adam)`` with each head's query, key
  and value ``(128, 32)`` matrix and each head's output ``(32, 128)`` matrix
  orthonormal (``PER_HEAD``: the rule of docs/guides/declared_constraints.md);
* ``unit_norm``: ``cola.constrained(optax.adam)`` with nGPT's spheres
  (``SPHERES``, docs/guides/normalized_transformers.md): every vector of the
  residual stream that a matrix holds (embedding rows, the columns of the
  kernels reading the stream, the rows of those writing into it) of norm 1;
* ``c_cola_ud``: ``cola.c_cola_ud(--h, friction=--friction, radius=--radius,
  free=optax.adam)`` with ``mask=KERNELS``: every leaf named ``kernel``
  (attention, feed-forward and output layer) in ``[-r, r]`` elementwise, the
  leaves the default rule takes, named.

The constrained leaves start where the initialiser puts them; the first update
puts them on their manifold. Reported per method and seed: the training loss
(mean over each chunk's windows) and validation and test loss at every
evaluation, and at the end ``cola.constraint_residuals`` (the largest over the
leaves). Then, in the same process, one seed's jitted training step (loss,
gradient, update, apply) of each method against Adam's: compile time
(``lower().compile()``, wall and CPU seconds, after Adam's compile has paid the
compiler's first use), XLA's ``memory_analysis()`` (arguments, that is
parameters, optimizer state and batch, plus temporaries) and the step time,
interleaved with Adam's (median of pairs after warm-up).

``--sweep`` trains seed 0 for ``--steps`` steps: Adam at each learning rate
of ``ADAM_LRS``, then c-CoLA-ud at each ``(h, friction)`` of ``CCOLA_GRID``
with ``free=`` Adam at the best of those, and writes ``gpt_sweep.json``. The
defaults of ``--adam-lr`` (also the learning rate of both ``constrained``
methods), ``--h`` and ``--friction`` are its lowest final validation losses;
``--radius`` is fixed, 2.3 standard deviations of the width-128 kernels'
initialisation (LeCun normal).

Usage::

  python -m benchmarks.comparisons.gpt            # 3 seeds, 300 steps: results/comparisons/gpt.{json,png}
  python -m benchmarks.comparisons.gpt --sweep --steps 200 --eval-every 100   # the defaults' sweep
  python -m benchmarks.comparisons.gpt --smoke    # seconds, synthetic text, temporary folder
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.comparisons.gpt_model import FunctionalGPT
from benchmarks.comparisons.gpt_report import plot, table
from benchmarks.harness import cli, lm, models, perplexity, records, report, text
from benchmarks.harness.timing import against_adam, compile_cost, measure_pair, pair_summary, tree_bytes

METHODS = ("adam", "orthogonal", "unit_norm", "c_cola_ud")
PER_HEAD = [
  (r"(query|key|value)/kernel$", cola.Orthogonal(row_axes=0, column_axes=2)),
  (r"out/kernel$", cola.Orthogonal(row_axes=1, column_axes=2)),
]
SPHERES = [
  (r"embedding$", cola.UnitNorm(axis=-1)),  # (vocab or length, width): each row
  (r"(query|key|value)/kernel$", cola.UnitNorm(axis=0)),  # (width, heads, head_dim): along the width
  # (heads, head_dim, width): each output unit's incoming weights, as results/comparisons/gpt.json was run;
  # nGPT's sphere (docs/guides/normalized_transformers.md) is axis=-1, each width-vector.
  (r"out/kernel$", cola.UnitNorm(axis=(0, 1))),
  (r"(up|head)/kernel$", cola.UnitNorm(axis=0)),  # (width, out): each column
  (r"down/kernel$", cola.UnitNorm(axis=-1)),  # (4 width, width): each row
]
ADAM_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
CCOLA_GRID = tuple((h, g) for h in (0.25, 0.5, 1.0) for g in (1.0, 4.0))
DEFAULTS = {"adam_lr": 1e-3, "h": 0.25, "friction": 1.0, "radius": 0.2}  # gpt_sweep.json's choice, r fixed
MODEL = {"width": 128, "heads": 4, "blocks": 4}
EVAL_COLUMNS, EVAL_WINDOWS = 16, 8
SMOKE = {"steps": 4, "seeds": 2, "batch": 4, "length": 16, "model": {"width": 16, "heads": 2, "blocks": 1}}
SMOKE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}


def kernels(params):
  """The mask of every leaf named ``kernel``."""
  return jax.tree_util.tree_map_with_path(lambda path, _: models.param_path(path).endswith("kernel"), params)


def make_method(name: str, hp: dict) -> optax.GradientTransformation:
  """The optimizer ``name`` with the hyperparameters ``hp`` (``DEFAULTS``' keys)."""
  if name == "adam":
    return optax.adam(hp["adam_lr"])
  if name == "orthogonal":
    return cola.constrained(optax.adam(hp["adam_lr"]), constraints=cola.path_constraints(PER_HEAD))
  if name == "unit_norm":
    return cola.constrained(optax.adam(hp["adam_lr"]), constraints=cola.path_constraints(SPHERES))
  return cola.c_cola_ud(
    hp["h"], friction=hp["friction"], radius=hp["radius"], mask=kernels, free=optax.adam(hp["adam_lr"])
  )


def describe(name: str, hp: dict) -> str:
  return {
    "adam": f"optax.adam({hp['adam_lr']:g})",
    "orthogonal": f"constrained(adam({hp['adam_lr']:g})), per-head Orthogonal q/k/v/out",
    "unit_norm": f"constrained(adam({hp['adam_lr']:g})), nGPT UnitNorm",
    "c_cola_ud": f"c_cola_ud(h={hp['h']:g}, friction={hp['friction']:g}, r={hp['radius']:g}, "
    f"free=adam({hp['adam_lr']:g}))",
  }[name]


def characters(data_dir: str | None, synthetic: bool) -> tuple[list[np.ndarray], dict]:
  """Train, validation and test character ids and what they are."""
  if synthetic:
    splits = [[" ".join(line) for line in lines] for lines in text.synthetic_lines()]
  else:
    splits = text.split_kjv(text.kjv_verses(data_dir))
  streams = ["\n".join(verses) + "\n" for verses in splits]
  alphabet = sorted(set(streams[0]))
  index = {c: i for i, c in enumerate(alphabet)}
  ids = [np.array([index[c] for c in s], np.int32) for s in streams]
  info = {
    "source": "synthetic stand-in" if synthetic else "King James Bible (Debian bible-kjv), gen1:1-rev22:21",
    "synthetic": synthetic,
    "split": f"blocks of {text.KJV_BLOCK} verses; of every {text.KJV_CYCLE}, {text.KJV_CYCLE - 2} train, 1 valid, "
    "1 test; verses joined by newlines",
    "characters": {k: len(a) for k, a in zip(("train", "valid", "test"), ids)},
    "vocab_size": len(alphabet),
  }
  return ids, info


def windows(ids: list[np.ndarray], batch: int, length: int):
  """The training windows, and the first ``EVAL_WINDOWS`` validation and test windows of ``EVAL_COLUMNS``."""
  held_out = [tuple(a[:EVAL_WINDOWS] for a in text.windows(i, EVAL_COLUMNS, length)) for i in ids[1:]]
  return (text.windows(ids[0], batch, length), *held_out)


def residuals(run: lm.LMRun) -> list[float] | None:
  """Per seed, the largest ``cola.constraint_residuals`` over the constrained leaves; None without constraints."""
  params, opt_state = run.carry[:2]
  try:
    found = jax.vmap(cola.constraint_residuals)(params, opt_state)
  except ValueError:  # Adam: no cola state
    return None
  return [float(v) for v in np.max(np.stack(jax.tree.leaves(found)), axis=0)]


def constrained_leaves(name: str, hp: dict, params) -> list[str]:
  """The paths of the leaves ``name`` constrains."""
  state = make_method(name, hp).init(params)
  try:
    found = cola.constraint_residuals(params, state)
  except ValueError:
    return []
  flat = jax.tree_util.tree_flatten_with_path(found, is_leaf=lambda x: x is None)[0]
  return [models.param_path(p) for p, v in flat if v is not None]


def training_step(model: FunctionalGPT, tx: optax.GradientTransformation):
  """``(params, state, x, y) -> (params, state, x, y)``: the loss, its gradient, the update, applied."""

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), y).mean()

  def step(params, state, x, y):
    updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
    return optax.apply_updates(params, updates), state, x, y

  return jax.jit(step, donate_argnums=(0, 1))


def step_costs(model, params, batch, hp: dict, methods, args) -> dict:
  """Per method: optimizer state bytes, compile cost and memory of one seed's step, its time interleaved with
  Adam's (``args.repetitions`` pairs at most, ``args.budget`` seconds); each as a ratio to Adam's."""
  adam = make_method("adam", hp)
  fresh = lambda tree: jax.tree.map(jnp.copy, tree)
  options = SMOKE_COMPILER_OPTIONS if args.smoke else None
  adam_step = lambda: (training_step(model, adam), fresh(params), adam.init(params), *batch)
  if not args.smoke:
    compile_cost(*adam_step())  # the compiler's first use
  base, base_cost = compile_cost(*adam_step(), compiler_options=options)
  memory = lambda c: c["argument_bytes"] + c["temp_bytes"]
  out = {}
  for name in methods:
    tx = make_method(name, hp)
    compiled, cost = compile_cost(
      training_step(model, tx), fresh(params), tx.init(params), *batch, compiler_options=options
    )
    carries = ((fresh(params), tx.init(params), *batch), (fresh(params), adam.init(params), *batch))
    timed = pair_summary(*measure_pair((compiled, base), carries, 2, args.repetitions, args.budget))
    out[name] = {
      "state_bytes": tree_bytes(tx.init(params)),
      **{k: cost[k] for k in ("argument_bytes", "temp_bytes")},
      **against_adam(cost, base_cost, timed),
    }
    out[name]["ratios"]["memory"] = memory(cost) / memory(base_cost)
    print(
      f"{name:12s} step {timed['method_ms']:.1f} ms vs Adam {timed['baseline_ms']:.1f} ms "
      f"({timed['ratio']:.2f}x), compile {out[name]['ratios']['compile_cpu']:.2f}x (CPU s), "
      f"memory {out[name]['ratios']['memory']:.2f}x",
      flush=True,
    )
  return out


def parse_args(argv):
  p = cli_parser()
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.seeds, args.batch, args.length = (SMOKE[k] for k in ("steps", "seeds", "batch", "length"))
    args.repetitions, args.budget = 2, 0.5
  args.methods = ("adam", *cli.choices(METHODS[1:])(args.methods))
  args.model = {**MODEL, **(SMOKE["model"] if args.smoke else {})}
  if min(args.steps, args.seeds, args.batch, args.length, args.eval_every) < 1:
    p.error("--steps, --seeds, --batch, --length and --eval-every must be positive")
  args.hp = {k: getattr(args, k) for k in DEFAULTS}
  return args


def cli_parser():
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--methods", default=",".join(METHODS[1:]), help="comma list of methods against adam")
  p.add_argument("--steps", type=int, default=300, help="training steps")
  p.add_argument("--seeds", type=int, default=3, help="seeds 0..seeds-1, vmapped")
  p.add_argument("--batch", type=int, default=16, help="training columns")
  p.add_argument("--length", type=int, default=64, help="characters per window")
  p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
  for key, value in DEFAULTS.items():
    p.add_argument("--" + key.replace("_", "-"), type=float, default=value)
  p.add_argument("--repetitions", type=int, default=40, help="timed pairs of steps per method at most")
  p.add_argument("--budget", type=float, default=20.0, help="seconds of timing per method at most")
  p.add_argument("--sweep", action="store_true", help="seed 0 over the grids of learning rates and (h, friction)")
  p.add_argument("--data-dir", help="folder of kjv.txt (`bible -f` output); default: run `bible`")
  p.add_argument("--out", default=None, help="default results/comparisons (a --smoke run: a new temporary folder)")
  p.add_argument("--smoke", action="store_true", help="a 1-block width-16 model, 4 steps, synthetic text: seconds")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  return p


def train(runs: dict, model, data, seeds, txs: dict, args, header: str, after_round=lambda: None) -> dict:
  """``runs`` filled with the runs of ``txs`` (name -> optimizer), trained ``args.steps`` steps, methods
  interleaved, ``after_round()`` after each chunk."""
  runs.update({name: lm.LMRun(model=model, tx=tx, data=data, seeds=seeds) for name, tx in txs.items()})
  for run in runs.values():
    run.compile(SMOKE_COMPILER_OPTIONS if args.smoke else None)
  schedule = lm.eval_schedule(args.steps, args.eval_every)
  lm.train(runs, schedule, quiet=args.quiet, header=header, after_round=after_round)
  return runs


def sweep(model, data, args, config, write) -> dict:
  """Seed 0: Adam at each of ``ADAM_LRS``, then c-CoLA-ud at each ``(h, friction)`` of ``CCOLA_GRID`` with Adam's
  best on its free leaves."""
  final = lambda run: float(run.history["valid_loss"][-1][0])
  adam_runs = {f"adam_lr{lr:g}": optax.adam(lr) for lr in ADAM_LRS}
  found = train({}, model, data, [0], adam_runs, args, "sweep: Adam's learning rate")
  results = {k: final(r) for k, r in found.items()}
  hp = {**args.hp, "adam_lr": min(ADAM_LRS, key=lambda lr: results[f"adam_lr{lr:g}"])}
  ccola_runs = {
    f"c_cola_ud_h{h:g}_g{g:g}": make_method("c_cola_ud", {**hp, "h": h, "friction": g}) for h, g in CCOLA_GRID
  }
  found = train({}, model, data, [0], ccola_runs, args, f"sweep: (h, friction), free=adam({hp['adam_lr']:g})")
  results.update({k: final(r) for k, r in found.items()})
  h, g = min(CCOLA_GRID, key=lambda hg: results[f"c_cola_ud_h{hg[0]:g}_g{hg[1]:g}"])
  return write(
    "gpt_sweep.json",
    seeds=[0],
    grid={"adam_lr": ADAM_LRS, "c_cola_ud_h_friction": CCOLA_GRID},
    final_valid_loss=results,
    chosen={"adam_lr": hp["adam_lr"], "h": h, "friction": g},
  )


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  started = time.perf_counter()
  out_dir = report.output_dir(args.out or (None if args.smoke else "results/comparisons"), "gpt")
  try:
    ids, info = characters(args.data_dir, args.smoke)
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  model = FunctionalGPT(info["vocab_size"], args.length, **args.model)
  data = windows(ids, args.batch, args.length)
  seeds = list(range(args.seeds))
  params = jax.tree.map(lambda a: a[0], lm.init_params(model, (0,), args.length))
  config = {
    **{k: getattr(args, k) for k in ("steps", "batch", "length", "eval_every", "smoke")},
    "model": {
      **args.model,
      "d_ff": 4 * args.model["width"],
      "dropout": 0.0,
      "parameters": sum(int(a.size) for a in jax.tree.leaves(params)),
    },
    "eval": f"the first {EVAL_WINDOWS} windows of {EVAL_COLUMNS} columns of each split",
    "hyperparameters": args.hp,
    "costs": "seed 0's jitted step (loss, gradient, update, apply; parameters and state donated) at one training "
    "window: compile_s and compile_cpu_s of lower().compile() after Adam's compile paid the compiler's first use; "
    "memory: XLA's argument bytes (parameters, optimizer state, batch) plus temporaries; step: medians of "
    "interleaved pairs with Adam's step after 2 warm-up calls; ratios to Adam's in this process",
    "residual": "per seed, the largest cola.constraint_residuals over the constrained leaves after the last step",
  }

  def write(name, **body):
    return records.write_report(out_dir, name, argv, started, config, data=info, **body)

  if args.sweep:
    return sweep(model, data, args, config, write)
  constrained = {name: constrained_leaves(name, args.hp, params) for name in args.methods}
  costs = step_costs(model, params, (data[0][0][0], data[0][1][0]), args.hp, args.methods[1:], args)
  runs = {}

  def write_results(status: str) -> dict:
    results = {name: perplexity.entry(run) for name, run in runs.items()}
    for name, r in results.items():
      if r:
        r["residual"] = residuals(runs[name]) if status == "complete" else None
    return write(
      "gpt.json",
      status=status,
      seeds=seeds,
      methods={name: describe(name, args.hp) for name in args.methods},
      constrained_leaves=constrained,
      results=results,
      summary={name: perplexity.summary(r) for name, r in results.items() if r},
      costs=costs,
    )

  txs = {name: make_method(name, args.hp) for name in args.methods}
  header = f"{info['source']}: {info['characters']} characters, vocab {info['vocab_size']}"
  train(runs, model, data, seeds, txs, args, header, functools.partial(write_results, "running"))
  out = write_results("complete")
  plot(out, os.path.join(out_dir, "gpt.png"))
  print(table(out))
  print(f"wall time {out['meta']['wall_time_s']:.0f} s")
  return out


if __name__ == "__main__":
  main()
