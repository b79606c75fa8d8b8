r"""A 1-Lipschitz MLP on Fashion-MNIST: the spectral-norm ball against Flax's SpectralNorm and plain Adam (issue 49).

The model: an MLP 784-256-256-10 with ReLU (1-Lipschitz) between its Dense
layers, inputs in the [0, 1] pixel scale, PyTorch's default initialisation
(the same parameters for every method of a seed). Every layer ``x -> x W + b``
with ``sigma_max(W) <= 1`` is 1-Lipschitz in the L2 norm, and so is the
network. Trained on the 60,000 official training images for ``--epochs``
epochs of minibatches of ``--batch`` (reshuffled each epoch, the same order for
every method of a seed, the last partial batch dropped) with the softmax
cross-entropy; tested on the 10,000 official test images.

Methods (``--lr`` for every Adam):

* ``adam``: ``optax.adam``, no constraint;
* ``constrained_adam``: ``cola.constrained(optax.adam)`` with
  ``cola.MaxSpectralNorm(1.0)`` on every kernel (biases free, on Adam);
* ``cola_ud``: ``cola.cola_ud(--h, friction=--friction, constraints=<the same>,
  free=optax.adam)`` at temperature 0: SGD with momentum on the kernels, each in
  the ball, Adam on the biases. ``h = 0.3, friction = 1``: SGD-m's effective
  rate ``h**2 / (1 - exp(-friction h))`` is 0.35, near the 0.3 of
  docs/choosing.md;
* ``flax_spectral_norm``: the same MLP with every Dense layer wrapped in
  Flax's ``linen.SpectralNorm`` (one power-iteration step per call, its
  estimate in ``batch_stats``, updated while training), trained by
  ``optax.adam``. The layer uses ``W / sigma_est``: a normalisation by an
  estimate, not a bound. Its certificate below takes the exact norm of the
  kernels the layers use at evaluation.

Reported per method and seed, after training: clean test accuracy; ``L``, the
product over the layers of the exact spectral norm (float64 SVD) of the kernel
each layer uses (``W``, or ``W / sigma_est`` under SpectralNorm), an upper
bound of the network's L2 Lipschitz constant; certified robust accuracy at
each radius ``eps`` of ``--radii``: the fraction of test images classified
correctly with ``margin / (sqrt(2) L) > eps`` (``margin``: the top logit minus
the second; no L2 perturbation of norm ``eps`` can change the class); the
empirical Lipschitz constant, a lower bound: the largest spectral norm of the
input-output Jacobian (by ``jax.jacrev``) over the first ``--jacobian-points``
test images, and the largest ``|f(x) - f(y)| / |x - y|`` over ``--pairs``
random pairs of test images; the largest layer norm. Then, in the same
process, one seed's jitted training step of each method against Adam's:
compile time (``lower().compile()``, wall and CPU seconds, after Adam's
compile has paid the compiler's first use) and step time (medians of
interleaved pairs after warm-up), as ratios to Adam's.

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.comparisons.lipschitz   # 5 seeds: results/comparisons/lipschitz.*
  python -m benchmarks.comparisons.lipschitz --smoke   # seconds: a small MLP on synthetic images, temporary folder
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax

import cola_jax as cola
from benchmarks.comparisons.lipschitz_certificate import logits_of, measure
from benchmarks.comparisons.lipschitz_model import epoch_fn, initial_variables, model_of, training_step
from benchmarks.comparisons.lipschitz_report import entry, plot, table
from benchmarks.harness import cli, data, records, report
from benchmarks.harness.timing import against_adam, compile_cost, measure_pair, pair_summary

METHODS = ("adam", "constrained_adam", "cola_ud", "flax_spectral_norm")
BALL = [(r"kernel$", cola.MaxSpectralNorm(1.0))]
DEFAULTS = {"lr": 1e-3, "h": 0.3, "friction": 1.0}
WIDTHS = (256, 256, 10)
RADII = (0.1, 0.5, 1.0)
SMOKE = {
  "widths": (32, 32, 10),
  "n_train": 512,
  "n_test": 256,
  "epochs": 1,
  "seeds": 2,
  "batch": 64,
  "jacobian_points": 16,
  "pairs": 64,
}
SMOKE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}


def make_method(name: str, hp: dict) -> optax.GradientTransformation:
  """The optimizer of method ``name`` with the hyperparameters ``hp`` (``DEFAULTS``' keys)."""
  adam = optax.adam(hp["lr"])
  if name == "constrained_adam":
    return cola.constrained(adam, constraints=cola.path_constraints(BALL))
  if name == "cola_ud":
    return cola.cola_ud(hp["h"], friction=hp["friction"], constraints=cola.path_constraints(BALL), free=adam)
  return adam


def describe(name: str, hp: dict) -> str:
  return {
    "adam": f"optax.adam({hp['lr']:g}), unconstrained",
    "constrained_adam": f"cola.constrained(optax.adam({hp['lr']:g})), MaxSpectralNorm(1.0) on every kernel",
    "cola_ud": f"cola.cola_ud({hp['h']:g}, friction={hp['friction']:g}, temperature=0, free=optax.adam({hp['lr']:g})), "
    "MaxSpectralNorm(1.0) on every kernel",
    "flax_spectral_norm": f"flax.linen.SpectralNorm(Dense) on every layer (1 power step per call), "
    f"optax.adam({hp['lr']:g})",
  }[name]


def order_key(seed: int) -> jax.Array:
  """The key of seed ``seed``'s minibatch order (epoch ``e``: ``fold_in(key, e)``), the same for every method."""
  return jax.random.fold_in(jax.random.key(seed), 1)


def train_seed(name: str, seed: int, dataset: data.Dataset, epoch, args) -> tuple[dict, dict]:
  """Method ``name`` trained from seed ``seed``'s start by the compiled ``epoch``: its final variables and its
  per-epoch mean training loss and test accuracy."""
  model = model_of(name, args.widths)
  variables = initial_variables(name, args.widths, seed, dataset.x_train[:1])
  carry = (variables["params"], variables["batch_stats"], make_method(name, args.hp).init(variables["params"]))
  x, y = jnp.asarray(dataset.x_train), jnp.asarray(dataset.y_train)
  history = {"epoch": [], "train_loss": [], "test_accuracy": []}
  for e in range(args.epochs):
    carry, loss = epoch(carry, x, y, jax.random.fold_in(order_key(seed), e))
    logits = logits_of(model, {"params": carry[0], "batch_stats": carry[1]}, dataset.x_test)
    history["epoch"].append(e + 1)
    history["train_loss"].append(float(loss))
    history["test_accuracy"].append(float(jnp.mean(jnp.argmax(logits, -1) == dataset.y_test)))
  return {"params": carry[0], "batch_stats": carry[1]}, history


def step_costs(dataset: data.Dataset, args) -> dict:
  """Per method: the compile cost of seed 0's jitted step and its time interleaved with Adam's, as ratios."""
  x, y = jnp.asarray(dataset.x_train[: args.batch]), jnp.asarray(dataset.y_train[: args.batch])
  options = SMOKE_COMPILER_OPTIONS if args.smoke else None

  def setup(name):
    """Method ``name``'s jitted step and a fresh carry ``(params, stats, opt_state, x, y)`` of seed 0."""
    variables = initial_variables(name, args.widths, 0, dataset.x_train[:1])
    tx = make_method(name, args.hp)
    params, stats = (jax.tree.map(jnp.copy, variables[k]) for k in ("params", "batch_stats"))
    step = jax.jit(training_step(model_of(name, args.widths), tx), donate_argnums=(0, 1, 2))
    return step, (params, stats, tx.init(params), x, y)

  if not args.smoke:
    first, carry = setup("adam")
    compile_cost(first, *carry)  # the compiler's first use
  base_fn, base_args = setup("adam")
  base, base_cost = compile_cost(base_fn, *base_args, compiler_options=options)
  advance = lambda step: lambda *carry: (*step(*carry)[:3], *carry[3:])  # the loss dropped, the batch kept
  out = {}
  for name in args.methods[1:]:
    fn, fn_args = setup(name)
    compiled, cost = compile_cost(fn, *fn_args, compiler_options=options)
    timed = pair_summary(
      *measure_pair((advance(compiled), advance(base)), (fn_args, setup("adam")[1]), 2, args.repetitions, args.budget)
    )
    out[name] = against_adam(cost, base_cost, timed)
    print(
      f"{name:20s} step {timed['method_ms']:.2f} ms vs Adam {timed['baseline_ms']:.2f} ms ({timed['ratio']:.2f}x), "
      f"compile {out[name]['ratios']['compile_cpu']:.2f}x (CPU s)",
      flush=True,
    )
  return out


def cli_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument(
    "--methods", type=cli.choices(METHODS[1:]), default=",".join(METHODS[1:]), help="comma list of methods against adam"
  )
  p.add_argument("--seeds", type=int, default=5, help="seeds 0..seeds-1, one after another")
  p.add_argument("--epochs", type=int, default=3, help="training epochs")
  p.add_argument("--batch", type=int, default=256, help="minibatch size")
  for key, value in DEFAULTS.items():
    p.add_argument("--" + key, type=float, default=value)
  p.add_argument("--radii", type=float, nargs="+", default=list(RADII), help="L2 radii of the certified accuracy")
  p.add_argument("--jacobian-points", type=int, default=1000, help="test images at which the Jacobian is taken")
  p.add_argument("--pairs", type=int, default=10_000, help="random pairs of test images")
  p.add_argument("--repetitions", type=int, default=200, help="timed pairs of steps per method at most")
  p.add_argument("--budget", type=float, default=10.0, help="seconds of timing per method at most")
  p.add_argument("--data-dir", help=f"folder of the Fashion-MNIST IDX files; default {data.FASHION_MNIST_DIR}")
  p.add_argument("--out", default=None, help="default results/comparisons (a --smoke run: a new temporary folder)")
  p.add_argument("--smoke", action="store_true", help="a 784-32-32-10 MLP on synthetic images, 2 seeds: seconds")
  p.add_argument("--quiet", action="store_true", help="no per-seed lines")
  return p


def parse_args(argv):
  p = cli_parser()
  args = p.parse_args(argv)
  args.widths = SMOKE["widths"] if args.smoke else WIDTHS
  if args.smoke:
    for key in ("epochs", "seeds", "batch", "jacobian_points", "pairs"):
      setattr(args, key, SMOKE[key])
    args.repetitions, args.budget = 2, 0.5
  args.methods = ("adam", *args.methods)
  if min(args.seeds, args.epochs, args.batch, args.jacobian_points, args.pairs) < 1:
    p.error("--seeds, --epochs, --batch, --jacobian-points and --pairs must be positive")
  if min(args.radii) <= 0:
    p.error("--radii must be positive")
  args.radii = sorted(args.radii)
  args.hp = {k: getattr(args, k) for k in DEFAULTS}
  return args


def load(args) -> data.Dataset:
  if args.smoke:
    return data.fashion_mnist(n_train=SMOKE["n_train"], n_test=SMOKE["n_test"], synthetic=True)
  return data.fashion_mnist(args.data_dir, n_train=60_000, n_test=10_000, test_from="official")


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  started = time.perf_counter()
  out_dir = report.output_dir(args.out or (None if args.smoke else "results/comparisons"), "lipschitz")
  try:
    dataset = load(args)
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  seeds = list(range(args.seeds))
  config = {
    **{k: getattr(args, k) for k in ("epochs", "batch", "radii", "jacobian_points", "pairs", "smoke")},
    "widths": list(args.widths),
    "activation": "relu",
    "hyperparameters": args.hp,
    "loss": "softmax cross-entropy (the same for every method)",
    "certificate": "L = product over the layers of the largest singular value (float64 SVD) of the kernel each "
    "layer uses at evaluation; a test image counts at radius eps if classified correctly with "
    "(top logit - second logit) / (sqrt(2) L) > eps",
    "empirical_lipschitz": "jacobian: the largest spectral norm of jax.jacrev's Jacobian of the logits over the first "
    "jacobian_points test images; pairs: the largest |f(x) - f(y)| / |x - y| over random pairs of test images",
    "costs": "seed 0's jitted step (loss, gradient, update, apply) on one minibatch: compile_s and compile_cpu_s of "
    "lower().compile() after Adam's compile paid the compiler's first use; step: medians of interleaved pairs with "
    "Adam's step after 2 warm-up calls; ratios to Adam's in this process. The machine was shared with other jobs: "
    "read the ratios, not the times",
  }
  methods = {name: describe(name, args.hp) for name in args.methods}
  costs = step_costs(dataset, args)
  measured = {name: [] for name in args.methods}
  histories = {name: [] for name in args.methods}
  n = len(dataset.x_train)
  epochs = {
    name: epoch_fn(model_of(name, args.widths), make_method(name, args.hp), args.batch, n) for name in args.methods
  }

  def write(status: str) -> dict:
    done = {k: entry(v, histories[k], args.radii) for k, v in measured.items() if v}
    return records.write_report(
      out_dir,
      "lipschitz.json",
      argv,
      started,
      config,
      data=dataset.info,
      status=status,
      seeds=seeds[: min(len(v) for v in measured.values())],
      methods=methods,
      results=done,
      costs=costs,
    )

  for seed in seeds:
    for name in args.methods:
      t0 = time.perf_counter()
      variables, history = train_seed(name, seed, dataset, epochs[name], args)
      measured[name].append(measure(model_of(name, args.widths), variables, dataset, args, seed))
      histories[name].append(history)
      if not args.quiet:
        m = measured[name][-1]
        print(
          f"seed {seed} {name:20s} acc {m['test_accuracy']:.4f} L {m['lipschitz_bound']:.4g} "
          f"|J| {m['empirical_lipschitz_jacobian']:.4g} certified {m['certified_accuracy']} "
          f"({time.perf_counter() - t0:.0f} s)",
          flush=True,
        )
    if seed < seeds[-1]:
      write("running")
  out = write("complete")
  plot(out, os.path.join(out_dir, "lipschitz.png"))
  print(table(out))
  print(f"wall time {out['meta']['wall_time_s']:.0f} s")
  return out


if __name__ == "__main__":
  main()
