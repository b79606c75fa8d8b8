"""The paper's spiral experiment (Figs. 2-3): o-CoLA-od against SGD on deep MLPs.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 and Appendix C.

Set-up (as in the paper):

* data: a 4-turn two-class spiral. Class 0 is
  ``x = 2 sqrt(t) cos(8 sqrt(t) pi) + 0.02 N(0,1)``,
  ``y = 2 sqrt(t) sin(8 sqrt(t) pi) + 0.02 N(0,1)``, ``t ~ U(0,1)``; class 1 is
  the same with the argument shifted by ``pi``. 500 training points and 1000
  test points, half of each class. One data set (``--data-seed``) is shared by
  all methods and seeds, so the comparison is paired.
* model: an MLP with ``p`` hidden layers of 100 ReLU units (2 inputs, 1 logit),
  weights stored ``(fan_in, fan_out)`` and applied as ``x @ W + b``.
* loss: binary cross-entropy on the logit; minibatches of 25 (5 % of the
  training set), reshuffled every epoch; step size ``h = 0.1``.
* methods:

  - ``sgd``: plain SGD, PyTorch's default initialisation (weights and biases
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, which is what the paper used);
  - ``sgd_orth``: plain SGD, every weight matrix orthogonal
    (``jax.nn.initializers.orthogonal()``, gain 1; biases as PyTorch);
  - ``ocola_od``: ``cola.o_cola_od(0.1)`` at ``tau = 0`` with the ``p - 1``
    hidden-to-hidden matrices constrained (orthogonal init) and the input and
    output layers free (PyTorch init), as in the paper;
  - ``ocola_od_tau``: the same with ``tau = 1e-6`` (paper's Fig. 3).

  With ``p = 1`` there is no hidden-to-hidden matrix, so ``ocola_od`` is
  plain SGD with PyTorch init (identical to ``sgd``) and ``ocola_od_tau`` is
  SGD with a little noise.

All seeds of one (method, depth) are trained at once: ``jax.vmap`` over seeds
of the initialisation (parameters *and* optimizer, the o-CoLA key included)
and of the training loop, which is a ``jax.lax.scan`` over minibatches inside
a ``jax.lax.scan`` over epochs, compiled once per (method, depth).

Usage::

    python benchmarks/spiral.py                 # the full sweep (10 seeds, depths 1-10)
    python benchmarks/spiral.py --smoke         # a few seconds, for testing
    python benchmarks/spiral.py --epochs 500 --depths 2,4,8 --seeds 5 --out results/
    python benchmarks/spiral.py --replot results/spiral.json   # redraw the PNG only

Writes ``spiral.json`` (every number per seed, plus the configuration and the
environment) and ``spiral.png`` under ``--out``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cola_jax as cola  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
from _common import finite_list, mean_std, mean_std_fields, provenance, write_json, torch_uniform  # noqa: E402

SCHEMA_VERSION = 1

METHODS = {
    "sgd": "SGD, standard (PyTorch) init",
    "sgd_orth": "SGD, orthogonal init",
    "ocola_od": "o-CoLA-od, tau = 0",
    "ocola_od_tau": "o-CoLA-od, tau = 1e-6",
}
METHOD_ORDER = tuple(METHODS)

# The default sweep (4 methods x depths 1-10 x 10 seeds) is sized for about
# 15 minutes on a shared 2-core CPU: the o-CoLA-od projections (a few 100x100
# matrix products per hidden layer per step) dominate, about 12 s per epoch of
# the whole sweep there. 60 epochs (1200 steps) is far from converged on this
# data set; pass --epochs 1000 or more (and fewer --depths) where time allows.
DEFAULT_EPOCHS = 60
SMOKE = dict(seeds=2, depths=[1, 3], epochs=4)

# main() leaves the final parameters of its last run here, as
# LAST_RUN_PARAMS[method][depth] (each leaf with a leading seed axis).
LAST_RUN_PARAMS: dict = {}


class Config(NamedTuple):
  seeds: int = 10
  depths: tuple = tuple(range(1, 11))
  epochs: int = DEFAULT_EPOCHS
  methods: tuple = METHOD_ORDER
  width: int = 100
  n_train: int = 500
  n_test: int = 1000
  batch_size: int = 25
  learning_rate: float = 0.1
  temperature: float = 1e-6
  noise: float = 0.02
  turns: int = 4
  data_seed: int = 0
  eval_every: int = 15


# ----------------------------------------------------------------------------- data


def spiral(key: jax.Array, n: int, noise: float = 0.02, turns: int = 4):
  """``n`` points of the two-class spiral, ``n // 2`` of class 0 first, then class 1.

  Class 0: ``r = 2 sqrt(t)``, angle ``2 turns sqrt(t) pi``; class 1: angle + pi.
  Returns ``(x, y)`` with ``x`` of shape ``(n, 2)`` and labels ``y`` in {0., 1.}.
  """
  n0 = n // 2
  labels = jnp.concatenate([jnp.zeros(n0), jnp.ones(n - n0)])
  t_key, noise_key = jax.random.split(key)
  s = jnp.sqrt(jax.random.uniform(t_key, (n,)))
  angle = 2 * turns * s * jnp.pi + jnp.pi * labels
  x = jnp.stack([2 * s * jnp.cos(angle), 2 * s * jnp.sin(angle)], axis=1)
  x = x + noise * jax.random.normal(noise_key, (n, 2))
  return x.astype(jnp.float32), labels.astype(jnp.float32)


def make_data(config: Config):
  train_key, test_key = jax.random.split(jax.random.key(config.data_seed))
  return (spiral(train_key, config.n_train, config.noise, config.turns),
          spiral(test_key, config.n_test, config.noise, config.turns))


# ----------------------------------------------------------------------------- model


def layer_sizes(depth: int, width: int = 100) -> list[tuple[int, int]]:
  """``(fan_in, fan_out)`` of the ``depth + 1`` layers of the MLP."""
  dims = [2] + [width] * depth + [1]
  return list(zip(dims[:-1], dims[1:]))


def is_hidden(index: int, depth: int) -> bool:
  """Whether layer ``index`` (0 = input layer) is a hidden-to-hidden matrix."""
  return 0 < index < depth


def init_mlp(key: jax.Array, depth: int, width: int, orthogonal: Callable[[int], bool]):
  """A list of ``{'w', 'b'}``; layer ``i`` gets an orthogonal ``w`` if ``orthogonal(i)``.

  Other weights and all biases take PyTorch's default ``nn.Linear`` init,
  ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``.
  """
  params = []
  ortho_init = jax.nn.initializers.orthogonal()
  for i, (fan_in, fan_out) in enumerate(layer_sizes(depth, width)):
    key, w_key, b_key = jax.random.split(key, 3)
    if orthogonal(i):
      w = ortho_init(w_key, (fan_in, fan_out), jnp.float32)
    else:
      w = torch_uniform(w_key, (fan_in, fan_out), fan_in)
    params.append({"w": w, "b": torch_uniform(b_key, (fan_out,), fan_in)})
  return params


def mlp(params, x):
  """Logits, shape ``(batch,)``."""
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return (x @ params[-1]["w"] + params[-1]["b"])[:, 0]


def loss_fn(params, x, y):
  return jnp.mean(optax.sigmoid_binary_cross_entropy(mlp(params, x), y))


def evaluate(params, x, y):
  """(loss, accuracy) on a whole data set."""
  logits = mlp(params, x)
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))
  accuracy = jnp.mean((logits > 0) == (y > 0.5))
  return loss, accuracy


def hidden_mask(params):
  """o-CoLA-od's mask: the hidden-to-hidden weight matrices only."""
  depth = len(params) - 1
  return [{"w": is_hidden(i, depth), "b": False} for i in range(len(params))]


