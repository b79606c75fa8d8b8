"""A first look at the paper's effect in a few minutes of CPU: deep nets that SGD cannot train.

The paper (Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization
of Neural Networks*, Figs. 2-3) trains MLPs of growing depth on a 4-turn spiral.
With the standard (PyTorch) initialisation, plain SGD stops learning once the
net is deep: the signal vanishes through the layers and the training loss stays
at log 2, a coin toss. o-CoLA-od keeps every hidden-to-hidden kernel
orthonormal at every step (Langevin dynamics constrained to the Stiefel
manifold), so the signal keeps its size and the same net trains.

This script runs that comparison at one depth (default 8 hidden layers of
100 ReLU units, 400 epochs: a few minutes on 2 CPU cores), a few seeds at once, prints the table and writes the JSON
(with the versions and the machine) and a PNG of the curves to ``--out`` (default: a new temporary folder)::

    python -m benchmarks.paper.demo
    python -m benchmarks.paper.demo --depth 10 --epochs 600 --seeds 5 --out /tmp/demo
    python -m benchmarks.paper.demo --out results/paper  # replaces results/paper/demo.json, which the docs quote

``benchmarks/paper/spiral.py`` runs the paper's full sweep (depths 1-10, four methods).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from benchmarks.harness import data, report, train
from benchmarks.paper import spiral

METHODS = {"sgd": "SGD, standard init", "ocola_od": "o-CoLA-od (orthonormal hidden kernels)"}


def parse_args(argv):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--depth", type=int, default=8, help="hidden layers of 100 ReLU units")
  p.add_argument("--epochs", type=int, default=400, help="training epochs (20 steps of batch 25 each)")
  p.add_argument("--seeds", type=int, default=3, help="seeds per method, trained at once with jax.vmap")
  p.add_argument("--out", default=None, help="output folder; default a new temporary folder")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  if args.depth < 2 or args.seeds < 1 or args.epochs < 10 or args.epochs % 10:
    p.error("--depth must be at least 2, --seeds positive, --epochs a positive multiple of 10")
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  out_dir = report.output_dir(args.out, "cola-demo")
  start = time.perf_counter()
  print(
    f"Training a {args.depth}-hidden-layer ReLU MLP (100 units per layer) on the paper's 4-turn spiral\n"
    f"(500 training, 1000 test points), {args.seeds} seeds per method, {args.epochs} epochs of SGD steps\n"
    f"h = 0.1 on minibatches of 25:\n"
    f"  - {METHODS['sgd']}: expected to stay near a training loss of log 2 = 0.693 (50 %, a coin\n"
    f"    toss) for hundreds of epochs at this depth, the signal vanishing through the layers;\n"
    f"  - {METHODS['ocola_od']}: the same net, the same steps, but the hidden\n"
    f"    kernels kept orthonormal: expected to train.\n"
  )
  dataset = data.spiral()
  bar = report.progress(2 * 10, args.quiet)
  runs = {
    group: spiral.group_run(group, [name], args.depth, dataset, seeds=args.seeds, eval_every=args.epochs // 10)
    for group, name in (("sgd", "sgd"), ("ocola", "ocola_od"))
  }
  train.train(runs, args.epochs, progress=bar)
  bar.close()
  results = {name: report.entry(run.rows(slice(None))) for name, run in zip(METHODS, runs.values())}
  results["ocola_od"]["max_orthogonality_defect"] = report.finite_list(
    runs["ocola"].history["max_orthogonality_defect"][-1]
  )
  rows = [
    [METHODS[m], report.pm(r["train_loss"]), report.pm(r["test_loss"]), report.pm(r["test_accuracy"], 100, 1)]
    for m, r in results.items()
  ]
  print(report.table(rows, ["method", "train loss", "test loss", "test accuracy (%)"]))
  out = {
    "experiment": "deep spiral (Leimkuhler et al., Figs. 2-3): SGD vs o-CoLA-od at one depth",
    "config": {
      "depth": args.depth,
      "width": 100,
      "epochs": args.epochs,
      "seeds": args.seeds,
      "learning_rate": 0.1,
      "batch_size": 25,
      "n_train": 500,
      "n_test": 1000,
    },
    "methods": METHODS,
    "results": results,
    "summary": {m: report.summary(r) for m, r in results.items()},
    **report.provenance(argv, start, packages=("flax",)),
  }
  json_path, png_path = os.path.join(out_dir, "demo.json"), os.path.join(out_dir, "demo.png")
  report.write_json(json_path, out)
  report.plot_curves(
    png_path,
    [("train_loss", "training loss (BCE)"), ("test_accuracy", "test accuracy")],
    results,
    METHODS,
    f"4-turn spiral, {args.depth} hidden layers of 100 ReLU units, {args.seeds} seeds (mean ± std)",
  )
  (sgd_acc, sgd_loss), (ocola_acc, ocola_loss) = (
    (np.mean(results[m]["test_accuracy"]) * 100, np.mean(results[m]["train_loss"])) for m in METHODS
  )
  print(
    f"\nShown in {out['wall_time_s']:.0f} s: with {args.depth} hidden layers, after {args.epochs} epochs, "
    f"o-CoLA-od reaches {ocola_acc:.1f} % test accuracy (train loss {ocola_loss:.3f}) and standard-init SGD "
    f"{sgd_acc:.1f} % (train loss {sgd_loss:.3f}; chance is 50 %, log 2 = 0.693). "
    f"Curves: {png_path}; numbers: {json_path}"
  )
  return out


if __name__ == "__main__":
  main()
