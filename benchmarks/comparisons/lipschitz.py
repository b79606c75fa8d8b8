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
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import cola_jax as cola
from benchmarks.harness import cli, data, models, records, report
from benchmarks.harness.timing import compile_cost, measure_pair, pair_summary

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


class Dense(nn.Module):
  """``x @ kernel + bias`` with PyTorch's init, sowing the kernel it uses (``W / sigma_est`` under SpectralNorm)."""

  features: int

  @nn.compact
  def __call__(self, x):
    fan_in = x.shape[-1]
    kernel = self.param("kernel", models.torch_uniform(fan_in), (fan_in, self.features))
    bias = self.param("bias", models.torch_uniform(fan_in), (self.features,))
    self.sow("intermediates", "kernel", kernel)
    return x @ kernel + bias


class LipschitzMLP(nn.Module):
  """Dense layers ``layer0 ..`` of ``widths`` with ReLU between them, each wrapped in Flax's ``SpectralNorm``
  with ``spectral_norm`` (its power-iteration estimate updated when ``train``)."""

  widths: Sequence[int]
  spectral_norm: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape(len(x), -1)
    for i, width in enumerate(self.widths):
      if i:
        x = nn.relu(x)
      layer = Dense(width, name=f"layer{i}")
      x = nn.SpectralNorm(layer)(x, update_stats=train) if self.spectral_norm else layer(x)
    return x


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


def model_of(name: str, widths) -> LipschitzMLP:
  return LipschitzMLP(tuple(widths), spectral_norm=name == "flax_spectral_norm")


def initial_variables(name: str, widths, seed: int, sample: jax.typing.ArrayLike) -> dict:
  """Seed ``seed``'s parameters, the same for every method, and SpectralNorm's ``batch_stats`` (its random start
  vectors ``u``) for ``flax_spectral_norm``; ``{}`` for the others."""
  init_key, power_key = jax.random.split(jax.random.key(seed))
  params = model_of("adam", widths).init(init_key, sample)["params"]
  stats = model_of(name, widths).init(power_key, sample).get("batch_stats", {})
  return {"params": params, "batch_stats": stats}


def order_key(seed: int) -> jax.Array:
  """The key of seed ``seed``'s minibatch order (epoch ``e``: ``fold_in(key, e)``), the same for every method."""
  return jax.random.fold_in(jax.random.key(seed), 1)


def loss_fn(model: LipschitzMLP):
  """``(params, batch_stats, x, y) -> (mean cross-entropy, updated batch_stats)`` in training mode."""

  def loss(params, stats, x, y):
    logits, mutated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), mutated.get("batch_stats", stats)

  return loss