def orthogonality_defects(params) -> list:
  """``max |W^T W - I|`` of each hidden-to-hidden matrix (works batched over seeds)."""
  depth = len(params) - 1
  out = []
  for i in range(1, depth):
    w = params[i]["w"]
    gram = jnp.einsum("...ki,...kj->...ij", w, w, precision=jax.lax.Precision.HIGHEST)
    out.append(jnp.max(jnp.abs(gram - jnp.eye(w.shape[-1])), axis=(-2, -1)))
  return out


# ----------------------------------------------------------------------------- methods

# Methods that differ only in their initialisation (SGD) or only in their
# temperature (o-CoLA-od) share one compiled training loop: the seeds of all
# methods of a group are the members of one vmapped batch.
GROUPS = {"sgd": ("sgd", "sgd_orth"), "ocola": ("ocola_od", "ocola_od_tau")}


def group_of(name: str) -> str:
  for group, members in GROUPS.items():
    if name in members:
      return group
  raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHOD_ORDER)}")


def seed_keys(seed):
  """(init key, shuffle key, noise key) of one seed; the same for every method."""
  init_key, shuffle_key, noise_key = jax.random.split(jax.random.key(seed), 3)
  return init_key, shuffle_key, noise_key


def member_table(methods: Sequence[str], seeds: int, config: Config):
  """Per member of a group's batch: seed, orthogonal-init flag, temperature."""
  seed, all_orthogonal, temperature = [], [], []
  for m in methods:
    seed += list(range(seeds))
    all_orthogonal += [m == "sgd_orth"] * seeds
    temperature += [config.temperature if m == "ocola_od_tau" else 0.0] * seeds
  return (np.array(seed, np.int32), np.array(all_orthogonal), np.array(temperature, np.float32))


