#!/usr/bin/env python
"""Step overhead of the four CoLA methods against plain SGD and SGD with momentum.

For each model and method this measures, in one process and interleaved with
its baseline:

* ``update``: the optimizer alone, ``tx.update`` + ``optax.apply_updates`` under
  one ``jit`` with fixed gradients;
* ``step``: the full training step, loss + gradient + update + apply, jitted.

Overdamped methods (``c_cola_od``, ``o_cola_od``) are compared with
``optax.sgd(h)``; underdamped ones (``c_cola_ud``, ``o_cola_ud``) with the
SGD-momentum they reduce to without constraints and noise,
``optax.sgd(h**2, momentum=exp(-gamma h))``. Each is measured at temperature 0
(no noise drawn) and at ``tau > 0`` (noise drawn every step). The per-unit
general constraint (``i_cola_od``, ``i_cola_ud``) puts every kernel under
``cola.Implicit(equality=..., axis=0)`` with two components per column (its
entries sum to zero, its norm is 1, about the norm of the initial columns);
its baseline is the same method with ``cola.MaxNorm(1.0)`` on the same kernels
(the closed-form per-unit geometry, at the same temperature and key), so its
ratio is Implicit's time over MaxNorm's. The reported ratio is the median time of the
method over the median time of its baseline, both over the same interleaved
repetitions after warm-up. Also reported: the optimizer state size in bytes.

Models:

* ``mlp784``: 784-1000-10 ReLU MLP, batch 128, softmax cross-entropy (the
  paper's Fashion-MNIST model), circle radii 0.05 (hidden) and 0.1 (output).
* ``spiral8x100``: 2 inputs, 8 hidden layers of 100 ReLU units, 1 output,
  batch 25, binary cross-entropy (the paper's spiral model).

Usage::

  OPENBLAS_NUM_THREADS=1 python benchmarks/step_overhead.py            # full run
  OPENBLAS_NUM_THREADS=1 python benchmarks/step_overhead.py --smoke    # seconds
  python benchmarks/step_overhead.py --skip-heavy   # no o-CoLA on mlp784
  python benchmarks/step_overhead.py --models mlp784 --methods i_cola_od i_cola_ud \
      --repetitions 30                              # per-unit Implicit / MaxNorm only

Writes ``step_overhead.json`` (after every measurement, so that an
interrupted run keeps what it measured; ``config.complete`` says whether it
finished) and ``step_overhead.png`` under ``--out``.

JSON keys: ``meta`` (command, argv, date, machine, versions), ``config``
(hyperparameters, repetitions), ``results`` (one record per model, method,
temperature and kind, with ``method_ms``, ``baseline_ms``, ``ratio``,
``ratio_of_paired``, the per-sample spread and, for ``update``, the
``array_passes``: arrays of the largest leaf's shape read and written by the
compiled update, method and baseline), ``state_bytes`` (per model:
per method and baseline), ``targets`` (the issue's performance targets with
``value``, ``limit`` and ``met``), ``one_loop_floor`` (the c-CoLA-ud and
SGD-m updates of the mlp784 hidden kernel each written as one loop, without
donation: ``shape``, ``method_ms``, ``baseline_ms``, ``ratio``; see
:func:`one_loop_floor`), ``projection_floor`` (two matrix products per square
kernel of the spiral MLP against SGD's whole step: ``layers``, ``shape``,
``products_ms``, ``sgd_step_ms``, ``ratio_bound``; see :func:`projection_floor`).
"""

import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from cola_jax import langevin
from cola_jax._numerics import computed_together
from cola_jax.constraints.circle import CircleState

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
from _common import provenance, write_json
from harness.report import output_dir
from harness.timing import measure_pair, pair_summary, speed_parser, target_lines, tree_bytes

RESULT_KEYS = (
  "model",
  "method",
  "baseline",
  "temperature",
  "kind",
  "method_ms",
  "baseline_ms",
  "ratio",
  "ratio_of_paired",
  "method_iqr_ms",
  "baseline_iqr_ms",
  "repetitions",
)
TOP_KEYS = ("meta", "config", "results", "state_bytes", "targets", "one_loop_floor", "projection_floor")
METHODS = ("c_cola_od", "c_cola_ud", "o_cola_od", "o_cola_ud", "i_cola_od", "i_cola_ud")
KINDS = ("update", "step")
# --smoke measures only what the targets name (model, method, tau > 0,
# kind): compiling is what takes the time there.
SMOKE_JOBS = (
  ("mlp784", "c_cola_ud", False, "update"),
  ("mlp784", "c_cola_ud", False, "step"),
  ("mlp784", "c_cola_ud", True, "step"),
  ("spiral8x100", "o_cola_od", False, "step"),
  ("mlp784", "i_cola_ud", False, "step"),
)


