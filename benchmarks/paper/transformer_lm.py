"""The paper's small transformer language model (Table "NLPexp", appendix "NLP"): c-CoLA-ud vs SGD-m.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020). The paper: 2 encoder layers of 2-head self-attention and a
200-node feed-forward network with layer norms, PyTorch's initialisation; the
lowest validation loss in 200 epochs, Penn Treebank (batch 1024) 4.81 for
c-CoLA-ud (``tau = 0, h = 0.4, gamma = 0.5, r = 0.5, r_L = 0.1, r_N = 1, r_A =
1``) against 4.83-4.87 for SGD-m (``h`` 0.1, 0.2 x momentum 0.7, 0.8, 0.9),
Wikitext-2 (batch 128, ``gamma = 1``) 5.09 against 5.13-5.14.

Where the paper is silent, PyTorch's ``word_language_model`` example: the model
(:mod:`harness.transformer`: embedding 200, dropout 0.2, causal mask), the data
(:mod:`harness.text`: contiguous columns, windows of ``bptt = 35`` in order,
validation and test in columns of 10) and ``clip_grad_norm_(0.25)`` before either
optimizer. The radii are declared on parameter paths (``PATHS``): ``r_A`` the
attention kernels, ``r_L`` the feed-forward kernels, ``r_N`` the LayerNorm gains
(which start at the pole ``1 = r_N`` of their circle, where the projected gradient
is zero: c-CoLA-ud's first step puts them 1 % inside, at 0.99, from where the gradient
moves them, as for any weight that starts at its bound, see :class:`cola_jax.Circle`;
the runs before 2026-11-27 kept them at 1), ``r`` the embedding and decoder; biases free. ``ccola_ud`` is SGD-m with lr
0.16, momentum ``exp(-0.4 gamma)``; ``sgdm_h0.1_m0.8`` is the paper's best on
PTB; ``--grid`` adds the table's other five. Corpora: ``kjv`` (offline default,
the King James Bible; batch 128 and ``gamma = 1`` as Wikitext-2), ``ptb``,
``wikitext2``. A step (128 x 35 tokens, 67 GFLOP, mostly the decoder) takes about
1.2 s of CPU time: the default 2 epochs take 10-17 min on 2 cores and compare
early training only; 200 epochs take hours per method on a CPU, minutes on a GPU.
Usage::

    python -m benchmarks.paper.transformer_lm          # KJV, 2 epochs, both methods
    python -m benchmarks.paper.transformer_lm --smoke  # seconds, synthetic corpus, temporary folder
    python -m benchmarks.paper.transformer_lm --corpus ptb --data-dir data/penn --epochs 200
    python -m benchmarks.paper.transformer_lm --merge a/transformer_lm.json b/transformer_lm.json --out DIR
    python -m benchmarks.paper.transformer_lm --replot results/paper/transformer_lm.json
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import optax

import cola_jax as cola
from benchmarks.harness import cli, lm, perplexity, report, text, transformer

SCHEMA_VERSION = 2
CORPUS_SETTINGS = {"ptb": (1024, 0.5), "wikitext2": (128, 1.0), "kjv": (128, 1.0)}  # batch size, c-CoLA-ud gamma
MODEL = {"d_model": 200, "n_heads": 2, "d_ff": 200, "n_layers": 2, "dropout": 0.2}
EVAL_BATCH = 10
CCOLA_H = 0.4
RADII = {"attention": 1.0, "linear": 0.1, "norm": 1.0, "other": 0.5}  # r_A, r_L, r_N, r
PATHS = {
  "attention": r"attention/.*/kernel$",
  "linear": r"linear./kernel$",
  "norm": r"norm./scale$",
  "other": r"^(embedding|decoder)/(embedding|kernel)$",
}
CONSTRAINTS = cola.path_constraints([(PATHS[kind], cola.Circle(r)) for kind, r in RADII.items()])
SGDM_GRID = ((0.1, 0.7), (0.1, 0.8), (0.1, 0.9), (0.2, 0.7), (0.2, 0.8), (0.2, 0.9))
_PUB_SGDM = {"ptb": (4.87, 4.83, 4.84, 4.83, 4.83, 4.83), "wikitext2": (5.13, 5.13, 5.13, 5.13, 5.14, 5.13)}
DEFAULT_EPOCHS = 2
SMOKE = {"seeds": 2, "epochs": 3, "batch_size": 16, "model": {"d_model": 100, "d_ff": 100}}
# --smoke compiles with fewer LLVM passes: 2/3 of the compile time, which dominates a run of seconds.
SMOKE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}
LAST_RUN_PARAMS: dict = {}  # main() leaves each method's final parameters here (leading seed axis)


def sgdm_name(h: float, momentum: float) -> str:
  return f"sgdm_h{h:g}_m{momentum:g}"


PUBLISHED = {  # minimum validation loss, Table "NLPexp"
  corpus: {"ccola_ud": ccola, **{sgdm_name(h, m): v for (h, m), v in zip(SGDM_GRID, _PUB_SGDM[corpus])}}
  for corpus, ccola in (("ptb", 4.81), ("wikitext2", 5.09))
}
DEFAULT_METHODS = ("ccola_ud", sgdm_name(0.1, 0.8))
GRID_METHODS = tuple(sgdm_name(h, m) for h, m in SGDM_GRID)


def parse_method(method: str, friction: float = 1.0) -> dict:
  """``'ccola_ud'`` or ``'sgdm_h<lr>_m<mom>'`` -> its hyperparameters."""
  if method == "ccola_ud":
    sgdm = dict(zip(("learning_rate", "momentum"), cola.langevin_to_sgd_momentum(CCOLA_H, friction)))
    return {
      "kind": "ccola_ud",
      "learning_rate": CCOLA_H,
      "radii": RADII,
      "friction": friction,
      "sgd_momentum_equivalent": sgdm,
    }
  match = re.fullmatch(r"sgdm_h([0-9.eE+-]+)_m([0-9.eE+-]+)", method)
  try:
    return {"kind": "sgdm", "lr": float(match[1]), "momentum": float(match[2])}  # type: ignore[index]
  except (TypeError, ValueError):
    raise ValueError(
      f"unknown method {method!r}: 'ccola_ud' or 'sgdm_h<lr>_m<momentum>', e.g. {DEFAULT_METHODS[1]}"
    ) from None


def describe(method: str, friction: float) -> str:
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    return f"c-CoLA-ud h={CCOLA_H:g} gamma={friction:g} r=0.5 r_L=0.1 r_N=1 r_A=1"
  return f"SGD-m h={spec['lr']:g} mom={spec['momentum']:g}"


def make_optimizer(method: str, friction: float, clip: float) -> optax.GradientTransformation:
  """Gradient clipping (``clip``, 0 = none), then c-CoLA-ud or SGD-m."""
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    tx = cola.cola_ud(CCOLA_H, friction=friction, constraints=CONSTRAINTS)
  else:
    tx = optax.sgd(spec["lr"], momentum=spec["momentum"])
  return optax.chain(optax.clip_by_global_norm(clip), tx) if clip > 0 else tx


def parse_args(argv):
  p = cli.parser(
    "The paper's transformer language model (Table 1): c-CoLA-ud vs SGD-m on a 2-layer, 2-head, 200-unit "
    "transformer; minimum validation loss per method (the paper's 200 epochs: hours per method on a CPU).",
    seeds=1,
    epochs=DEFAULT_EPOCHS,
    out="results/paper/",
    smoke=f"{SMOKE['seeds']} seeds, {SMOKE['epochs']} epochs, batch {SMOKE['batch_size']}, d_model = d_ff = 100, "
    "on a synthetic corpus",
    eval_every_type=float,
    eval_every_help="epochs between evaluations, fractions allowed (default min(1, epochs / 8): at least "
    "8 evaluations, at most one per epoch); plus one at initialisation",
  )
  p.add_argument("--corpus", choices=text.CORPORA, default="kjv", help="kjv (offline); ptb, wikitext2: in --data-dir")
  p.add_argument("--data-dir", help="folder of kjv.txt (`bible -f` output; default: run `bible`), ptb or wiki files")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma list: ccola_ud, sgdm_h<lr>_m<momentum>")
  p.add_argument("--grid", action="store_true", help="add the table's SGD-m grid (h 0.1, 0.2 x mom 0.7, 0.8, 0.9)")
  p.add_argument("--batch-size", type=int, help="training columns (default: ptb 1024, wikitext2 and kjv 128)")
  p.add_argument("--friction", type=float, help="c-CoLA-ud gamma (default: ptb 0.5, wikitext2 and kjv 1)")
  p.add_argument("--bptt", type=int, default=35, help="window length")
  p.add_argument("--clip", type=float, default=0.25, help="global gradient-norm clip (0: none)")
  cli.first_seed_flag(p)
  p.add_argument("--replot", metavar="JSON", help="only redraw the PNG (next to JSON) from a transformer_lm.json")
  cli.merge_flag(p, "join runs that split the methods or the seeds (--first-seed) into --out")
  args = p.parse_args(argv)
  if args.merge and not args.out:
    p.error("--merge needs --out")
  if args.smoke:
    args.seeds, args.epochs, args.batch_size = SMOKE["seeds"], SMOKE["epochs"], args.batch_size or SMOKE["batch_size"]
  args.model = {**MODEL, **(SMOKE["model"] if args.smoke else {})}
  args.methods = cli.method_list(p, args.methods, GRID_METHODS if args.grid else (), parse_method)
  if min(args.seeds, args.epochs, args.bptt, args.batch_size or 1) < 1:
    p.error("--seeds, --epochs, --bptt and --batch-size must be positive")
  args.seed_list = cli.seed_list(p, args)
  if args.eval_every is None:
    args.eval_every = min(1.0, args.epochs / 8)
  elif not args.eval_every > 0:
    p.error("--eval-every must be positive")
  batch_size, friction = CORPUS_SETTINGS[args.corpus]
  args.batch_size, args.friction = args.batch_size or batch_size, friction if args.friction is None else args.friction
  return args


def draw(out: dict, png_path: str) -> None:
  labels = {m: describe(m, out["config"]["friction"]) for m in out["results"]}
  perplexity.show(out, png_path, labels, PUBLISHED.get(out["config"]["corpus_used"], {}))
  print(f"wrote {png_path}")


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the experiment; writes ``transformer_lm.json`` and ``.png`` under ``--out``; returns the JSON's dict."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.replot or args.merge:
    out, out_dir = perplexity.load(args.merge or [args.replot], args.merge and args.out, "transformer_lm.json")
    draw(out, os.path.join(out_dir, "transformer_lm.png"))
    return out
  out_dir = report.output_dir(args.out or (None if args.smoke else "results/paper/"), "transformer_lm")
  start = time.perf_counter()
  try:
    corpus = text.corpus(args.corpus, args.data_dir, synthetic=args.smoke)
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  name = "synthetic" if corpus.info["synthetic"] else args.corpus
  train_windows = text.windows(corpus.train, args.batch_size, args.bptt)
  data = (train_windows, *(text.windows(ids, EVAL_BATCH, args.bptt) for ids in (corpus.valid, corpus.test)))
  model = transformer.TransformerLM(len(corpus.vocab), **args.model)
  new_run = functools.partial(lm.LMRun, model=model, data=data, seeds=args.seed_list, probes=perplexity.max_abs(PATHS))
  runs = {m: new_run(tx=make_optimizer(m, args.friction, args.clip)) for m in args.methods}
  for run in runs.values():
    run.compile(SMOKE_COMPILER_OPTIONS if args.smoke else None)
  steps_per_epoch = len(train_windows[0])
  eval_steps = max(1, round(args.eval_every * steps_per_epoch))
  schedule = lm.eval_schedule(args.epochs * steps_per_epoch, eval_steps)
  config = {
    **{k: getattr(args, k) for k in ("corpus", "seeds", "epochs", "batch_size", "bptt", "eval_every", "clip")},
    "friction": args.friction,
    "methods": list(args.methods),
    "eval_batch_size": EVAL_BATCH,
    **args.model,
    "corpus_used": name,
    "steps_per_epoch": steps_per_epoch,
    "eval_every_steps": eval_steps,
    "tokens_per_step": args.batch_size * args.bptt,
    "constraints": {PATHS[kind]: f"Circle({r:g})" for kind, r in RADII.items()},
    "init": "PyTorch word_language_model TransformerModel (harness/transformer.py); both layers identical",
    "log_vocab_size": math.log(len(corpus.vocab)),
    "pairing": "seed s fixes init and dropout masks, the same for every method; data order fixed",
  }
  json_path = os.path.join(out_dir, "transformer_lm.json")

  def write(status: str) -> dict:
    results = {m: perplexity.entry(run) for m, run in runs.items()}
    for m, r in results.items():
      if r:
        r["hyperparameters"] = parse_method(m, args.friction)
    out = {
      "schema_version": SCHEMA_VERSION,
      "experiment": "Transformer language model (Leimkuhler et al., Constraint-Based Regularization of "
      "Neural Networks, Table 'NLPexp' and appendix 'NLP')",
      "status": status,
      "config": {**config, "epochs_completed": round(min(r.steps[-1] for r in runs.values()) / steps_per_epoch, 4)},
      "data": corpus.info,
      "methods": {m: describe(m, args.friction) for m in args.methods},
      "seeds": args.seed_list,
      "results": results,
      "summary": {m: perplexity.summary(r) for m, r in results.items() if r},
      "published": {
        "min_valid_loss": PUBLISHED,
        "note": "minimum validation loss in 200 epochs, Penn Treebank (batch 1024, gamma 0.5) "
        "and Wikitext-2 (batch 128, gamma 1); none for kjv",
      },
      **report.provenance(argv, start, packages=("flax",)),
    }
    report.write_json(json_path, out)
    return out

  header = f"{name}: {corpus.info['tokens']} tokens, vocab {len(corpus.vocab)}"
  lm.train(runs, schedule, quiet=args.quiet, header=header, after_round=lambda: write("running"))
  LAST_RUN_PARAMS.clear()
  LAST_RUN_PARAMS.update({m: run.params for m, run in runs.items()})
  out = write("complete")
  print()
  draw(out, os.path.join(out_dir, "transformer_lm.png"))
  if corpus.info["synthetic"]:
    print("NOTE: synthetic stand-in corpus, not a real one")
  print(f"wall time {out['wall_time_s']:.1f} s; wrote {json_path}")
  return out


if __name__ == "__main__":
  main()