def build(group: str, depth: int, config: Config, train, test, noisy: bool = True):
  """``init(members) -> carry`` and the jitted ``run_chunk(carry) -> (carry, metrics)``.

  ``members`` is :func:`member_table`'s ``(seed, all_orthogonal, temperature)``;
  everything is vmapped over members. ``run_chunk`` trains
  ``config.eval_every`` epochs, then evaluates. ``noisy=False`` (o-CoLA only)
  builds the optimizer at exactly ``tau = 0``, drawing no noise at all.
  """
  x_train, y_train = train
  x_test, y_test = test
  h = config.learning_rate
  n_batches = config.n_train // config.batch_size
  if n_batches * config.batch_size != config.n_train:
    raise ValueError("batch_size must divide n_train")
  constrained = group == "ocola"

  def make_tx(noise_key, temperature):
    if not constrained:
      return optax.sgd(h)
    if not noisy:
      return cola.o_cola_od(h, mask=hidden_mask)
    # A traced temperature: tau = 0 members add exactly 0 * noise.
    return cola.o_cola_od(h, mask=hidden_mask, temperature=temperature, key=noise_key)

  def init_one(seed, all_orthogonal, temperature):
    init_key, shuffle_key, noise_key = seed_keys(seed)
    if constrained:
      params = init_mlp(init_key, depth, config.width, lambda i: is_hidden(i, depth))
    else:
      uniform = init_mlp(init_key, depth, config.width, lambda i: False)
      ortho = init_mlp(init_key, depth, config.width, lambda i: True)
      params = jax.tree.map(lambda o, u: jnp.where(all_orthogonal, o, u), ortho, uniform)
    opt_state = make_tx(noise_key, temperature).init(params)
    return (params, opt_state, shuffle_key, noise_key, temperature, jnp.zeros((), jnp.int32))

  def fallbacks(opt_state):
    """Constrained leaves whose projection fell back to the polar factor this step."""
    if not constrained:
      return jnp.zeros((), jnp.int32)
    infos = [leaf for leaf in jax.tree.leaves(
        opt_state.constraint_states, is_leaf=lambda n: isinstance(n, cola.ProjectionInfo))
        if isinstance(leaf, cola.ProjectionInfo)]
    return sum((~info.converged).astype(jnp.int32) for info in infos) + jnp.zeros((), jnp.int32)

  def chunk_one(carry):
    params, opt_state, shuffle_key, noise_key, temperature, n_fallbacks = carry
    # The same optimizer as at init (same key and temperature); its update
    # reads the current PRNG key from the state.
    tx = make_tx(noise_key, temperature)

    def step(inner, batch):
      params, opt_state, n_fallbacks = inner
      xb, yb = batch
      loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return (params, opt_state, n_fallbacks + fallbacks(opt_state)), loss

    def epoch(inner, key):
      order = jax.random.permutation(key, config.n_train)
      batches = (x_train[order].reshape(n_batches, config.batch_size, 2),
                 y_train[order].reshape(n_batches, config.batch_size))
      inner, losses = jax.lax.scan(step, inner, batches)
      return inner, jnp.mean(losses)

    shuffle_key, epoch_keys = jax.random.split(shuffle_key)
    (params, opt_state, n_fallbacks), batch_losses = jax.lax.scan(
        epoch, (params, opt_state, n_fallbacks), jax.random.split(epoch_keys, config.eval_every))
    train_loss, train_acc = evaluate(params, x_train, y_train)
    test_loss, test_acc = evaluate(params, x_test, y_test)
    defects = orthogonality_defects(params)
    max_defect = jnp.max(jnp.stack(defects)) if defects else jnp.zeros(())
    metrics = dict(train_loss=train_loss, train_accuracy=train_acc, test_loss=test_loss,
                   test_accuracy=test_acc, epoch_mean_batch_loss=batch_losses[-1],
                   max_orthogonality_defect=max_defect, projection_fallbacks=n_fallbacks)
    return (params, opt_state, shuffle_key, noise_key, temperature, n_fallbacks), metrics

  # init runs eagerly (op by op, cached across depths): jitting it costs
  # seconds of compilation per depth for microseconds of work.
  return jax.vmap(init_one), jax.jit(jax.vmap(chunk_one))