# ----------------------------------------------------------------------------
# Models: plain jnp MLPs as dicts of layers {'Dense_i': {'kernel', 'bias'}}.


class Model(NamedTuple):
  name: str
  sizes: tuple
  batch: int
  loss: str  # 'softmax' or 'bce'
  radius: dict  # layer name -> circle radius


def init_mlp(key, sizes):
  """Glorot-uniform kernels, zero biases (Flax's Dense defaults are similar)."""
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    params[f"Dense_{i}"] = {
      "kernel": jax.random.uniform(sub, (fan_in, fan_out), jnp.float32, -bound, bound),
      "bias": jnp.zeros((fan_out,), jnp.float32),
    }
  return params


def apply_mlp(params, x):
  n = len(params)
  for i in range(n):
    layer = params[f"Dense_{i}"]
    x = x @ layer["kernel"] + layer["bias"]
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def make_loss(model: Model) -> Callable:
  if model.loss == "softmax":

    def loss(params, batch):
      x, y = batch
      return optax.softmax_cross_entropy_with_integer_labels(apply_mlp(params, x), y).mean()
  else:

    def loss(params, batch):
      x, y = batch
      return optax.sigmoid_binary_cross_entropy(apply_mlp(params, x)[:, 0], y).mean()

  return loss


def make_batch(model: Model, key):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (model.batch, model.sizes[0]), jnp.float32)
  if model.loss == "softmax":
    y = jax.random.randint(ky, (model.batch,), 0, model.sizes[-1])
  else:
    y = jax.random.bernoulli(ky, 0.5, (model.batch,)).astype(jnp.float32)
  return x, y


def models(smoke: bool) -> list[Model]:
  if smoke:
    return [
      Model("mlp784", (48, 64, 10), 16, "softmax", {"Dense_0": 0.05, "Dense_1": 0.1}),
      Model("spiral8x100", (2, 8, 8, 1), 5, "bce", {f"Dense_{i}": 0.3 for i in range(3)}),
    ]
  spiral = (2,) + (100,) * 8 + (1,)
  return [
    Model("mlp784", (784, 1000, 10), 128, "softmax", {"Dense_0": 0.05, "Dense_1": 0.1}),
    Model("spiral8x100", spiral, 25, "bce", {f"Dense_{i}": 0.3 for i in range(len(spiral) - 1)}),
  ]


# ----------------------------------------------------------------------------
# Methods and baselines.


def zero_sum_fixed_norm(radius: float):
  """Per unit: the entries sum to zero and the norm is ``radius`` (two components)."""
  return lambda unit: jnp.stack([jnp.sum(unit), jnp.sum(unit * unit) / radius**2 - 1])


def make_pair(method: str, model: Model, args, temperature: float):
  """(method transform, baseline transform, baseline name, hyperparameters)."""
  noise = {} if temperature == 0 else {"temperature": temperature, "key": jax.random.key(7)}
  if method in ("i_cola_od", "i_cola_ud"):
    # Norm 1: the first update projects the initial columns (norm about 1) from
    # nearby, as MaxNorm(1.0) leaves them in place.
    implicit = {
      layer: {"kernel": cola.Implicit(equality=zero_sum_fixed_norm(1.0), axis=0), "bias": None}
      for layer in model.radius
    }
    sphere = {layer: {"kernel": cola.MaxNorm(1.0), "bias": None} for layer in model.radius}
    # A key each: the timed calls donate their state, the key included.
    fresh = lambda: {k: jax.random.key(7) if k == "key" else v for k, v in noise.items()}
    if method == "i_cola_od":
      h = args.h_c_od
      make = lambda c: cola.cola_od(h, constraints=c, **fresh())
      hyper = {"h": h, "radius": 1.0}
    else:
      h, gamma = args.h_c_ud, args.friction
      make = lambda c: cola.cola_ud(h, friction=gamma, constraints=c, **fresh())
      hyper = {"h": h, "friction": gamma, "radius": 1.0}
    return (
      make(implicit),
      make(sphere),
      f"{method[2:]} MaxNorm, tau={temperature:g}",
      {**hyper, "constraint": "Implicit(zero sum, norm r; axis=0)"},
    )
  if method == "c_cola_od":
    h = args.h_c_od
    return (
      cola.c_cola_od(h, radius=model.radius, **noise),
      optax.sgd(h),
      f"sgd({h})",
      {"h": h, "radius": model.radius},
    )
  if method == "c_cola_ud":
    h, gamma = args.h_c_ud, args.friction
    lr, mom = cola.langevin_to_sgd_momentum(h, gamma)
    return (
      cola.c_cola_ud(h, friction=gamma, radius=model.radius, **noise),
      optax.sgd(lr, momentum=mom),
      f"sgd({lr:.4g}, momentum={mom:.4g})",
      {"h": h, "friction": gamma, "radius": model.radius},
    )
  if method == "o_cola_od":
    h = args.h_o_od
    return (cola.o_cola_od(h, **noise), optax.sgd(h), f"sgd({h})", {"h": h})
  if method == "o_cola_ud":
    h, gamma = args.h_o_ud, args.friction
    lr, mom = cola.langevin_to_sgd_momentum(h, gamma)
    return (
      cola.o_cola_ud(h, friction=gamma, **noise),
      optax.sgd(lr, momentum=mom),
      f"sgd({lr:.4g}, momentum={mom:.4g})",
      {"h": h, "friction": gamma},
    )
  raise ValueError(method)


