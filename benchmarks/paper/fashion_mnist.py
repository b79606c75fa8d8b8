"""The paper's Fashion-MNIST experiment (Fig. 5, appendix "Circle constraints"): c-CoLA-ud vs SGD-m.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 and the appendix table. The protocol, with the
choices the paper leaves open stated:

* data: Fashion-MNIST IDX files (``--data-dir``; default Debian's
  ``dataset-fashion-mnist`` under ``/usr/share/datasets/fashion-mnist``).
  Training set: the first 10,000 official training images; test set: the other
  60,000 (training images 10,000-59,999, then the official test images).
  Pixels in [0, 1].
* model: 784-1000-10 ReLU MLP, PyTorch's default init; softmax cross-entropy;
  minibatches of 128 reshuffled every epoch, the last one of 16 kept (79 steps
  per epoch, as PyTorch's ``DataLoader(drop_last=False)``).
* methods: ``ccola_ud``, c-CoLA-ud ``h = 0.3, gamma = 1`` at ``tau = 0`` with
  the first kernel in [-0.05, 0.05] and the second in [-0.1, 0.1] (SGD-m
  lr 0.09, momentum 0.741); ``sgdm_h0.1_m0.9``; ``sgdm_h0.1_m0.9_wd``, the
  same with PyTorch's weight decay 1e-4 (added to the gradient of every
  parameter before the momentum). ``--grid`` adds the appendix's SGD-m grid.

Seed ``s`` fixes the init and the minibatch order, the same for every method;
methods advance in turn ``--eval-every`` epochs at a time and the JSON is
rewritten after each round (``status: running``). Usage::

    python -m benchmarks.paper.fashion_mnist --out results/paper  # 5 seeds, 400 epochs
    python -m benchmarks.paper.fashion_mnist --smoke              # seconds; synthetic data if the files are missing
    python -m benchmarks.paper.fashion_mnist --data-dir data/fashion-mnist --grid --out /tmp/fm
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.harness import cli, data, models, report, train

SCHEMA_VERSION = 2
RADII = {"layer0": 0.05, "layer1": 0.1}
CONSTRAINTS = cola.path_constraints([(f"^{layer}/kernel$", cola.Circle(r)) for layer, r in RADII.items()])
GRID = ((0.2, 0.8), (0.2, 0.7), (0.1, 0.9), (0.1, 0.8), (0.1, 0.7), (0.05, 0.95), (0.05, 0.9), (0.05, 0.8))
WEIGHT_DECAY = 1e-4
# Published test accuracy (%) and test loss after 400 epochs, mean of 5 runs: (h, mom) -> without, with WD.
_TABLE = {
  (0.2, 0.8): (87.18, 1.06, 84.05, 0.696),
  (0.2, 0.7): (87.38, 0.890, 87.0, 0.547),
  (0.1, 0.9): (86.97, 1.133, 85.35, 0.634),
  (0.1, 0.8): (87.39, 0.824, 87.47, 0.531),
  (0.1, 0.7): (87.39, 0.750, 87.25, 0.517),
  (0.05, 0.95): (86.67, 1.226, 85.63, 0.623),
  (0.05, 0.9): (87.33, 0.837, 86.24, 0.569),
  (0.05, 0.8): (87.27, 0.719, 87.33, 0.511),
}
MODEL = models.MLP((1000, 10))
SMOKE = {"seeds": 2, "epochs": 2, "eval_every": 1, "n_train": 2000, "n_test": 2000}
LAST_RUN_PARAMS: dict = {}  # main() leaves each method's final parameters here (leading seed axis)


def sgdm_name(h: float, momentum: float, wd: bool) -> str:
  return f"sgdm_h{h:g}_m{momentum:g}" + ("_wd" if wd else "")


PUBLISHED = {"ccola_ud": (87.61, 0.386)}
for (_h, _m), (_a, _l, _aw, _lw) in _TABLE.items():
  PUBLISHED[sgdm_name(_h, _m, False)], PUBLISHED[sgdm_name(_h, _m, True)] = (_a, _l), (_aw, _lw)
DEFAULT_METHODS = ("ccola_ud", sgdm_name(0.1, 0.9, False), sgdm_name(0.1, 0.9, True))
GRID_METHODS = tuple(sgdm_name(h, m, wd) for wd in (False, True) for h, m in GRID)


def parse_method(method: str) -> dict:
  """``'ccola_ud'`` or ``'sgdm_h<lr>_m<mom>[_wd]'`` -> its hyperparameters."""
  if method == "ccola_ud":
    return {"kind": "ccola_ud", "learning_rate": 0.3, "friction": 1.0, "radius": RADII}
  parts = method.split("_")
  try:
    if parts[0] != "sgdm" or parts[1][0] != "h" or parts[2][0] != "m" or parts[3:] not in ([], ["wd"]):
      raise ValueError
    return {
      "kind": "sgdm",
      "lr": float(parts[1][1:]),
      "momentum": float(parts[2][1:]),
      "wd": WEIGHT_DECAY if parts[3:] else 0.0,
    }
  except (ValueError, IndexError):
    raise ValueError(
      f"unknown method {method!r}: 'ccola_ud' or 'sgdm_h<lr>_m<momentum>[_wd]', e.g. {DEFAULT_METHODS[1]}"
    ) from None


def describe(method: str) -> str:
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    return "c-CoLA-ud h=0.3 gamma=1 r=(0.05, 0.1)"
  return f"SGD-m h={spec['lr']:g} mom={spec['momentum']:g}" + (" WD 1e-4" if spec["wd"] else "")


def make_optimizer(method: str) -> optax.GradientTransformation:
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    return cola.cola_ud(spec["learning_rate"], friction=spec["friction"], constraints=CONSTRAINTS)
  sgd = optax.sgd(spec["lr"], momentum=spec["momentum"])
  # PyTorch's SGD weight_decay: g + wd * w enters the momentum buffer.
  return optax.chain(optax.add_decayed_weights(spec["wd"]), sgd) if spec["wd"] else sgd


def init_params(key, member=None):
  return MODEL.init(key, jnp.zeros((1, 28, 28)))["params"]


def max_abs_weight(params) -> dict:
  return {f"max_abs_w_{name}": jnp.max(jnp.abs(layer["kernel"])) for name, layer in params.items()}


def parse_args(argv):
  p = cli.parser(
    "The paper's Fashion-MNIST experiment: c-CoLA-ud vs SGD-m (with and without weight decay) "
    "on a 784-1000-10 ReLU MLP, 10k training and 60k test images (all seeds of a method at once).",
    seeds=5,
    epochs=400,
    out="results/paper/",
    smoke=f"{SMOKE['seeds']} seeds, {SMOKE['epochs']} epochs, {SMOKE['n_train']} train / "
    f"{SMOKE['n_test']} test images; synthetic data when the IDX files are missing",
  )
  p.add_argument(
    "--methods", default=",".join(DEFAULT_METHODS), help="comma list of 'ccola_ud' and 'sgdm_h<lr>_m<momentum>[_wd]'"
  )
  p.add_argument(
    "--grid",
    action="store_true",
    help="add the appendix table's SGD-m grid (8 (h, mom) pairs, with and without WD 1e-4)",
  )
  p.add_argument("--data-dir", default=data.FASHION_MNIST_DIR, help="folder with the four Fashion-MNIST IDX files")
  p.add_argument("--synthetic", action="store_true", help="a synthetic stand-in of the same shapes (testing only)")
  p.add_argument("--n-train", type=int, default=10_000, help="training images (the first of the official set)")
  p.add_argument("--n-test", type=int, default=60_000, help="test images (the following ones)")
  args = p.parse_args(argv)
  if args.smoke:
    args.seeds, args.epochs, args.n_train, args.n_test = (SMOKE[k] for k in ("seeds", "epochs", "n_train", "n_test"))
    args.eval_every = args.eval_every or SMOKE["eval_every"]
  methods = [m.strip() for m in args.methods.split(",") if m.strip()] + (list(GRID_METHODS) if args.grid else [])
  args.methods = tuple(dict.fromkeys(methods))
  for m in args.methods:
    try:
      parse_method(m)
    except ValueError as error:
      p.error(str(error))
  if min(args.seeds, args.n_train, args.n_test) < 1:
    p.error("--seeds, --n-train and --n-test must be positive")
  args.eval_every = cli.eval_every(p, args.epochs, args.eval_every)
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the experiment; writes ``fashion_mnist.json`` and ``.png`` under ``--out``; returns the JSON's dict."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  start = time.perf_counter()
  try:
    dataset = data.fashion_mnist(
      args.data_dir, args.n_train, args.n_test, allow_synthetic=args.smoke, synthetic=args.synthetic
    )
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  out_dir = report.output_dir(args.out if args.out or args.smoke else "results/paper/", "fashion_mnist")
  runs = {
    m: train.Run(
      init_params=init_params,
      apply_fn=lambda p, x: MODEL.apply({"params": p}, x),
      make_tx=lambda member, key, m=m: make_optimizer(m),
      objective=train.SOFTMAX,
      data=dataset,
      members={"seed": np.arange(args.seeds)},
      batch_size=128,
      eval_every=args.eval_every,
      probes=max_abs_weight,
    )
    for m in args.methods
  }
  first = next(iter(runs.values()))
  config = {
    "seeds": args.seeds,
    "epochs": args.epochs,
    "methods": list(args.methods),
    "n_train": args.n_train,
    "n_test": args.n_test,
    "hidden": 1000,
    "batch_size": 128,
    "eval_every": args.eval_every,
    "steps_per_epoch": first.steps_per_epoch,
    "last_batch_size": first.last_batch_size,
    "init": "PyTorch nn.Linear default: W, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); c-CoLA-ud's slack "
    "xi = sqrt(r^2 - w^2) (no weight is clipped: 1/sqrt(784) < 0.05)",
    "ccola_ud": {
      "learning_rate": 0.3,
      "friction": 1.0,
      "radius": RADII,
      "temperature": 0.0,
      "sgd_momentum_equivalent": dict(zip(("learning_rate", "momentum"), cola.langevin_to_sgd_momentum(0.3, 1.0))),
    },
    "weight_decay": f"{WEIGHT_DECAY} on every parameter (biases included), added to the gradient "
    "before momentum, as torch.optim.SGD(weight_decay=...)",
    "pairing": "seed s fixes init and minibatch order, the same for every method",
  }
  json_path, png_path = os.path.join(out_dir, "fashion_mnist.json"), os.path.join(out_dir, "fashion_mnist.png")

  def write(status: str) -> dict:
    results = {}
    for m, run in runs.items():
      if not run.history:
        results[m] = {}
        continue
      history = run.rows(slice(None))
      results[m] = {
        **report.entry(history, finals=("epoch_mean_batch_loss",)),
        "max_abs_weight": {k: report.finite_list(history[f"max_abs_w_{k}"][-1]) for k in RADII},
        "compile_time_s": run.compile_s,
        "run_time_s": run.run_s,
        "time_per_epoch_s": run.run_s / run.epochs_done,
        "hyperparameters": parse_method(m),
      }
    out = {
      "schema_version": SCHEMA_VERSION,
      "experiment": "Fashion-MNIST (Leimkuhler et al., Constraint-Based Regularization of Neural Networks, "
      "Fig. 5 and appendix 'Circle constraints' table)",
      "status": status,
      "config": {**config, "epochs_completed": min(r.epochs_done for r in runs.values())},
      "data": dataset.info,
      "methods": {m: describe(m) for m in args.methods},
      "seeds": list(range(args.seeds)),
      "results": results,
      "summary": {m: report.summary(r) for m, r in results.items() if r},
      "published": {
        m: {"test_accuracy_percent": PUBLISHED[m][0], "test_loss": PUBLISHED[m][1]}
        for m in args.methods
        if m in PUBLISHED
      },
      **report.provenance(argv, start, packages=("flax",)),
    }
    report.write_json(json_path, out)
    report.plot_curves(
      png_path,
      [("test_loss", "test loss (cross-entropy)"), ("test_accuracy", "test accuracy")],
      {m: r for m, r in results.items() if r},
      {m: describe(m) for m in args.methods},
      f"{'SYNTHETIC stand-in' if dataset.info['synthetic'] else 'Fashion-MNIST'}, {args.n_train} "
      f"train / {args.n_test} test images, 784-1000-10 ReLU MLP, batch 128, {args.seeds} seeds",
    )
    return out

  bar = report.progress(len(runs) * (args.epochs // args.eval_every), args.quiet)
  train.train(runs, args.epochs, progress=bar, after_round=lambda epoch: write("running"))
  bar.close()
  LAST_RUN_PARAMS.clear()
  LAST_RUN_PARAMS.update({m: run.params for m, run in runs.items()})
  out = write("complete")
  rows = [
    [
      describe(m),
      report.pm(r["test_accuracy"], 100, 2),
      report.pm(r["best_test_accuracy"], 100, 2),
      report.pm(r["test_loss"]),
      report.pm(r["min_test_loss"]),
      f"{PUBLISHED[m][0]:.2f} % / {PUBLISHED[m][1]:.3f}" if m in PUBLISHED else "-",
    ]
    for m, r in out["results"].items()
  ]
  print(report.table(rows, ["method", "test acc %", "best test acc %", "test loss", "min test loss", "published"]))
  print(
    ("NOTE: synthetic stand-in data, not Fashion-MNIST\n" if dataset.info["synthetic"] else "")
    + f"wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}"
  )
  return out


if __name__ == "__main__":
  main()