def train(methods: Sequence[str], depth: int, config: Config, data=None,
          progress: Optional[Callable] = None):
  """Trains ``config.seeds`` seeds of each of ``methods`` (all of one group) at ``depth``.

  Returns ``(params, history, timing)``: ``params[method]`` the final
  parameters (each leaf with a leading seed axis), ``history[method]`` a dict
  of metric name -> array ``(n_evals, seeds)`` (and ``'epoch'`` -> list), and
  ``timing`` the compile and run times in seconds (shared by the group).
  """
  methods = list(methods)
  groups = {group_of(m) for m in methods}
  if len(groups) != 1:
    raise ValueError(f"methods of one group only ({GROUPS}), got {methods}")
  if config.epochs % config.eval_every:
    raise ValueError("eval_every must divide epochs")
  group = groups.pop()
  train_data, test_data = make_data(config) if data is None else data
  members = member_table(methods, config.seeds, config)
  noisy = bool(np.any(members[2] != 0))
  init, run_chunk = build(group, depth, config, train_data, test_data, noisy=noisy)
  t0 = time.perf_counter()
  carry = init(*(jnp.asarray(a) for a in members))
  compiled = run_chunk.lower(carry).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  chunks = []
  for _ in range(config.epochs // config.eval_every):
    carry, metrics = compiled(carry)
    chunks.append(jax.device_get(metrics))
    if progress is not None:
      progress()
  run_s = time.perf_counter() - t0
  params, history = {}, {}
  for j, m in enumerate(methods):
    rows = slice(j * config.seeds, (j + 1) * config.seeds)
    params[m] = jax.tree.map(lambda a: a[rows], carry[0])
    history[m] = {k: np.stack([c[k][rows] for c in chunks]) for k in chunks[0]}
    history[m]["epoch"] = [config.eval_every * (i + 1) for i in range(len(chunks))]
  return params, history, {"compile_s": compile_s, "run_s": run_s}


# ----------------------------------------------------------------------------- reporting


def summary_table(results: dict, methods: Sequence[str], depths: Sequence[int]) -> str:
  """Method x depth: test accuracy mean +- std (%), final train loss mean +- std."""
  name_w = max(len(METHODS[m]) for m in methods)
  lines = [f"{'method':<{name_w}}  {'depth':>5}  {'test acc (%)':>15}  {'train loss':>17}  {'test loss':>17}"]
  lines.append("-" * len(lines[0]))
  for m in methods:
    for d in depths:
      r = results[m][str(d)]
      acc_m, acc_s = mean_std(r["test_accuracy"])
      tl_m, tl_s = mean_std(r["train_loss"])
      te_m, te_s = mean_std(r["test_loss"])
      lines.append(f"{METHODS[m]:<{name_w}}  {d:>5}  {100 * acc_m:7.2f} ± {100 * acc_s:5.2f}"
                   f"  {tl_m:8.4f} ± {tl_s:6.4f}  {te_m:8.4f} ± {te_s:6.4f}")
    lines.append("")
  return "\n".join(lines)


def plot(results: dict, config: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods, depths = config["methods"], config["depths"]
  colors = dict(zip(METHOD_ORDER, ["tab:gray", "tab:green", "tab:blue", "tab:orange"]))
  fig, axes = plt.subplots(1, 3, figsize=(17, 5))
  offsets = np.linspace(-0.15, 0.15, len(methods)) if len(methods) > 1 else [0.0]
  for off, m in zip(offsets, methods):
    for ax, key, scale in ((axes[0], "test_accuracy", 100), (axes[1], "train_loss", 1)):
      stats = [mean_std(results[m][str(d)][key]) for d in depths]
      mean = np.array([s[0] for s in stats]) * scale
      std = np.array([s[1] for s in stats]) * scale
      ax.errorbar(np.array(depths) + off, mean, yerr=std, marker="o", ms=4, capsize=3,
                   color=colors[m], label=METHODS[m])
  axes[0].set(xlabel="hidden layers p", ylabel="test accuracy (%)",
              title=f"test accuracy after {config['epochs']} epochs (mean ± std, {config['seeds']} seeds)")
  losses = [v for m in methods for d in depths for v in results[m][str(d)]["train_loss"]
            if v is not None and v > 0]
  log_scale = bool(losses) and max(losses) / min(losses) > 20
  axes[1].set(xlabel="hidden layers p", ylabel="train loss (full set, BCE)",
              yscale="log" if log_scale else "linear", title="final training loss (mean ± std)")
  for ax in axes[:2]:
    ax.set_xticks(depths)
    ax.grid(alpha=0.3)
  axes[0].legend(loc="best", fontsize=9)

  deep = max(depths)
  for m in methods:
    h = results[m][str(deep)]["history"]
    acc = np.array([[np.nan if v is None else v for v in row] for row in h["test_accuracy"]]) * 100
    mean, std = np.nanmean(acc, axis=1), np.nanstd(acc, axis=1)
    axes[2].plot(h["epoch"], mean, color=colors[m], label=METHODS[m])
    axes[2].fill_between(h["epoch"], mean - std, mean + std, color=colors[m], alpha=0.15)
  axes[2].set(xlabel="epoch", ylabel="test accuracy (%)",
              title=f"test accuracy during training, p = {deep}")
  axes[2].grid(alpha=0.3)
  axes[2].legend(loc="best", fontsize=9)
  fig.suptitle(f"4-turn spiral, {config['n_train']} train / {config['n_test']} test points, "
               f"batch {config['batch_size']}, h = {config['learning_rate']}, 100-unit ReLU layers")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def parse_depths(text: str) -> list[int]:
  """``"1-10"``, ``"1,3,5"`` or a mix such as ``"1-3,8"``."""
  depths = []
  for part in text.split(","):
    part = part.strip()
    if "-" in part:
      lo, hi = (int(v) for v in part.split("-", 1))
      depths.extend(range(lo, hi + 1))
    elif part:
      depths.append(int(part))
  if not depths or min(depths) < 1:
    raise argparse.ArgumentTypeError(f"depths must be positive integers, got {text!r}")
  return sorted(set(depths))


def parse_args(argv):
  p = argparse.ArgumentParser(
      description="The paper's spiral experiment: o-CoLA-od vs SGD on MLPs with 1..10 "
                  "hidden layers of 100 ReLU units (all seeds trained at once with jax.vmap).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--seeds", type=int, default=10, help="number of seeds (0..seeds-1)")
  p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                 help="training epochs (20 steps of batch 25 each)")
  p.add_argument("--depths", type=parse_depths, default="1-10",
                 help='hidden-layer counts: "1-10", "1,3,5" or "1-3,8"')
  p.add_argument("--methods", default=",".join(METHOD_ORDER),
                 help=f"comma list from {', '.join(METHOD_ORDER)}")
  p.add_argument("--out", default="results/", help="output directory")
  p.add_argument("--eval-every", type=int, default=None,
                 help="epochs between evaluations (must divide --epochs); default ~epochs/20")
  p.add_argument("--temperature", type=float, default=1e-6, help="tau of ocola_od_tau")
  p.add_argument("--learning-rate", type=float, default=0.1, help="h for every method")
  p.add_argument("--data-seed", type=int, default=0, help="seed of the (shared) data set")
  p.add_argument("--smoke", action="store_true",
                 help=f"tiny run for tests: {SMOKE['seeds']} seeds, depths "
                      f"{SMOKE['depths']}, {SMOKE['epochs']} epochs")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.add_argument("--replot", metavar="JSON",
                 help="only redraw the PNG (next to JSON) from an existing spiral.json")
  args = p.parse_args(argv)
  if args.replot:
    return args, None
  if args.smoke:
    args.seeds, args.depths, args.epochs = SMOKE["seeds"], SMOKE["depths"], SMOKE["epochs"]
  methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
  for m in methods:
    if m not in METHODS:
      p.error(f"unknown method {m!r}; choose from {', '.join(METHOD_ORDER)}")
  if args.seeds < 1 or args.epochs < 1:
    p.error("--seeds and --epochs must be positive")
  eval_every = args.eval_every
  if eval_every is None:
    eval_every = max(1, args.epochs // 20)
    while args.epochs % eval_every:
      eval_every -= 1
  elif eval_every < 1 or args.epochs % eval_every:
    p.error("--eval-every must be a positive divisor of --epochs")
  config = Config(seeds=args.seeds, depths=tuple(args.depths), epochs=args.epochs,
                  methods=methods, learning_rate=args.learning_rate,
                  temperature=args.temperature, data_seed=args.data_seed, eval_every=eval_every)
  return args, config


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Runs the sweep, writes ``spiral.json`` and ``spiral.png`` under ``--out``.

  Returns the dict written to ``spiral.json``.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args, config = parse_args(argv)
  if args.replot:
    with open(args.replot) as f:
      out = json.load(f)
    png_path = os.path.join(os.path.dirname(os.path.abspath(args.replot)), "spiral.png")
    plot(out["results"], out["config"], png_path)
    print(summary_table(out["results"], out["config"]["methods"], out["config"]["depths"]))
    print(f"wrote {png_path}")
    return out
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  data = make_data(config)

  from tqdm.auto import tqdm
  n_chunks = config.epochs // config.eval_every
  bar = tqdm(total=len(config.methods) * len(config.depths) * n_chunks, unit="chunk",
             disable=args.quiet, dynamic_ncols=True)
  results: dict[str, Any] = {m: {} for m in config.methods}
  LAST_RUN_PARAMS.clear()
  LAST_RUN_PARAMS.update({m: {} for m in config.methods})
  for depth in config.depths:
    for group, members in GROUPS.items():
      names = [m for m in members if m in config.methods]
      if not names:
        continue
      bar.set_description(f"p={depth} {group}")
      params, hists, timing = train(names, depth, config, data, progress=lambda: bar.update(len(names)))
      for name in names:
        LAST_RUN_PARAMS[name][depth] = params[name]
        hist = hists[name]
        final = {k: v[-1] for k, v in hist.items() if k != "epoch"}
        entry = {
            "test_accuracy": finite_list(final["test_accuracy"]),
            "test_loss": finite_list(final["test_loss"]),
            "train_accuracy": finite_list(final["train_accuracy"]),
            "train_loss": finite_list(final["train_loss"]),
            "last_epoch_mean_batch_loss": finite_list(final["epoch_mean_batch_loss"]),
            "history": {"epoch": hist["epoch"],
                        **{k: finite_list(hist[k]) for k in
                           ("test_accuracy", "test_loss", "train_accuracy", "train_loss")}},
            "group_compile_time_s": timing["compile_s"],
            "group_run_time_s": timing["run_s"],
            "group": names,
        }
        if group == "ocola":
          entry["max_orthogonality_defect"] = finite_list(final["max_orthogonality_defect"])
          entry["projection_fallbacks"] = [int(v) for v in final["projection_fallbacks"]]
        results[name][str(depth)] = entry
        acc_m, acc_s = mean_std(entry["test_accuracy"])
        bar.write(f"p={depth:2d} {name:<13} test acc {100 * acc_m:6.2f} ± {100 * acc_s:5.2f} %")
      bar.write(f"      ({'+'.join(names)}: compile {timing['compile_s']:.1f} s, "
                f"run {timing['run_s']:.1f} s)")
  bar.close()

  config_dict = {**config._asdict(), "depths": list(config.depths), "methods": list(config.methods),
                 "steps_per_epoch": config.n_train // config.batch_size,
                 "init": {"sgd": "PyTorch nn.Linear default: W, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))",
                          "sgd_orth": "W: jax.nn.initializers.orthogonal() (gain 1) for every layer; b as PyTorch",
                          "ocola_od": "hidden-to-hidden W orthogonal and constrained; input/output W and all b as PyTorch",
                          "ocola_od_tau": "as ocola_od"},
                 "data": "one data set (data_seed) shared by all methods and seeds; seed s fixes "
                         "init, minibatch order and noise, the same for every method"}
  summary = {m: {str(d): mean_std_fields(results[m][str(d)], ("test_accuracy", "train_loss"))
                 for d in config.depths} for m in config.methods}
  out = {
      "schema_version": SCHEMA_VERSION,
      "experiment": "spiral (Leimkuhler et al., Constraint-Based Regularization of Neural Networks, Figs. 2-3)",
      "config": config_dict,
      "methods": {m: METHODS[m] for m in config.methods},
      "depths": list(config.depths),
      "seeds": list(range(config.seeds)),
      "results": results,
      "summary": summary,
      **provenance(argv, start),
  }
  json_path = os.path.join(args.out, "spiral.json")
  write_json(json_path, out)
  png_path = os.path.join(args.out, "spiral.png")
  plot(results, out["config"], png_path)
  print()
  print(summary_table(results, config.methods, config.depths))
  print(f"wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")
  return out


if __name__ == "__main__":
  main()