def build(kind: str, tx, loss_fn, params, grads, batch):
  """A jitted step function and its initial carry ``(params, opt_state)``."""
  if kind == "update":

    def fn(params, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  else:

    def fn(params, state):
      g = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

  return jax.jit(fn, donate_argnums=(0, 1)), (jax.tree.map(jnp.copy, params), tx.init(params))


def array_passes(fn, carry, shape) -> dict | None:
  """Arrays of ``shape``'s size read and written by the compiled ``fn``'s top-level loops.

  An elementwise update is memory-bound at this size, so these counts (for the
  largest leaf) explain its time independently of the machine. An array counts
  whatever its shape (a flattened copy is as much traffic). Parsed from XLA's
  HLO text; None if the format is not understood.
  """
  text = fn.lower(*carry).compile().as_text()
  if "ENTRY" not in text:
    return None
  entry = text[text.index("ENTRY") :].split("\n}", 1)[0]
  size = math.prod(shape)

  def arrays(type_text: str) -> int:
    dims = re.findall(r"\w+\[([\d,]*)\]", type_text)
    return sum(math.prod(int(d) for d in found.split(",") if d) == size for found in dims)

  types = dict(re.findall(r"%(\S+) = (\S+) ", entry))
  reads = writes = 0
  for _name, out, op, args in re.findall(r"%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*?)\)", entry):
    if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
      continue
    writes += arrays(out)
    reads += sum(arrays(types.get(arg, "")) for arg in re.findall(r"%([\w.\-]+)", args))
  return {"reads": reads, "writes": writes}


def measure(args, fns, carries):
  """:func:`harness.timing.measure_pair` with the command line's warm-up, repetitions and budget."""
  return measure_pair(fns, carries, args.warmup, args.repetitions, args.budget)


def one_loop_floor(shape, radius: float, h: float, gamma: float, args) -> dict:
  """The c-CoLA-ud and SGD-m updates of one weight matrix, each as a single loop.

  XLA:CPU writes each output of an elementwise update in a loop of its own.
  Here both updates return all their outputs from one loop
  (``cola_jax._numerics.computed_together``: every intermediate computed once),
  without donated buffers, so the ratio is that of their arithmetic and memory
  traffic in this state layout (weight, slack, momentum). A reference, not a
  bound: the library's own update now has one-pass loops inside ``Circle``
  and can come below it.
  """
  circle = cola.Circle(radius)
  decay = math.exp(-gamma * h)
  lr, momentum = cola.langevin_to_sgd_momentum(h, gamma)

  def c_cola_ud(theta, xi, p, g):
    aux = CircleState(slack=xi, radius=jnp.float32(radius))
    point, p = langevin.oba_step(circle, circle.point(theta, aux), p, g, h, decay)
    new_theta, aux = circle.unpack(point, theta)
    return computed_together(new_theta, aux.slack, p)

  def sgd_momentum(theta, m, g):
    m = g + momentum * m
    return computed_together(theta - lr * m, m)

  k1, k2, k3 = jax.random.split(jax.random.key(args.seed), 3)
  theta = jax.random.uniform(k1, shape, jnp.float32, -radius, radius)
  xi = jnp.sqrt(radius**2 - theta**2)
  p = 0.01 * jax.random.normal(k2, shape)
  g = 0.1 * jax.random.normal(k3, shape)
  method, baseline = jax.jit(c_cola_ud), jax.jit(sgd_momentum)
  t_m, t_b = measure(
    args, (lambda *carry: method(*carry, g), lambda *carry: baseline(*carry, g)), ((theta, xi, p), (theta, p))
  )
  method_ms, baseline_ms = 1e3 * float(np.median(t_m)), 1e3 * float(np.median(t_b))
  return {
    "shape": list(shape),
    "method_ms": method_ms,
    "baseline_ms": baseline_ms,
    "ratio": method_ms / baseline_ms,
    "repetitions": len(t_m),
  }


def projection_floor(params, batch, loss_fn, h: float, args) -> dict:
  """Two matrix products per square kernel against SGD's whole training step.

  A verified projection onto the Stiefel manifold needs at least the Gram
  matrix of the moved kernel and one correction product per layer; their time
  alone bounds the o-CoLA-od / SGD step ratio from below on a machine where
  products run at their flop rate.
  """
  sgd_step, sgd_carry = build("step", optax.sgd(h), loss_fn, params, None, batch)
  # Orthogonal kernels: w (w^T w) = w, so the timed carry neither grows nor decays.
  squares = [
    jnp.linalg.qr(layer["kernel"])[0]
    for layer in params.values()
    if layer["kernel"].shape[0] == layer["kernel"].shape[1]
  ]

  @jax.jit
  def two_products(kernels):
    return [w @ (w.T @ w) for w in kernels]

  t_p, t_b = measure(args, (lambda *kernels: tuple(two_products(kernels)), sgd_step), (tuple(squares), sgd_carry))
  products_ms, sgd_ms = 1e3 * float(np.median(t_p)), 1e3 * float(np.median(t_b))
  return {
    "layers": len(squares),
    "shape": list(squares[0].shape) if squares else None,
    "products_ms": products_ms,
    "sgd_step_ms": sgd_ms,
    "ratio_bound": (sgd_ms + products_ms) / sgd_ms,
    "repetitions": len(t_p),
  }


def summarize(model, method, baseline, temperature, kind, t_method, t_base):
  return {
    "model": model,
    "method": method,
    "baseline": baseline,
    "temperature": temperature,
    "kind": kind,
    **pair_summary(t_method, t_base),
  }


def targets_from(results) -> list[dict]:
  def find(model, method, temperature_positive, kind):
    for r in results:
      if (
        r["model"] == model
        and r["method"] == method
        and r["kind"] == kind
        and (r["temperature"] > 0) == temperature_positive
      ):
        return r["ratio"]
    return None

  # The full-step limits are the speed issue's; the update's is an earlier one's.
  spec = [
    ("c_cola_ud update / SGD-m update, tau=0, mlp784", ("mlp784", "c_cola_ud", False, "update"), 2.0),
    ("c_cola_ud step / SGD-m step, tau=0, mlp784", ("mlp784", "c_cola_ud", False, "step"), 1.2),
    ("c_cola_ud step / SGD-m step, tau>0, mlp784", ("mlp784", "c_cola_ud", True, "step"), 1.6),
    ("o_cola_od step / SGD step, tau=0, spiral8x100", ("spiral8x100", "o_cola_od", False, "step"), 3.0),
  ]
  out = []
  for name, where, limit in spec:
    value = find(*where)
    out.append({"name": name, "value": value, "limit": limit, "met": None if value is None else bool(value <= limit)})
  return out


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  model_names = sorted({r["model"] for r in results}, key=[r["model"] for r in results].index)
  fig, axes = plt.subplots(1, len(model_names), figsize=(6.5 * len(model_names), 4.2), squeeze=False)
  series = [("update", False), ("update", True), ("step", False), ("step", True)]
  width = 0.2
  for ax, model in zip(axes[0], model_names):
    methods = [m for m in METHODS if any(r["model"] == model and r["method"] == m for r in results)]
    for j, (kind, noisy) in enumerate(series):
      values = []
      for m in methods:
        match = [
          r["ratio"]
          for r in results
          if r["model"] == model and r["method"] == m and r["kind"] == kind and (r["temperature"] > 0) == noisy
        ]
        values.append(match[0] if match else np.nan)
      xs = np.arange(len(methods)) + (j - 1.5) * width
      ax.bar(xs, values, width, label=f"{kind}, tau{'>0' if noisy else '=0'}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(methods)), methods)
    ax.set_yscale("log")
    ax.set_ylabel("time / baseline time (median)")
    ax.set_title(model)
    ax.legend(fontsize=8)
  fig.suptitle("CoLA step overhead vs SGD (od) / SGD-momentum (ud); i_cola_*: vs MaxNorm")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(results, state_bytes, targets) -> str:
  lines = [
    f"{'model':12s} {'method':10s} {'tau':>7s} {'kind':6s} {'method ms':>10s} "
    f"{'base ms':>9s} {'ratio':>7s} {'paired':>7s} {'n':>4s}"
  ]
  for r in results:
    lines.append(
      f"{r['model']:12s} {r['method']:10s} {r['temperature']:7.0e} {r['kind']:6s} "
      f"{r['method_ms']:10.3f} {r['baseline_ms']:9.3f} {r['ratio']:7.2f} "
      f"{r['ratio_of_paired']:7.2f} {r['repetitions']:4d}"
    )
  passes = [r for r in results if r.get("array_passes") and r["array_passes"]["method"]]
  if passes:
    lines.append("")
    lines.append(f"{'model':12s} {'method':10s} {'tau':>7s} arrays read+written by the update (method vs baseline)")
    for r in passes:
      m, b = r["array_passes"]["method"], r["array_passes"]["baseline"]
      lines.append(
        f"{r['model']:12s} {r['method']:10s} {r['temperature']:7.0e} "
        f"{m['reads']}+{m['writes']} vs {b['reads']}+{b['writes']}"
      )
  lines.append("")
  lines.append(f"{'model':12s} {'method':10s} {'state bytes':>12s} {'baseline':>10s} {'ratio':>6s}")
  for model, per in state_bytes.items():
    for m, b in per.items():
      ratio = f"{b['method'] / b['baseline']:6.2f}" if b["baseline"] else "   n/a"
      lines.append(f"{model:12s} {m:10s} {b['method']:12d} {b['baseline']:10d} {ratio}")
  lines.append("")
  lines.extend(target_lines(targets))
  return "\n".join(lines)


def parse_args(argv=None):
  p = speed_parser(__doc__, "tiny models and a few repetitions: a check that runs in seconds")
  p.add_argument("--models", nargs="+", default=["mlp784", "spiral8x100"], choices=["mlp784", "spiral8x100"])
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument(
    "--skip-heavy", action="store_true", help="skip o-CoLA on mlp784 (quasi-Newton on a 784x1000 matrix, slow)"
  )
  p.add_argument("--temperature", type=float, default=1e-6, help="the tau > 0 setting")
  p.add_argument("--repetitions", type=int, default=300, help="timed pairs per measurement")
  p.add_argument("--warmup", type=int, default=10)
  p.add_argument("--budget", type=float, default=20.0, help="seconds at most per measurement (heavy ones stop early)")
  p.add_argument("--h-c-od", type=float, default=0.1)
  p.add_argument("--h-c-ud", type=float, default=0.3)
  p.add_argument("--h-o-od", type=float, default=0.1)
  p.add_argument("--h-o-ud", type=float, default=0.3)
  p.add_argument("--friction", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  start = time.perf_counter()
  if args.smoke:
    args.repetitions = min(args.repetitions, 5)
    args.warmup = min(args.warmup, 1)
  args.out = output_dir(args.out or (None if args.smoke else "results/"), "step_overhead")
  temperatures = [0.0, args.temperature]

  jobs = []
  for model in models(args.smoke):
    if model.name not in args.models:
      continue
    for method in args.methods:
      if args.skip_heavy and model.name == "mlp784" and method.startswith("o_"):
        continue
      for temperature in temperatures:
        for kind in KINDS:
          if args.smoke and (model.name, method, temperature > 0, kind) not in SMOKE_JOBS:
            continue
          jobs.append((model, method, temperature, kind))

  try:
    if args.no_progress:
      raise ImportError
    from tqdm import tqdm

    progress = tqdm(total=len(jobs), desc="step overhead", file=sys.stderr)
  except ImportError:
    progress = None

  config = {
    "smoke": args.smoke,
    "repetitions": args.repetitions,
    "warmup": args.warmup,
    "budget_s": args.budget,
    "temperatures": temperatures,
    "models": {
      m.name: {"sizes": list(m.sizes), "batch": m.batch, "loss": m.loss, "radius": m.radius} for m in models(args.smoke)
    },
    "methods": args.methods,
    "skip_heavy": args.skip_heavy,
    "timing": "median over interleaved repetitions after warm-up; jit with donated "
    "params and state; jax.block_until_ready after every call",
  }
  json_path = os.path.join(args.out, "step_overhead.json")
  results, state_bytes = [], {}

  def written(floor=None, products=None, complete=False) -> dict:
    """The report so far, written to ``step_overhead.json``: an interrupted run keeps what it measured."""
    report = {
      "meta": provenance(argv, start),
      "config": {**config, "complete": complete},
      "results": results,
      "state_bytes": state_bytes,
      "targets": targets_from(results),
      "one_loop_floor": floor,
      "projection_floor": products,
    }
    write_json(json_path, report)
    return report

  key = jax.random.key(args.seed)
  cache: dict[str, Any] = {}
  baselines: dict[tuple, Any] = {}
  for model, method, temperature, kind in jobs:
    if model.name not in cache:
      kp, kb, kg = jax.random.split(jax.random.fold_in(key, len(cache)), 3)
      params = init_mlp(kp, model.sizes)
      batch = make_batch(model, kb)
      loss_fn = make_loss(model)
      grads = jax.grad(loss_fn)(params, batch)
      cache[model.name] = (params, batch, loss_fn, grads)
    params, batch, loss_fn, grads = cache[model.name]
    tx, base_tx, base_name, hyper = make_pair(method, model, args, temperature)
    if temperature == 0:
      state_bytes.setdefault(model.name, {})[method] = {
        "method": tree_bytes(tx.init(params)),
        "baseline": tree_bytes(base_tx.init(params)),
        "baseline_name": base_name,
        "params": tree_bytes(params),
      }
    f_m, c_m = build(kind, tx, loss_fn, params, grads, batch)
    base_key = (model.name, base_name, kind)
    if base_key not in baselines:  # one compiled baseline serves several methods
      baselines[base_key] = build(kind, base_tx, loss_fn, params, grads, batch)[0]
    f_b = baselines[base_key]
    c_b = (jax.tree.map(jnp.copy, params), base_tx.init(params))
    t_m, t_b = measure(args, (f_m, f_b), (c_m, c_b))
    record = summarize(model.name, method, base_name, temperature, kind, t_m, t_b)
    record["hyperparameters"] = hyper
    if kind == "update":
      largest = max(jax.tree.leaves(params), key=lambda leaf: leaf.size).shape
      record["array_passes"] = {
        "shape": list(largest),
        "method": array_passes(f_m, c_m, largest),
        "baseline": array_passes(f_b, c_b, largest),
      }
    results.append(record)
    written()
    if progress is not None:
      progress.set_postfix_str(f"{model.name} {method} tau={temperature:g} {kind}: {record['ratio']:.2f}x")
      progress.update()
  if progress is not None:
    progress.close()

  floor = None
  if "mlp784" in args.models and "c_cola_ud" in args.methods:
    model = next(m for m in models(args.smoke) if m.name == "mlp784")
    floor = one_loop_floor((model.sizes[0], model.sizes[1]), model.radius["Dense_0"], args.h_c_ud, args.friction, args)

  products = None
  if "spiral8x100" in cache and "o_cola_od" in args.methods:
    params, batch, loss_fn, _ = cache["spiral8x100"]
    products = projection_floor(params, batch, loss_fn, args.h_o_od, args)

  report = written(floor, products, complete=True)
  targets = report["targets"]
  plot(results, os.path.join(args.out, "step_overhead.png"))
  print(table(results, state_bytes, targets))
  if floor is not None:
    print(
      f"\none-loop updates of the {floor['shape']} kernel, no donation: c-CoLA-ud "
      f"{floor['method_ms']:.3f} ms, SGD-m {floor['baseline_ms']:.3f} ms, "
      f"ratio {floor['ratio']:.2f} (both as one loop: a reference for this state layout, not a bound)"
    )
  if products is not None:
    print(
      f"two products per square kernel ({products['layers']} x {products['shape']}): "
      f"{products['products_ms']:.3f} ms, SGD's whole step {products['sgd_step_ms']:.3f} ms: "
      f"o-CoLA-od / SGD >= {products['ratio_bound']:.2f}"
    )
  print(f"\nwrote {json_path} and {os.path.join(args.out, 'step_overhead.png')}")
  return report


if __name__ == "__main__":
  main()