def training_step(model: LipschitzMLP, tx: optax.GradientTransformation):
  """``(params, stats, opt_state, x, y) -> (params, stats, opt_state, loss)``: one step, not jitted."""
  grad = jax.value_and_grad(loss_fn(model), has_aux=True)

  def step(params, stats, opt_state, x, y):
    (loss, stats), grads = grad(params, stats, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, loss

  return step


def epoch_fn(model: LipschitzMLP, tx: optax.GradientTransformation, batch: int, n: int):
  """A jitted epoch: ``((params, stats, opt_state), x, y, key) -> (carry, mean loss)``, minibatches in the
  order ``permutation(key, n)``, scanned."""
  step = training_step(model, tx)
  steps = n // batch

  def epoch(carry, x, y, key):
    order = jax.random.permutation(key, n)[: steps * batch].reshape(steps, batch)

    def one(carry, idx):
      params, stats, opt_state = carry
      params, stats, opt_state, loss = step(params, stats, opt_state, x[idx], y[idx])
      return (params, stats, opt_state), loss

    carry, losses = jax.lax.scan(one, carry, order)
    return carry, jnp.mean(losses)

  return jax.jit(epoch, donate_argnums=0)


def used_kernels(model: LipschitzMLP, variables: dict, sample: jax.typing.ArrayLike) -> list[np.ndarray]:
  """The kernel each layer uses at evaluation, in order (``W / sigma_est`` under SpectralNorm), as float64."""
  _, sown = model.apply(variables, sample, mutable=["intermediates"])
  layers = sown["intermediates"]
  return [np.asarray(layers[f"layer{i}"]["kernel"][0], np.float64) for i in range(len(model.widths))]


def spectral_norms(kernels: Sequence[np.ndarray]) -> list[float]:
  """The exact largest singular value of each kernel (LAPACK's float64 SVD)."""
  return [float(np.linalg.svd(k, compute_uv=False)[0]) for k in kernels]


def certified(logits: np.ndarray, labels: np.ndarray, lipschitz: float, radii) -> tuple[float, list[float]]:
  """Clean accuracy, and per radius the fraction correct with ``margin / (sqrt(2) L) > radius``."""
  top2 = np.sort(logits.astype(np.float64), axis=-1)[:, -2:]
  margin = top2[:, 1] - top2[:, 0]
  correct = np.argmax(logits, -1) == labels
  return float(correct.mean()), [float(np.mean(correct & (margin / (math.sqrt(2) * lipschitz) > r))) for r in radii]


@functools.partial(jax.jit, static_argnums=0)
def logits_of(model: LipschitzMLP, variables: dict, x: jax.Array):
  """The logits of the rows of ``x``, in evaluation mode."""
  return model.apply(variables, x)


@functools.partial(jax.jit, static_argnums=0)
def jacobians(model: LipschitzMLP, variables: dict, x: jax.Array) -> jax.Array:
  """The Jacobian ``(outputs, inputs)`` of the logits with respect to the flattened input at each row of ``x``."""
  f = lambda xi: model.apply(variables, xi[None])[0]
  return jax.vmap(jax.jacrev(f))(x).reshape(len(x), model.widths[-1], -1)


def jacobian_norms(model: LipschitzMLP, variables: dict, x: jax.Array) -> np.ndarray:
  """The spectral norm of the Jacobian of the logits with respect to the input at each row of ``x``."""
  return np.linalg.norm(np.asarray(jacobians(model, variables, x), np.float64), ord=2, axis=(1, 2))


def pair_ratios(logits: np.ndarray, x: np.ndarray, pairs: int, seed: int) -> np.ndarray:
  """``|f(x_i) - f(x_j)| / |x_i - x_j|`` over ``pairs`` random pairs ``i != j`` of the rows of ``x``."""
  rng = np.random.default_rng(seed)
  i = rng.integers(0, len(x), pairs)
  j = (i + rng.integers(1, len(x), pairs)) % len(x)
  flat = x.reshape(len(x), -1).astype(np.float64)
  out = logits.astype(np.float64)
  return np.linalg.norm(out[i] - out[j], axis=1) / np.linalg.norm(flat[i] - flat[j], axis=1)


def measure(model: LipschitzMLP, variables: dict, dataset: data.Dataset, args, seed: int) -> dict:
  """What a trained network is measured by (the module docstring): one seed's values."""
  logits = np.asarray(logits_of(model, variables, dataset.x_test))
  norms = spectral_norms(used_kernels(model, variables, dataset.x_test[:1]))
  lipschitz = math.prod(norms)
  clean, robust = certified(logits, dataset.y_test, lipschitz, args.radii)
  jac = jacobian_norms(model, variables, jnp.asarray(dataset.x_test[: args.jacobian_points]))
  return {
    "test_accuracy": clean,
    "certified_accuracy": robust,
    "lipschitz_bound": lipschitz,
    "layer_norms": norms,
    "max_layer_norm": max(norms),
    "empirical_lipschitz_jacobian": float(jac.max()),
    "empirical_lipschitz_pairs": float(pair_ratios(logits, dataset.x_test, args.pairs, seed).max()),
  }


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
    out[name] = {
      **{k: cost[k] for k in ("compile_s", "compile_cpu_s")},
      "adam_compile_s": base_cost["compile_s"],
      "adam_compile_cpu_s": base_cost["compile_cpu_s"],
      "step": timed,
      "ratios": {
        "step": timed["ratio"],
        "compile_wall": cost["compile_s"] / base_cost["compile_s"],
        "compile_cpu": cost["compile_cpu_s"] / base_cost["compile_cpu_s"],
      },
    }
    print(
      f"{name:20s} step {timed['method_ms']:.2f} ms vs Adam {timed['baseline_ms']:.2f} ms ({timed['ratio']:.2f}x), "
      f"compile {out[name]['ratios']['compile_cpu']:.2f}x (CPU s)",
      flush=True,
    )
  return out


KEYS = (
  "test_accuracy",
  "lipschitz_bound",
  "empirical_lipschitz_jacobian",
  "empirical_lipschitz_pairs",
  "max_layer_norm",
)


def entry(measured: list[dict], histories: list[dict], radii) -> dict:
  """A method's JSON entry from its seeds' measurements and histories: per-seed lists and their means."""
  out: dict[str, Any] = {k: [m[k] for m in measured] for k in KEYS}
  out["layer_norms"] = [m["layer_norms"] for m in measured]
  out["certified_accuracy"] = {f"{r:g}": [m["certified_accuracy"][i] for m in measured] for i, r in enumerate(radii)}
  out["summary"] = {
    **records.mean_std_fields(out, KEYS),
    "certified_accuracy": {
      r: dict(zip(("mean", "std"), records.mean_std(v))) for r, v in out["certified_accuracy"].items()
    },
  }
  out["history"] = {
    "epoch": histories[0]["epoch"],
    **{k: [list(values) for values in zip(*(h[k] for h in histories))] for k in ("train_loss", "test_accuracy")},
  }
  return out


def plot(out: dict, path: str) -> None:
  """Accuracy against the certified radius, the Lipschitz bound and the empirical constant, the cost ratios."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
  radii = out["config"]["radii"]
  names = list(out["results"])
  for i, (name, r) in enumerate(out["results"].items()):
    values = np.array([r["test_accuracy"], *(r["certified_accuracy"][f"{e:g}"] for e in radii)]) * 100
    axes[0].errorbar([0, *radii], values.mean(1), values.std(1), color=f"C{i}", marker="o", capsize=3, label=name)
  axes[0].set(xlabel="L2 radius (pixels in [0, 1]); 0: clean", ylabel="test accuracy (%)", ylim=(0, 100))
  axes[0].legend(fontsize=8)
  for j, (key, label) in enumerate(
    (("lipschitz_bound", "L: product of exact layer norms"), ("empirical_lipschitz_jacobian", "max Jacobian norm"))
  ):
    values = np.array([out["results"][n][key] for n in names])
    axes[1].bar(np.arange(len(names)) + 0.4 * (j - 0.5), values.mean(1), 0.4, yerr=values.std(1), label=label)
  axes[1].axhline(1, color="black", lw=0.8)
  axes[1].set(xticks=range(len(names)), xticklabels=names, yscale="log", ylabel="Lipschitz constant")
  axes[1].legend(fontsize=8)
  costs = list(out["costs"])
  for j, kind in enumerate(("step", "compile_cpu")):
    axes[2].bar(
      np.arange(len(costs)) + 0.4 * (j - 0.5), [out["costs"][n]["ratios"][kind] for n in costs], 0.4, label=kind
    )
  axes[2].axhline(1, color="black", lw=0.8)
  axes[2].set(xticks=range(len(costs)), xticklabels=costs, ylabel="ratio to Adam (same process)")
  axes[2].legend(fontsize=8)
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)
  c = out["config"]
  fig.suptitle(
    f"MLP 784-{'-'.join(map(str, c['widths']))}, ReLU, on {out['data']['source']}: {c['epochs']} epochs, "
    f"batch {c['batch']}, {len(out['seeds'])} seeds"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def table(out: dict) -> str:
  radii = out["config"]["radii"]
  rows = []
  for name, r in out["results"].items():
    cost = out["costs"].get(name, {}).get("ratios", {})
    rows.append(
      [
        name,
        report.pm(r["test_accuracy"], 100, 1),
        *(report.pm(r["certified_accuracy"][f"{e:g}"], 100, 1) for e in radii),
        report.pm(r["lipschitz_bound"], digits=3),
        report.pm(r["empirical_lipschitz_jacobian"], digits=3),
        *(f"{cost[k]:.2f}" if k in cost else "1" for k in ("step", "compile_cpu")),
      ]
    )
  header = ["method", "clean %", *(f"cert {e:g} %" for e in radii), "L", "max |J|", "step", "compile"]
  return report.table(rows, header)


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
