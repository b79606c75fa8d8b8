"""Orthogonal convolutions: o-CoLA-ud against SGD-m (the paper's ResNet-34 / CIFAR-10 experiment).

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 (figure ``OG-OBA_Resnet``) and Appendix C: a
ResNet-34 with BatchNorm on CIFAR-10, 150 epochs, batch 128, SGD-m lr 0.1
(/ 10 every 50 epochs), momentum 0.9, with and without weight decay, against
o-CoLA-ud (gamma = 0.5, tau = 0, no weight decay) with its step size "re-scaled
to match the parameters of SGD-m". The paper shows curves only: o-CoLA-ud
without weight decay strongly ahead of SGD-m without. Here:

* models (``--model``, :mod:`harness.vision`): ``small`` (default), a CPU-sized
  3-conv CNN for 28x28x1 images, or ``resnet18`` / ``resnet34`` (CIFAR-style,
  BatchNorm, ``--width`` x (1, 2, 4, 8) channels); PyTorch's init.
* constraints: every conv kernel but the stem ``conv0`` orthonormal (the
  ``(kh*kw*in, out)`` matrix; orthonormal rows when wide), declared by path. The
  paper does not say which layers; a free input layer follows its spiral
  experiment. Dense layer, biases and BatchNorm are free.
* methods, all from the same init per seed (o-CoLA-ud's first update projects
  each constrained kernel onto its polar factor): ``ocola_ud`` with ``h =
  sqrt(lr)`` on SGD-m's schedule (gamma = 0.5 is SGD momentum 0.854, then 0.951,
  0.984 after the decays); ``sgdm``; ``sgdm_wd``, weight decay 5e-4 (the usual
  CIFAR-10 value; the paper gives none) added to the gradient, as PyTorch's.
* schedule: lr / 10 after epochs round(E/3) and round(2E/3) (``--decay-epochs``).
* data (:mod:`harness.images`): ``fashion_mnist`` (default for ``small``), the
  first ``--n-train`` (10,000) official training images, the official test set;
  ``cifar10`` (default for the ResNets), the batches in ``--data-dir``,
  standardised per channel, training batches randomly cropped (padding 4) and
  flipped. Minibatches of 128, full ones only (BatchNorm sees whole batches).

Seed ``s`` fixes init, minibatch order and augmentation for every method. Seeds
run one after another, a jitted call per step (:mod:`harness.stepwise`). Usage::

    python -m benchmarks.paper.orthogonal_cnn --out results/paper       # small CNN, 3 seeds, 18 epochs
    python -m benchmarks.paper.orthogonal_cnn --smoke --model resnet18  # into a temporary folder
    python -m benchmarks.paper.orthogonal_cnn --model resnet34 --data-dir DIR --epochs 150 --seeds 5 --out DIR
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import numpy as np
import optax

import cola_jax as cola
from benchmarks.harness import cli, data, images, models, records, report, schedules, stepwise, train, vision

SCHEMA_VERSION = 1
METHODS = ("ocola_ud", "sgdm", "sgdm_wd")
SGD_LR, MOMENTUM, FRICTION, DECAY_FACTOR, WEIGHT_DECAY = 0.1, 0.9, 0.5, 0.1, 5e-4  # weight decay: not in the paper
ORTHOGONAL = cola.path_constraints([(r"^conv0/", None), (r"conv\w*/kernel$", cola.Orthogonal())])
SGD = f"SGD-m lr={SGD_LR:g} mom={MOMENTUM:g}"
DESCRIBE = {
  "ocola_ud": f"o-CoLA-ud h={math.sqrt(SGD_LR):.3f} gamma={FRICTION:g} tau=0",
  "sgdm": SGD,
  "sgdm_wd": f"{SGD} WD {WEIGHT_DECAY:g}",
}
SMOKE = {"seeds": 2, "epochs": 2, "n_train": 256, "n_test": 256, "batch_size": 64, "width": 4}
PANELS = [("train_loss", "train loss (minibatches)"), ("test_loss", "test loss"), ("test_accuracy", "test accuracy")]
LAST_RUNS: dict = {}  # main() leaves each method's stepwise.Run per seed here


def make_optimizer(method: str, steps_per_epoch: int, decay_epochs: Sequence[int]) -> optax.GradientTransformation:
  """The method's optax transformation with the paper's step decay (``h`` / sqrt(10) where lr / 10)."""
  if method == "ocola_ud":
    h = schedules.step_decay(math.sqrt(SGD_LR), steps_per_epoch, decay_epochs, math.sqrt(DECAY_FACTOR))
    return cola.cola_ud(h, friction=FRICTION, constraints=ORTHOGONAL)
  sgd = optax.sgd(schedules.step_decay(SGD_LR, steps_per_epoch, decay_epochs, DECAY_FACTOR), momentum=MOMENTUM)
  return optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), sgd) if method == "sgdm_wd" else sgd


def kernel_entry(runs: Sequence[stepwise.Run], method: str) -> dict:
  """Per conv kernel and seed, ``max |Q^T Q - I|`` now and at init; the init's norm; o-CoLA-ud's residuals."""
  per_seed = lambda dicts: {k: [d[k] for d in dicts] for k in dicts[0]}
  l2 = lambda tree: float(np.sqrt(sum(np.sum(np.asarray(p, np.float64) ** 2) for p in jax.tree.leaves(tree))))
  out = {
    "orthogonality_defect": per_seed([vision.orthogonality_defects(r.params) for r in runs]),
    "init_orthogonality_defect": per_seed([vision.orthogonality_defects(r.init_variables[0]) for r in runs]),
    "init_param_l2": [l2(r.init_variables[0]) for r in runs],
  }
  if method == "ocola_ud":
    flat = [jax.tree_util.tree_flatten_with_path(cola.constraint_residuals(r.params, r.carry[2]))[0] for r in runs]
    out["constraint_residuals"] = per_seed([{models.param_path(p): float(v) for p, v in f} for f in flat])
  return out


def summarize(results: dict) -> dict:
  """Mean and standard deviation over the seeds of each method's entry, and o-CoLA-ud's largest residual."""
  summary = {m: report.summary(r) for m, r in results.items() if r}
  for m, r in results.items():
    if "constraint_residuals" in r:
      summary[m]["max_constraint_residual"] = max(max(v) for v in r["constraint_residuals"].values())
  return summary


def draw(out: dict, png_path: str) -> None:
  config = out["config"]
  report.plot_curves(
    png_path,
    PANELS,
    {m: r for m, r in out["results"].items() if r},
    out["methods"],
    f"{config['model']} on {'SYNTHETIC ' if out['data']['synthetic'] else ''}{config['dataset']} "
    f"({config['n_train']} train / {config['n_test']} test images), batch {config['batch_size']}, lr / 10 at epochs "
    f"{list(config['decay_epochs'])} (dotted), {len(out['seeds'])} seeds",
    marks=config["decay_epochs"],
  )


def merge(paths: Sequence[str], out_dir: str) -> dict:
  """Joins runs of one protocol that split the seeds (``--first-seed``) into ``out_dir``."""
  parts = [records.load_json(p) for p in paths]
  out = records.join_seeds(parts)
  out["summary"] = summarize(out["results"])
  os.makedirs(out_dir, exist_ok=True)
  report.write_json(os.path.join(out_dir, "orthogonal_cnn.json"), out)
  draw(out, os.path.join(out_dir, "orthogonal_cnn.png"))
  print(f"joined seeds {out['seeds']} into {out_dir}")
  return out


def parse_args(argv):
  p = cli.parser(
    "Orthogonal convolutions: o-CoLA-ud (every conv kernel but the first orthonormal) against SGD-m with "
    "and without weight decay; the paper's ResNet-34 / CIFAR-10 set-up, or a small CNN on Fashion-MNIST.",
    seeds=3,
    epochs=18,
    eval_every=1,
    out="results/paper/",
    smoke=", ".join(f"{k.replace('_', ' ')} {v}" for k, v in SMOKE.items())
    + "; synthetic data when the data files are missing",
  )
  p.add_argument("--model", choices=("small", *vision.RESNET_STAGES), default="small", help="the CNN or a ResNet")
  p.add_argument("--dataset", choices=tuple(images.SHAPES), help="default: fashion_mnist for small, else cifar10")
  p.add_argument("--data-dir", help=f"Fashion-MNIST IDX files (default {data.FASHION_MNIST_DIR}) or CIFAR-10 batches")
  p.add_argument("--synthetic", action="store_true", help="synthetic stand-in data (testing only)")
  p.add_argument(
    "--decay-epochs", type=cli.int_list, help="lr / 10 after these epochs; default round(E/3), round(2E/3)"
  )
  p.add_argument(
    "--methods", type=cli.choices(METHODS), default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}"
  )
  p.add_argument("--n-train", type=int, help="training images, the first ones (default 10000; cifar10 50000)")
  p.add_argument("--n-test", type=int, default=10_000, help="test images (the official test set)")
  p.add_argument("--batch-size", type=int, default=128, help="minibatch size (the paper's 128)")
  p.add_argument("--width", type=int, default=64, help="ResNet channels of the first stage")
  p.add_argument("--no-augment", action="store_true", help="no random crop and flip on CIFAR-10")
  cli.first_seed_flag(p)
  cli.merge_flag(p, "join runs of one protocol that split the seeds into --out")
  args = p.parse_args(argv)
  if args.merge and not args.out:
    p.error("--merge needs --out")
  args.dataset = args.dataset or ("fashion_mnist" if args.model == "small" else "cifar10")
  args.n_train = args.n_train or (10_000 if args.dataset == "fashion_mnist" else 50_000)
  if args.smoke:
    for k, v in SMOKE.items():
      setattr(args, k, v)
  if min(args.seeds, args.n_test, args.width, args.batch_size) < 1 or args.n_train < args.batch_size:
    p.error("--seeds, --n-test, --width, --batch-size must be positive and --n-train >= --batch-size")
  args.seed_list = cli.seed_list(p, args)
  args.eval_every = cli.eval_every(p, args.epochs, args.eval_every)
  args.decay_epochs = tuple(schedules.thirds(args.epochs) if args.decay_epochs is None else args.decay_epochs)
  args.augment = args.dataset == "cifar10" and not args.no_augment
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the comparison; writes ``orthogonal_cnn.json`` and ``.png`` under ``--out``; returns the JSON's dict."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args, start = parse_args(argv), time.perf_counter()
  if args.merge:
    return merge(args.merge, args.out)
  try:
    dataset = images.image_dataset(
      args.dataset, args.data_dir, args.n_train, args.n_test, synthetic=args.synthetic, allow_synthetic=args.smoke
    )
  except (FileNotFoundError, ValueError) as error:
    sys.exit(f"error: {error}")
  out_dir = report.output_dir(args.out if args.out or args.smoke else "results/paper/", "orthogonal_cnn")
  stats = images.channel_stats(dataset.x_train) if args.dataset == "cifar10" else (np.zeros(1), np.ones(1))
  model, on_device = vision.model(args.model, args.width), stepwise.device_data(dataset)
  steps_per_epoch = args.n_train // args.batch_size
  runs = {}
  for m in args.methods:
    tx = make_optimizer(m, steps_per_epoch, args.decay_epochs)
    augment = images.crop_and_flip if args.augment else None
    fns = stepwise.method(model, tx, dataset.x_train.shape[1:], args.batch_size, images.scaler(*stats), augment)
    runs[m] = [stepwise.Run(fns, seed, on_device, args.eval_every) for seed in args.seed_list]
  params0 = runs[args.methods[0]][0].init_variables[0]
  h_phases = [math.sqrt(SGD_LR * DECAY_FACTOR**i) for i in range(len(args.decay_epochs) + 1)]
  sgd_equivalent = [
    dict(zip(("learning_rate", "momentum"), cola.langevin_to_sgd_momentum(h, FRICTION))) for h in h_phases
  ]
  keys = ("model", "dataset", "seeds", "epochs", "decay_epochs", "methods", "n_train", "n_test", "batch_size")
  config = {
    **{k: getattr(args, k) for k in (*keys, "eval_every", "width", "augment")},
    "eval_batch": 1000,
    "steps_per_epoch": steps_per_epoch,
    "images_skipped_per_epoch": args.n_train - steps_per_epoch * args.batch_size,
    "pixel_mean": stats[0].tolist(),
    "pixel_std": stats[1].tolist(),
    "n_parameters": int(sum(np.size(p) for p in jax.tree.leaves(params0))),
    "constrained_kernels": [
      models.param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(ORTHOGONAL(params0))[0]
    ],
    "free_conv_kernel": "conv0/kernel",
    "constraints": repr(ORTHOGONAL),
    "init": "PyTorch default U(+-1/sqrt(fan_in)) for kernels and biases, BatchNorm (1, 0); the same parameters "
    "for every method; o-CoLA-ud's first update replaces each constrained kernel by its polar factor",
    "ocola_ud": dict(
      learning_rate=h_phases, friction=FRICTION, temperature=0.0, sgd_momentum_equivalent=sgd_equivalent
    ),
    "sgdm": {"learning_rate": SGD_LR, "momentum": MOMENTUM, "decay_factor": DECAY_FACTOR},
    "weight_decay": f"{WEIGHT_DECAY} on every parameter for sgdm_wd (PyTorch SGD weight_decay)",
    "paper": dict(
      model="ResNet-34 with BatchNorm", dataset="CIFAR-10", epochs=150, decay_epochs=[50, 100], batch_size=128, seeds=5
    ),
    "pairing": "seed s fixes init, minibatch order and augmentation, the same for every method",
  }
  json_path, png_path = os.path.join(out_dir, "orthogonal_cnn.json"), os.path.join(out_dir, "orthogonal_cnn.png")

  def write(status: str) -> dict:
    results = {m: {**stepwise.entry(r), **kernel_entry(r, m)} if r[0].epochs_done else {} for m, r in runs.items()}
    out = {
      "schema_version": SCHEMA_VERSION,
      "experiment": "orthogonal convolutions, o-CoLA-ud vs SGD-m (Leimkuhler et al., Constraint-Based "
      "Regularization of Neural Networks, Sec. 4 ResNet-34 / CIFAR-10 figure and Appendix C)",
      "status": status,
      "config": {**config, "epochs_completed": min(r[0].epochs_done for r in runs.values())},
      "data": dataset.info,
      "methods": {m: DESCRIBE[m] for m in args.methods},
      "seeds": args.seed_list,
      "results": results,
      "summary": summarize(results),
      **report.provenance(argv, start, packages=("flax",)),
    }
    report.write_json(json_path, out)
    draw(out, png_path)
    return out

  def after_round(epoch: int) -> None:
    means = write("running")["summary"].items()
    bar.write(
      f"epoch {epoch:4d}  test acc/loss  "
      + "  ".join(f"{m}: {100 * s['test_accuracy_mean']:.2f}%/{s['test_loss_mean']:.3f}" for m, s in means)
    )

  seed_runs = {f"{m} seed {r.seed}": r for m, rs in runs.items() for r in rs}
  bar = report.progress(len(seed_runs) * (args.epochs // args.eval_every), args.quiet)
  train.train(seed_runs, args.epochs, progress=bar, after_round=after_round)
  bar.close()
  LAST_RUNS.clear()
  LAST_RUNS.update(runs)
  out = write("complete")
  rows = [
    [DESCRIBE[m]]
    + [report.pm(r[k], 100, 2) for k in ("test_accuracy", "best_test_accuracy")]
    + [report.pm(r[k]) for k in ("test_loss", "min_test_loss")]
    + [f"{out['summary'][m]['max_constraint_residual']:.1e}" if "constraint_residuals" in r else "-"]
    for m, r in out["results"].items()
  ]
  header = ["method", "final test acc %", "best test acc %", "final test loss", "min test loss", "max|QtQ-I|"]
  note = "NOTE: synthetic stand-in data\n" if dataset.info["synthetic"] else ""
  print(f"\n{report.table(rows, header)}\n{note}wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")
  return out


if __name__ == "__main__":
  main()
