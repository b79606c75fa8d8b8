"""The Bayesian Fashion-MNIST experiment (issue 58): constrained underdamped sampling against SG-MCMC and SGD-m.

The paper's SDEs sample ``exp(-V / tau)`` on the manifold; here that is the posterior of a small MLP,
and its predictive is scored against blackjax's unconstrained samplers and two point estimates, every
chain at the same budget of gradient evaluations. The protocol, with the choices stated:

* data: the first 10,000 official Fashion-MNIST training images for training, the next 2,000 for
  validation (the step sizes' tuning only), the 10,000 official test images for testing; pixels in [0, 1].
* model: 784-100-10 ReLU MLP, PyTorch's default init (the same start for every method at a seed);
  likelihood softmax cross-entropy; prior ``N(0, 1)`` on every parameter (on a mean loss over the 10,000
  images: weight decay ``1 / N = 1e-4``, the paper's); the log-density's gradient from
  ``blackjax.sgmcmc.gradients.grad_estimator``, minibatches of 128 drawn from a fresh permutation each
  epoch.
* methods, each chain ``--budget`` gradient evaluations: ``sgdm`` (SGD-m on ``-log posterior / N``, the
  MAP estimate, its learning rate and momentum the best of the paper's appendix grid by validation NLL);
  ``cola_ud`` (the paper's c-CoLA-ud, ``h = 0.3, gamma = 1``, Circle radii 0.05 and 0.1 on the two
  kernels, tau = 0, the same objective); blackjax's ``sgld`` and ``sghmc`` (10 integration steps per call,
  each a gradient evaluation, alpha 0.01); ``cola.sampling.underdamped`` (BAOAB) with Circle (the paper's
  radii), Orthogonal (the hidden kernel) and MaxNorm (Keras' default radius 2 on each kernel's columns)
  constraints, the other leaves unconstrained. Samplers at ``T = 1`` (the posterior) and ``T = 0.01`` (cold:
  on the mean loss ``tau = T / N = 1e-6``, the paper's noisy temperature). Step sizes: :data:`STEP_SIZES`,
  chosen by ``--tune`` (seed 0, validation NLL) from :data:`GRIDS`, its record
  ``results/paper/bayesian_fashion_mnist_tuning.json``.
* predictive: the first half of a chain's steps are burn-in, then ``--samples`` positions evenly spaced
  (the last at the end of the budget), their softmax probabilities averaged; a point estimate is its last
  position. Scores on the test set: accuracy, NLL and the expected calibration error (15 bins).

Usage::

    python -m benchmarks.paper.bayesian_fashion_mnist --out results/paper  # 5 seeds
    python -m benchmarks.paper.bayesian_fashion_mnist --tune --out results/paper  # the step sizes' grids
    python -m benchmarks.paper.bayesian_fashion_mnist --smoke  # seconds; synthetic data if the files are missing
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.harness import cli, data, models, posterior, report

SCHEMA_VERSION = 1
HIDDEN = 100
MODEL = models.MLP((HIDDEN, 10))
COLD = 0.01
TEMPERATURES = (1.0, COLD)
SGHMC_STEPS = 10
# On the log-posterior (N times the mean loss) the paper's c-CoLA-ud step (h = 0.3, gamma = 1 on the mean loss) is
# h = 0.3 / sqrt(N), gamma = sqrt(N): the same SGD-m equivalent (learning rate h**2 N, momentum exp(-gamma h)).
FRICTION = 100.0
RADII = {"layer0": 0.05, "layer1": 0.1}
CONSTRAINTS = {
  "circle": cola.path_constraints([(f"^{layer}/kernel$", cola.Circle(r)) for layer, r in RADII.items()]),
  "orthogonal": cola.path_constraints([("^layer0/kernel$", cola.Orthogonal())]),
  "maxnorm": cola.path_constraints([("^layer[01]/kernel$", cola.MaxNorm(2.0))]),
}
SAMPLERS = ("sgld", "sghmc", *CONSTRAINTS)
METHODS = ("sgdm", "cola_ud", *SAMPLERS)
LABELS = {
  "sgdm": "SGD-m (MAP, tuned)",
  "cola_ud": "c-CoLA-ud optimizer (tau = 0)",
  "sgld": "blackjax sgld",
  "sghmc": f"blackjax sghmc ({SGHMC_STEPS} steps)",
  "circle": "cola underdamped, Circle",
  "orthogonal": "cola underdamped, Orthogonal",
  "maxnorm": "cola underdamped, MaxNorm(2)",
}
# Tuned on the validation set (--tune): SGD-m's (learning rate, momentum), the samplers' step size per temperature.
GRIDS = {
  "sgdm": ((0.2, 0.8), (0.2, 0.7), (0.1, 0.9), (0.1, 0.8), (0.1, 0.7), (0.05, 0.95), (0.05, 0.9), (0.05, 0.8)),
  "sgld": (3e-6, 1e-5, 3e-5, 1e-4),
  "sghmc": (3e-4, 1e-3, 3e-3),
  **dict.fromkeys(CONSTRAINTS, (1e-3, 2e-3, 4e-3)),
}
SGDM = (0.05, 0.8)
STEP_SIZES = {
  "sgld": {1.0: 1e-5, COLD: 3e-5},
  "sghmc": {1.0: 1e-3, COLD: 1e-3},
  "circle": {1.0: 4e-3, COLD: 4e-3},
  "orthogonal": {1.0: 1e-3, COLD: 2e-3},
  "maxnorm": {1.0: 1e-3, COLD: 4e-3},
}
SMOKE = {"seeds": 2, "budget": 200, "samples": 5, "n_train": 1000, "n_val": 500, "n_test": 1000}


def log_probs(params, x):
  return jax.nn.log_softmax(MODEL.apply({"params": params}, x))


def grad_estimator(n_train: int):
  """The log-posterior's gradient from a minibatch ``(x, y)``, blackjax's estimator: prior ``N(0, 1)``."""
  import blackjax

  logprior = lambda p: -0.5 * sum(jnp.sum(w**2) for w in jax.tree.leaves(p))
  loglik = lambda p, xy: log_probs(p, xy[0][None])[0, xy[1]]
  return blackjax.sgmcmc.gradients.grad_estimator(logprior, loglik, n_train)


def make_method(name: str, n_train: int) -> posterior.Method:
  """The method ``name``; its members carry ``step_size`` and ``temperature`` (SGD-m's: ``lr``, ``momentum``)."""
  import blackjax

  grads = grad_estimator(n_train)
  if name in ("sgdm", "cola_ud"):
    descent = lambda p, batch: jax.tree.map(lambda g: -g / n_train, grads(p, batch))
    if name == "sgdm":
      return posterior.optimizer(lambda m: optax.sgd(m["lr"], momentum=m["momentum"]), descent)
    return posterior.optimizer(lambda m: cola.cola_ud(0.3, friction=1.0, constraints=CONSTRAINTS["circle"]), descent)
  if name == "sgld":
    return posterior.sampling_algorithm(lambda m: blackjax.sgld(grads))
  if name == "sghmc":
    return posterior.sampling_algorithm(lambda m: blackjax.sghmc(grads, SGHMC_STEPS), grads_per_step=SGHMC_STEPS)
  constraints = CONSTRAINTS[name]
  return posterior.sampling_algorithm(
    lambda m: cola.sampling.underdamped(grads, constraints=constraints, friction=FRICTION, splitting="BAOAB"),
    vectorized=name != "orthogonal",  # its projections run slower per chain under vmap on XLA:CPU
  )


def members(name: str, seeds: Sequence[int], tune: bool) -> list[dict]:
  """One dict per chain: the seeds (tuning: seed 0) times the temperatures times the step sizes."""
  if name == "sgdm":
    pairs = GRIDS["sgdm"] if tune else (SGDM,)
    return [{"seed": s, "lr": lr, "momentum": mom} for s in seeds for lr, mom in pairs]
  if name == "cola_ud":
    return [{"seed": s} for s in seeds]
  return [
    {"seed": s, "temperature": t, "step_size": h}
    for s in seeds
    for t in TEMPERATURES
    for h in (GRIDS[name] if tune else (STEP_SIZES[name][t],))
  ]


def row_name(name: str, member: dict, tune: bool = False) -> str:
  """``sgld_T0.01``; tuning, with the grid's values: ``sgld_T0.01_h3e-05``, ``sgdm_h0.1_m0.9``."""
  key = f"{name}_T{member['temperature']:g}" if "temperature" in member else name
  if tune and "step_size" in member:
    key += f"_h{member['step_size']:g}"
  if tune and "lr" in member:
    key += f"_h{member['lr']:g}_m{member['momentum']:g}"
  return key


def row_label(row: str) -> str:
  """``"blackjax sgld, T = 0.01"`` for the row ``sgld_T0.01``."""
  name, _, temperature = row.partition("_T")
  return LABELS[name] + (f", T = {temperature}" if temperature else "")


def run_method(name: str, args, dataset, seeds: Sequence[int], tune: bool) -> tuple[list[dict], dict, dict]:
  method = make_method(name, len(dataset.x_train))
  chains = members(name, seeds, tune)
  plan = posterior.schedule(
    args.budget,
    method.grads_per_step,
    0.0 if name in ("sgdm", "cola_ud") else 0.5,
    1 if name in ("sgdm", "cola_ud") else args.samples,
  )
  sets = {"validation": (dataset.x_val, dataset.y_val)} if tune else {"test": (dataset.x_test, dataset.y_test)}
  out = posterior.run_chains(
    method,
    init_params=lambda key: MODEL.init(key, jnp.zeros((1, 28, 28)))["params"],
    log_probs=log_probs,
    train=(dataset.x_train, dataset.y_train),
    eval_sets=sets,
    members={k: np.array([c[k] for c in chains]) for k in chains[0]},
    plan=plan,
    batch_size=128,
  )
  return chains, out, plan


def load(args):
  n = args.n_train + (args.n_val if args.tune else 0)
  full = data.fashion_mnist(
    args.data_dir, n, args.n_test, test_from="official", allow_synthetic=args.smoke, synthetic=args.synthetic
  )
  split = args.n_train
  return argparse.Namespace(
    x_train=full.x_train[:split],
    y_train=full.y_train[:split],
    x_val=full.x_train[split:],
    y_val=full.y_train[split:],
    x_test=full.x_test,
    y_test=full.y_test,
    info={
      **full.info,
      "split": f"training images 0..{split - 1} train" + (f", {split}..{n - 1} validation" if args.tune else ""),
    },
  )


def parse_args(argv):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--seeds", type=int, default=5, help="number of seeds, 0..seeds-1")
  p.add_argument("--budget", type=int, default=4000, help="gradient evaluations per chain")
  p.add_argument("--samples", type=int, default=20, help="thinned positions averaged after the burn-in")
  p.add_argument("--methods", type=cli.choices(METHODS), default=METHODS, help=f"comma list of {', '.join(METHODS)}")
  p.add_argument("--tune", action="store_true", help="the grids of GRIDS at seed 0, scored on the validation set")
  p.add_argument("--out", default=None, help="output folder; default results/paper/ (--smoke: a new temporary folder)")
  p.add_argument("--smoke", action="store_true", help=f"a tiny run for tests: {SMOKE}; synthetic data if needed")
  p.add_argument("--quiet", action="store_true", help="no progress lines")
  p.add_argument("--data-dir", default=data.FASHION_MNIST_DIR, help="folder with the four Fashion-MNIST IDX files")
  p.add_argument("--synthetic", action="store_true", help="a synthetic stand-in of the same shapes (testing only)")
  p.add_argument("--n-train", type=int, default=10_000, help="training images (the first of the official set)")
  p.add_argument("--n-val", type=int, default=2_000, help="validation images (the following ones; --tune)")
  p.add_argument("--n-test", type=int, default=10_000, help="test images (the first of the official test set)")
  args = p.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE.items():
      setattr(args, k, v)
  if min(args.seeds, args.budget, args.samples, args.n_train, args.n_val, args.n_test) < 1:
    p.error("--seeds, --budget, --samples, --n-train, --n-val and --n-test must be positive")
  return args


def summarize(rows: dict) -> dict:
  return {r: report.mean_std_fields(v, ("accuracy", "nll", "ece", "sample_accuracy")) for r, v in rows.items()}


def draw(path: str, rows: dict, summary: dict, where: str, title: str) -> None:
  """One panel per score: a bar per row (its mean over the seeds, the seeds' std as error bar), the cold
  temperature hatched."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(summary)
  fig, axes = plt.subplots(1, 3, figsize=(18, 0.4 * len(names) + 2), sharey=True)
  scores = (("accuracy", "accuracy (%)", 100), ("nll", "NLL", 1), ("ece", "ECE (15 bins, %)", 100))
  for ax, (key, label, scale) in zip(axes, scores):
    for i, n in enumerate(names):
      mean, std = (summary[n][f"{key}_{s}"] for s in ("mean", "std"))
      ax.barh(
        i,
        np.nan if mean is None else scale * mean,
        xerr=scale * (std or 0.0),
        color=f"C{METHODS.index(rows[n]['row'].split('_T')[0])}",
        hatch="//" if rows[n]["row"].endswith(f"_T{COLD:g}") else None,
        edgecolor="white",
      )
    ax.set(xlabel=f"{where} {label}")
    ax.grid(alpha=0.3, axis="x")
  accuracies = [100 * v["accuracy_mean"] for v in summary.values() if v["accuracy_mean"] is not None]
  if accuracies:
    axes[0].set_xlim(np.percentile(accuracies, 25) - 10, max(accuracies) + 1)
  axes[0].set_yticks(range(len(names)), names)
  axes[0].invert_yaxis()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the experiment (or ``--tune``); writes its JSON and PNG under ``--out``; returns the JSON's dict."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  start = time.perf_counter()
  try:
    dataset = load(args)
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  out_dir = report.output_dir(args.out if args.out or args.smoke else "results/paper/", "bayesian_fashion_mnist")
  stem = "bayesian_fashion_mnist" + ("_tuning" if args.tune else "")
  seeds = [0] if args.tune else list(range(args.seeds))
  rows, timing, plans, chosen = {}, {}, {}, {}
  for name in args.methods:
    chains, out, plans[name] = run_method(name, args, dataset, seeds, args.tune)
    timing[name] = {"compile_s": out["compile_s"], "run_s": out["run_s"], "chains": len(chains)}
    (scores,) = out["metrics"].values()
    for i, c in enumerate(chains):
      hyperparameters = {k: v for k, v in c.items() if k != "seed"}
      row = rows.setdefault(
        row_name(name, c, args.tune), {"row": row_name(name, c), "hyperparameters": hyperparameters}
      )
      for k, v in scores.items():
        row.setdefault(k, []).append(report.finite_list(v[i]))
    if not args.quiet:
      print(f"{name}: {len(chains)} chains, compile {out['compile_s']:.1f} s, run {out['run_s']:.1f} s", flush=True)
  for key, row in rows.items() if args.tune else ():
    best = chosen.get(row["row"])
    if row["nll"][0] is not None and (best is None or row["nll"][0] < rows[best]["nll"][0]):
      chosen[row["row"]] = key
  summary = summarize(rows)
  result = {
    "schema_version": SCHEMA_VERSION,
    "experiment": "Bayesian Fashion-MNIST MLP (issue 58): posterior predictive of constrained underdamped "
    "sampling against blackjax sgld/sghmc, SGD-m and c-CoLA-ud at an equal budget of gradient evaluations",
    "status": "complete",
    "config": {
      "tune": args.tune,
      "seeds": seeds,
      "budget_gradient_evaluations": args.budget,
      "samples": args.samples,
      "burn_in": "the first half of a sampler's steps; point estimates: none, the last position",
      "model": f"784-{HIDDEN}-10 ReLU MLP, PyTorch's default init",
      "batch_size": 128,
      "prior": "N(0, 1) on every parameter",
      "temperatures": list(TEMPERATURES),
      "friction": FRICTION,
      "sghmc": {"num_integration_steps": SGHMC_STEPS, "alpha": 0.01, "beta": 0},
      "cola_ud": {"learning_rate": 0.3, "friction": 1.0, "radius": RADII, "temperature": 0.0},
      "constraints": {
        "circle": {"radius": RADII},
        "orthogonal": "layer0/kernel",
        "maxnorm": "MaxNorm(2.0) on layer0/kernel and layer1/kernel (each column)",
      },
      "grids": {k: list(v) for k, v in GRIDS.items()},
      "sgdm": dict(zip(("learning_rate", "momentum"), SGDM)),
      "step_sizes": {k: {str(t): h for t, h in v.items()} for k, v in STEP_SIZES.items()},
      "schedules": plans,
      "n_train": args.n_train,
      "n_test": args.n_test,
      "n_val": args.n_val if args.tune else 0,
      "ece_bins": 15,
    },
    "data": dataset.info,
    "methods": {m: LABELS[m] for m in args.methods},
    "labels": {k: row_label(v["row"]) for k, v in rows.items()},
    "results": rows,
    "summary": summary,
    **(
      {
        "chosen": {r: rows[k]["hyperparameters"] for r, k in chosen.items()},
        "selection": "lowest validation NLL at seed 0",
      }
      if args.tune
      else {}
    ),
    "timing": timing,
    **report.provenance(argv, start, packages=("flax", "blackjax")),
  }
  json_path, png_path = os.path.join(out_dir, stem + ".json"), os.path.join(out_dir, stem + ".png")
  report.write_json(json_path, result)
  draw(
    png_path,
    rows,
    summary,
    "validation" if args.tune else "test",
    f"{'SYNTHETIC stand-in' if dataset.info['synthetic'] else 'Fashion-MNIST'}, 784-{HIDDEN}-10 MLP, "
    f"{args.budget} gradients per chain, "
    f"{len(seeds)} seed{'s' * (len(seeds) > 1)}",
  )
  table = [
    [r]
    + [
      report.pm(v[k], s, d)
      for k, s, d in (("accuracy", 100, 2), ("nll", 1, 3), ("ece", 100, 2), ("sample_accuracy", 100, 2))
    ]
    for r, v in rows.items()
  ]
  print(report.table(table, ["row", "accuracy %", "NLL", "ECE %", "single-sample accuracy %"]))
  print(f"wall time {result['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")
  return result


if __name__ == "__main__":
  main()
