"""The paper's Fashion-MNIST experiment (Fig. 5, appendix "Circle constraints"): c-CoLA-ud vs SGD-m.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 and the appendix table of Fashion-MNIST results.

Set-up (as in the paper, with the choices it leaves open stated):

* data: Fashion-MNIST IDX files (Debian package ``dataset-fashion-mnist``,
  installed under ``/usr/share/datasets/fashion-mnist/``, or ``--data-dir``
  holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally
  ``.gz``). Training set: the **first 10,000 images of the official training
  set** (the paper does not say which 10k); test set: the other 60,000 images
  (official training images 10,000-59,999, then the 10,000 official test
  images). Pixels scaled to [0, 1], no other normalisation.
* model: 784-1000-10 ReLU MLP, weights stored ``(fan_in, fan_out)``, PyTorch's
  default ``nn.Linear`` init (weights and biases ``U(+-1/sqrt(fan_in))``).
* loss: softmax cross-entropy; minibatches of 128 reshuffled every epoch, the
  last one of each epoch smaller (10,000 = 78 x 128 + 16: 79 steps per epoch,
  as PyTorch's ``DataLoader`` with ``drop_last=False``; the short batch is a
  full-size batch with zero weights on the padding, its loss the mean over its
  16 real samples).
* methods (default):

  - ``ccola_ud``: ``cola.c_cola_ud(0.3, friction=1.0, radius={'layer0': 0.05,
    'layer1': 0.1})`` at ``tau = 0``: every entry of the first kernel in
    [-0.05, 0.05], of the second in [-0.1, 0.1], biases free. (PyTorch's init
    is inside both boxes, so nothing is clipped at the start.) In SGD-m terms
    this is learning rate 0.09, momentum exp(-0.3) = 0.741.
  - ``sgdm_h0.1_m0.9``: ``optax.sgd(0.1, momentum=0.9)``;
  - ``sgdm_h0.1_m0.9_wd``: ``optax.chain(optax.add_decayed_weights(1e-4),
    optax.sgd(0.1, momentum=0.9))``, PyTorch's ``SGD(weight_decay=1e-4)``: the
    decay ``wd * w`` is added to the gradient of every parameter (biases
    included, as PyTorch's default parameter group does) before the momentum
    buffer ``b <- mom * b + g``, and ``w <- w - lr * b`` (``tests`` check this
    against the recursion written out by hand).

  ``--grid`` adds the SGD-m grid of the appendix table: ``(h, mom)`` in
  (0.2, 0.8), (0.2, 0.7), (0.1, 0.9), (0.1, 0.8), (0.1, 0.7), (0.05, 0.95),
  (0.05, 0.9), (0.05, 0.8), each without and with weight decay 1e-4.

Seed ``s`` fixes the initialisation and the minibatch order, the same for every
method (paired comparison). All seeds of a method train at once (``jax.vmap``
over seeds of the init and of the training loop, a ``jax.lax.scan`` over
minibatches inside a ``jax.lax.scan`` over epochs). Methods advance in turn,
``--eval-every`` epochs at a time, and after each round the JSON is rewritten
(``status: running``), so an interrupted run leaves all methods at the same
epoch.

Usage::

    python benchmarks/fashion_mnist.py                  # the paper's protocol: 5 seeds, 400 epochs
    python benchmarks/fashion_mnist.py --smoke          # seconds; synthetic data if the IDX files are missing
    python benchmarks/fashion_mnist.py --epochs 100 --seeds 3 --eval-every 5 --out results/
    python benchmarks/fashion_mnist.py --grid           # + the appendix table's SGD-m grid
    python benchmarks/fashion_mnist.py --replot results/fashion_mnist.json

Writes ``fashion_mnist.json`` and ``fashion_mnist.png`` under ``--out``;
prints a table with the published numbers next to ours.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import struct
import pathlib
import sys
import time
from typing import NamedTuple, Optional, Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cola_jax as cola  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
from _common import finite_list, mean_std, mean_std_fields, nan_array, provenance, torch_uniform, write_json  # noqa: E402

SCHEMA_VERSION = 1
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
INSTALL_HINT = ("Install Debian's package (`apt-get install dataset-fashion-mnist`, files under "
                f"{DEFAULT_DATA_DIR}) or pass --data-dir DIR with the four IDX files "
                f"{', '.join(IDX_FILES.values())} (each may be gzipped, '.gz').")

CCOLA = dict(learning_rate=0.3, friction=1.0, radius={"layer0": 0.05, "layer1": 0.1})
# The appendix table's SGD-m grid, (h, momentum).
GRID = ((0.2, 0.8), (0.2, 0.7), (0.1, 0.9), (0.1, 0.8), (0.1, 0.7), (0.05, 0.95), (0.05, 0.9),
        (0.05, 0.8))
WEIGHT_DECAY = 1e-4
# Published test accuracy (%) and test loss after 400 epochs, mean of 5 runs.
PUBLISHED = {"ccola_ud": (87.61, 0.386)}
_TABLE = {(0.2, 0.8): (87.18, 1.06, 84.05, 0.696), (0.2, 0.7): (87.38, 0.890, 87.0, 0.547),
          (0.1, 0.9): (86.97, 1.133, 85.35, 0.634), (0.1, 0.8): (87.39, 0.824, 87.47, 0.531),
          (0.1, 0.7): (87.39, 0.750, 87.25, 0.517), (0.05, 0.95): (86.67, 1.226, 85.63, 0.623),
          (0.05, 0.9): (87.33, 0.837, 86.24, 0.569), (0.05, 0.8): (87.27, 0.719, 87.33, 0.511)}


def sgdm_name(h: float, momentum: float, wd: bool) -> str:
  return f"sgdm_h{h:g}_m{momentum:g}" + ("_wd" if wd else "")


for (_h, _m), (_a, _l, _aw, _lw) in _TABLE.items():
  PUBLISHED[sgdm_name(_h, _m, False)] = (_a, _l)
  PUBLISHED[sgdm_name(_h, _m, True)] = (_aw, _lw)

DEFAULT_METHODS = ("ccola_ud", sgdm_name(0.1, 0.9, False), sgdm_name(0.1, 0.9, True))
GRID_METHODS = tuple(sgdm_name(h, m, wd) for wd in (False, True) for h, m in GRID)
DEFAULT_EPOCHS = 400
SMOKE = dict(seeds=2, epochs=2, eval_every=1, n_train=2000, n_test=2000)

# main() leaves the final parameters of its last run here: LAST_RUN_PARAMS[method]
# = {'layer0': {'w', 'b'}, 'layer1': {'w', 'b'}}, each leaf with a leading seed axis.
LAST_RUN_PARAMS: dict = {}


def describe(method: str) -> str:
  if method == "ccola_ud":
    return "c-CoLA-ud h=0.3 gamma=1 r=(0.05, 0.1)"
  spec = parse_method(method)
  return f"SGD-m h={spec['lr']:g} mom={spec['momentum']:g}" + (" WD 1e-4" if spec["wd"] else "")


def parse_method(method: str) -> dict:
  """``'ccola_ud'`` or ``'sgdm_h<lr>_m<mom>[_wd]'`` -> a dict of hyperparameters."""
  if method == "ccola_ud":
    return {"kind": "ccola_ud", **CCOLA}
  parts = method.split("_")
  try:
    if parts[0] != "sgdm" or not parts[1].startswith("h") or not parts[2].startswith("m"):
      raise ValueError
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "wd"):
      raise ValueError
    return {"kind": "sgdm", "lr": float(parts[1][1:]), "momentum": float(parts[2][1:]),
            "wd": WEIGHT_DECAY if len(parts) == 4 else 0.0}
  except (ValueError, IndexError):
    raise ValueError(f"unknown method {method!r}: 'ccola_ud' or 'sgdm_h<lr>_m<momentum>[_wd]', "
                     f"e.g. {DEFAULT_METHODS[1]}") from None


def make_optimizer(method: str) -> optax.GradientTransformation:
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    return cola.c_cola_ud(spec["learning_rate"], friction=spec["friction"], radius=spec["radius"])
  sgd = optax.sgd(spec["lr"], momentum=spec["momentum"])
  if spec["wd"]:
    # PyTorch's SGD weight_decay: g + wd * w enters the momentum buffer.
    return optax.chain(optax.add_decayed_weights(spec["wd"]), sgd)
  return sgd


class Config(NamedTuple):
  seeds: int = 5
  epochs: int = DEFAULT_EPOCHS
  methods: tuple = DEFAULT_METHODS
  n_train: int = 10_000
  n_test: int = 60_000
  hidden: int = 1000
  batch_size: int = 128
  eval_every: int = 20
  eval_batch: int = 10_000


# ----------------------------------------------------------------------------- data


def read_idx(path: str) -> np.ndarray:
  """An IDX file (optionally gzipped) as a numpy array."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
  if zero != 0 or dtype_code != 0x08:
    raise ValueError(f"{path}: not an unsigned-byte IDX file")
  shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
  data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
  if data.size != math.prod(shape):
    raise ValueError(f"{path}: expected {math.prod(shape)} values, found {data.size}")
  return data.reshape(shape)


def find_idx_files(data_dir: str) -> Optional[dict]:
  """Paths of the four IDX files under ``data_dir`` (plain or ``.gz``), or None."""
  paths = {}
  for key, name in IDX_FILES.items():
    for candidate in (name, name + ".gz", name.replace("-idx", ".idx"), name.replace("-idx", ".idx") + ".gz"):
      path = os.path.join(data_dir, candidate)
      if os.path.isfile(path):
        paths[key] = path
        break
    else:
      return None
  return paths


def load_fashion_mnist(data_dir: Optional[str] = None):
  """The official 60k train and 10k test sets: ``(x uint8 (n, 784), y int)`` each."""
  directory = data_dir or DEFAULT_DATA_DIR
  paths = find_idx_files(directory)
  if paths is None:
    raise FileNotFoundError(f"Fashion-MNIST IDX files not found in {directory}. {INSTALL_HINT}")
  arrays = {k: read_idx(p) for k, p in paths.items()}
  x_tr, y_tr = arrays["train_images"].reshape(-1, 784), arrays["train_labels"].astype(np.int32)
  x_te, y_te = arrays["test_images"].reshape(-1, 784), arrays["test_labels"].astype(np.int32)
  if len(x_tr) != len(y_tr) or len(x_te) != len(y_te):
    raise ValueError(f"{directory}: images and labels disagree in number")
  return (x_tr, y_tr), (x_te, y_te), paths


def synthetic_fashion_mnist(n_train: int, n_test: int, seed: int = 0):
  """A stand-in of the same shapes (uint8 784-pixel images, 10 classes): class prototypes + noise."""
  rng = np.random.default_rng(seed)
  prototypes = rng.uniform(0, 255, (10, 784))
  def draw(n):
    y = rng.integers(0, 10, n).astype(np.int32)
    x = np.clip(prototypes[y] * rng.uniform(0.3, 1.0, (n, 1)) + rng.normal(0, 60, (n, 784)), 0, 255)
    return x.astype(np.uint8), y
  return draw(n_train), draw(n_test)


def make_data(config: Config, data_dir: Optional[str] = None, allow_synthetic: bool = False,
              force_synthetic: bool = False):
  """``(train, test, info)``; ``train = (x float32 in [0,1], y int32)``.

  Train: the first ``n_train`` official training images. Test: the remaining
  training images followed by the official test images, the first ``n_test``
  of them (all 60,000 by default).
  """
  if not force_synthetic:
    try:
      (x_tr, y_tr), (x_te, y_te), paths = load_fashion_mnist(data_dir)
      source = {"source": "fashion-mnist IDX", "synthetic": False, "files": paths,
                "train": f"official training images 0..{config.n_train - 1}",
                "test": f"official training images {config.n_train}..{len(x_tr) - 1}, then official "
                        f"test images 0..{len(x_te) - 1}; the first {config.n_test} of these"}
      x_all, y_all = np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])
      available = len(x_all) - config.n_train
      if config.n_test > available:
        raise ValueError(f"n_test = {config.n_test} but only {available} images remain after training")
      train = (x_all[:config.n_train], y_all[:config.n_train])
      test = (x_all[config.n_train:config.n_train + config.n_test],
              y_all[config.n_train:config.n_train + config.n_test])
    except FileNotFoundError:
      if not allow_synthetic:
        raise
      force_synthetic = True
  if force_synthetic:
    train, test = synthetic_fashion_mnist(config.n_train, config.n_test)
    source = {"source": "SYNTHETIC stand-in (class prototypes + noise, same shapes as Fashion-MNIST); "
                        "not Fashion-MNIST: numbers are meaningless for the paper", "synthetic": True}
  to_float = lambda xy: (jnp.asarray(xy[0], jnp.float32) / 255.0, jnp.asarray(xy[1], jnp.int32))
  return to_float(train), to_float(test), source


# ----------------------------------------------------------------------------- model


def init_mlp(key: jax.Array, hidden: int = 1000) -> dict:
  """784-hidden-10, PyTorch ``nn.Linear`` default init for weights and biases."""
  params = {}
  for i, (fan_in, fan_out) in enumerate([(784, hidden), (hidden, 10)]):
    key, w_key, b_key = jax.random.split(key, 3)
    params[f"layer{i}"] = {"w": torch_uniform(w_key, (fan_in, fan_out), fan_in),
                           "b": torch_uniform(b_key, (fan_out,), fan_in)}
  return params


def mlp(params, x):
  h = jax.nn.relu(x @ params["layer0"]["w"] + params["layer0"]["b"])
  return h @ params["layer1"]["w"] + params["layer1"]["b"]


def weighted_loss(params, x, y, weight):
  """Mean cross-entropy over the samples with weight 1 (padding has weight 0)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y)
  return jnp.sum(ce * weight) / jnp.sum(weight)


def evaluate(params, x, y, eval_batch: int):
  """(mean loss, accuracy) over a whole data set, ``eval_batch`` images at a time."""
  n = x.shape[0]
  n_chunks = -(-n // eval_batch)
  pad = n_chunks * eval_batch - n
  xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(n_chunks, eval_batch, -1)
  ys = jnp.pad(y, (0, pad)).reshape(n_chunks, eval_batch)
  ws = (jnp.arange(n_chunks * eval_batch) < n).astype(jnp.float32).reshape(n_chunks, eval_batch)

  def one(args):
    xb, yb, wb = args
    logits = mlp(params, xb)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    return jnp.sum(ce * wb), jnp.sum((jnp.argmax(logits, -1) == yb) * wb)

  loss_sum, correct = jax.lax.map(one, (xs, ys, ws))
  return jnp.sum(loss_sum) / n, jnp.sum(correct) / n


def seed_keys(seed):
  """(init key, shuffle key) of one seed, the same for every method."""
  init_key, shuffle_key = jax.random.split(jax.random.key(seed))
  return init_key, shuffle_key


def max_abs_weights(params) -> dict:
  """``max |w|`` of each layer's kernel (batched over seeds if the leaves are)."""
  return {name: jnp.max(jnp.abs(layer["w"]), axis=(-2, -1)) for name, layer in params.items()}


def build(method: str, config: Config):
  """``init(seeds) -> carry`` and the jitted ``run_chunk(carry, data) -> (carry, metrics)``.

  ``run_chunk`` trains ``config.eval_every`` epochs (vmapped over seeds), then
  evaluates on the whole training and test sets.
  """
  tx = make_optimizer(method)
  n, bs = config.n_train, config.batch_size
  n_batches = -(-n // bs)
  pad = n_batches * bs - n

  def init_one(seed):
    init_key, shuffle_key = seed_keys(seed)
    params = init_mlp(init_key, config.hidden)
    return params, tx.init(params), shuffle_key

  def chunk_one(carry, data):
    params, opt_state, shuffle_key = carry
    x_train, y_train, x_test, y_test = data

    def step(inner, batch):
      params, opt_state = inner
      idx, weight = batch
      loss, grads = jax.value_and_grad(weighted_loss)(params, x_train[idx], y_train[idx], weight)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    def epoch(inner, key):
      order = jnp.concatenate([jax.random.permutation(key, n), jnp.zeros(pad, jnp.int32)])
      weight = (jnp.arange(n_batches * bs) < n).astype(jnp.float32)
      inner, losses = jax.lax.scan(step, inner, (order.reshape(n_batches, bs),
                                                 weight.reshape(n_batches, bs)))
      return inner, jnp.mean(losses)

    shuffle_key, epoch_keys = jax.random.split(shuffle_key)
    (params, opt_state), batch_losses = jax.lax.scan(
        epoch, (params, opt_state), jax.random.split(epoch_keys, config.eval_every))
    train_loss, train_acc = evaluate(params, x_train, y_train, min(config.eval_batch, n))
    test_loss, test_acc = evaluate(params, x_test, y_test, min(config.eval_batch, config.n_test))
    metrics = dict(train_loss=train_loss, train_accuracy=train_acc, test_loss=test_loss,
                   test_accuracy=test_acc, epoch_mean_batch_loss=batch_losses[-1],
                   **{f"max_abs_w_{k}": v for k, v in max_abs_weights(params).items()})
    return (params, opt_state, shuffle_key), metrics

  return jax.vmap(init_one), jax.jit(jax.vmap(chunk_one, in_axes=(0, None)))


# ----------------------------------------------------------------------------- reporting


def summarize(entry: dict) -> dict:
  return mean_std_fields(entry, ("test_accuracy", "test_loss", "best_test_accuracy",
                                 "min_test_loss", "train_accuracy", "train_loss"))


def summary_table(results: dict, methods: Sequence[str]) -> str:
  name_w = max(len(describe(m)) for m in methods)
  head = (f"{'method':<{name_w}}  {'final test acc %':>16}  {'best test acc %':>16}  "
          f"{'final test loss':>16}  {'min test loss':>16}  {'train acc %':>8}  {'published':>15}")
  lines = [head, "-" * len(head)]
  for m in methods:
    r = results[m]
    cells = []
    for key, scale, fmt in (("test_accuracy", 100, "6.2f"), ("best_test_accuracy", 100, "6.2f"),
                            ("test_loss", 1, "6.3f"), ("min_test_loss", 1, "6.3f")):
      mean, std = mean_std(r[key])
      cells.append(f"{scale * mean:{fmt}} ± {scale * std:{'5.2f' if scale == 100 else '5.3f'}}")
    tr, _ = mean_std(r["train_accuracy"])
    pub = PUBLISHED.get(m)
    pub_s = f"{pub[0]:.2f} % / {pub[1]:.3f}" if pub else "-"
    lines.append(f"{describe(m):<{name_w}}  " + "  ".join(f"{c:>16}" for c in cells)
                 + f"  {100 * tr:8.2f}  {pub_s:>15}")
  return "\n".join(lines)


def plot(results: dict, config: dict, path: str, data_info: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods = [m for m in config["methods"] if m in results and results[m]["history"]["epoch"]]
  cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
  fig, axes = plt.subplots(1, 2, figsize=(14, 5))
  for i, m in enumerate(methods):
    h = results[m]["history"]
    color = "black" if m == "ccola_ud" else cmap(i % cmap.N)
    for ax, key, scale in ((axes[0], "test_loss", 1), (axes[1], "test_accuracy", 100)):
      a = nan_array(h[key]) * scale
      mean, std = np.nanmean(a, axis=1), np.nanstd(a, axis=1)
      ax.plot(h["epoch"], mean, color=color, lw=2 if m == "ccola_ud" else 1.2, label=describe(m),
              marker="o" if len(h["epoch"]) < 3 else None)
      ax.fill_between(h["epoch"], mean - std, mean + std, color=color, alpha=0.15)
  axes[0].set(xlabel="epoch", ylabel="test loss (cross-entropy)", title="test loss (mean ± std over seeds)")
  axes[1].set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy (mean ± std over seeds)")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[1].legend(loc="lower right", fontsize=8)
  synthetic = " — SYNTHETIC DATA, not Fashion-MNIST" if data_info.get("synthetic") else ""
  fig.suptitle(f"Fashion-MNIST, {config['n_train']} train / {config['n_test']} test images, "
               f"784-{config['hidden']}-10 ReLU MLP, batch {config['batch_size']}, "
               f"{config['seeds']} seeds, {config['epochs_completed']} of {config['epochs']} epochs{synthetic}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv):
  p = argparse.ArgumentParser(
      description="The paper's Fashion-MNIST experiment: c-CoLA-ud vs SGD-m (with and without "
                  "weight decay) on a 784-1000-10 ReLU MLP, 10k training images, 60k test images "
                  "(all seeds of a method trained at once with jax.vmap).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--seeds", type=int, default=5, help="number of seeds (0..seeds-1)")
  p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                 help="training epochs (79 steps of batch 128 on 10k images)")
  p.add_argument("--eval-every", type=int, default=None,
                 help="epochs between evaluations on the test set (must divide --epochs); "
                      "default ~epochs/20")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                 help="comma list of 'ccola_ud' and 'sgdm_h<lr>_m<momentum>[_wd]'")
  p.add_argument("--grid", action="store_true",
                 help="add the appendix table's SGD-m grid (8 (h, mom) pairs, with and without WD 1e-4)")
  p.add_argument("--data-dir", default=None,
                 help=f"directory with the four Fashion-MNIST IDX files (default {DEFAULT_DATA_DIR})")
  p.add_argument("--synthetic", action="store_true",
                 help="use a synthetic stand-in of the same shapes (for testing only)")
  p.add_argument("--n-train", type=int, default=10_000, help="training images (first of the official train set)")
  p.add_argument("--n-test", type=int, default=60_000, help="test images (the following ones)")
  p.add_argument("--out", default="results/", help="output directory")
  p.add_argument("--smoke", action="store_true",
                 help=f"tiny run for tests: {SMOKE['seeds']} seeds, {SMOKE['epochs']} epochs, "
                      f"{SMOKE['n_train']} train / {SMOKE['n_test']} test images; synthetic data "
                      "when the IDX files are missing")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.add_argument("--replot", metavar="JSON", help="only redraw the PNG (next to JSON) from a fashion_mnist.json")
  args = p.parse_args(argv)
  if args.replot:
    return args, None
  if args.smoke:
    args.seeds, args.epochs, args.n_train, args.n_test = (SMOKE[k] for k in ("seeds", "epochs", "n_train", "n_test"))
    if args.eval_every is None:
      args.eval_every = SMOKE["eval_every"]
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  if args.grid:
    methods += [m for m in GRID_METHODS if m not in methods]
  for m in methods:
    try:
      parse_method(m)
    except ValueError as error:
      p.error(str(error))
  if args.seeds < 1 or args.epochs < 1 or args.n_train < 1 or args.n_test < 1:
    p.error("--seeds, --epochs, --n-train and --n-test must be positive")
  eval_every = args.eval_every
  if eval_every is None:
    eval_every = max(1, args.epochs // 20)
    while args.epochs % eval_every:
      eval_every -= 1
  elif eval_every < 1 or args.epochs % eval_every:
    p.error("--eval-every must be a positive divisor of --epochs")
  config = Config(seeds=args.seeds, epochs=args.epochs, methods=tuple(dict.fromkeys(methods)),
                  n_train=args.n_train, n_test=args.n_test, eval_every=eval_every)
  return args, config


def _entry(hist: list, timing: dict, method: str) -> dict:
  """The JSON entry of a method from its list of per-evaluation metric dicts (arrays over seeds)."""
  stack = {k: np.stack([c[k] for c in hist]) for k in hist[0]} if hist else {}
  if not hist:
    return {}
  test_acc, test_loss = stack["test_accuracy"], stack["test_loss"]
  entry = {
      "test_accuracy": finite_list(test_acc[-1]),
      "test_loss": finite_list(test_loss[-1]),
      "best_test_accuracy": finite_list(np.nanmax(test_acc, axis=0)),
      "best_test_accuracy_epoch": [int(timing["epochs"][i]) for i in np.nanargmax(test_acc, axis=0)],
      "min_test_loss": finite_list(np.nanmin(test_loss, axis=0)),
      "min_test_loss_epoch": [int(timing["epochs"][i]) for i in np.nanargmin(test_loss, axis=0)],
      "train_accuracy": finite_list(stack["train_accuracy"][-1]),
      "train_loss": finite_list(stack["train_loss"][-1]),
      "last_epoch_mean_batch_loss": finite_list(stack["epoch_mean_batch_loss"][-1]),
      "max_abs_weight": {k[len("max_abs_w_"):]: finite_list(stack[k][-1]) for k in stack
                         if k.startswith("max_abs_w_")},
      "history": {"epoch": list(timing["epochs"]),
                  **{k: finite_list(stack[k]) for k in
                     ("test_accuracy", "test_loss", "train_accuracy", "train_loss")}},
      "compile_time_s": timing["compile_s"],
      "run_time_s": timing["run_s"],
      "time_per_epoch_s": timing["run_s"] / max(1, timing["epochs"][-1]),
      "hyperparameters": {k: v for k, v in parse_method(method).items()},
  }
  return entry


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Runs the experiment, writes ``fashion_mnist.json`` and ``fashion_mnist.png`` under ``--out``.

  Returns the dict written to ``fashion_mnist.json``.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args, config = parse_args(argv)
  if args.replot:
    with open(args.replot) as f:
      out = json.load(f)
    png_path = os.path.join(os.path.dirname(os.path.abspath(args.replot)), "fashion_mnist.png")
    plot(out["results"], out["config"], png_path, out["data"])
    print(summary_table(out["results"], [m for m in out["config"]["methods"] if out["results"][m]]))
    print(f"wrote {png_path}")
    return out
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  try:
    train, test, data_info = make_data(config, args.data_dir, allow_synthetic=args.smoke,
                                       force_synthetic=args.synthetic)
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  data = (*train, *test)

  from tqdm.auto import tqdm
  n_chunks = config.epochs // config.eval_every
  steps_per_epoch = -(-config.n_train // config.batch_size)
  seeds = jnp.arange(config.seeds)
  runners, carries, hists, timing = {}, {}, {}, {}
  for m in config.methods:
    init, run_chunk = build(m, config)
    t0 = time.perf_counter()
    carries[m] = init(seeds)
    runners[m] = run_chunk.lower(carries[m], data).compile()
    timing[m] = {"compile_s": time.perf_counter() - t0, "run_s": 0.0, "epochs": []}
    hists[m] = []

  json_path = os.path.join(args.out, "fashion_mnist.json")
  png_path = os.path.join(args.out, "fashion_mnist.png")
  config_dict = {**config._asdict(), "methods": list(config.methods), "steps_per_epoch": steps_per_epoch,
                 "last_batch_size": config.n_train - (steps_per_epoch - 1) * config.batch_size,
                 "init": "PyTorch nn.Linear default: W, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); "
                         "c-CoLA-ud's slack xi = sqrt(r^2 - w^2) (no weight is clipped: 1/sqrt(784) < 0.05)",
                 "ccola_ud": {"learning_rate": CCOLA["learning_rate"], "friction": CCOLA["friction"],
                              "radius": CCOLA["radius"], "temperature": 0.0,
                              "sgd_momentum_equivalent": dict(zip(("learning_rate", "momentum"),
                                  cola.langevin_to_sgd_momentum(CCOLA["learning_rate"], CCOLA["friction"])))},
                 "weight_decay": f"{WEIGHT_DECAY} on every parameter (biases included), added to the "
                                 "gradient before momentum, as torch.optim.SGD(weight_decay=...)",
                 "pairing": "seed s fixes init and minibatch order, the same for every method"}

  def write(status: str) -> dict:
    results = {m: _entry(hists[m], timing[m], m) for m in config.methods}
    done = [m for m in config.methods if results[m]]
    epochs_completed = min((timing[m]["epochs"][-1] if timing[m]["epochs"] else 0) for m in config.methods)
    out = {
        "schema_version": SCHEMA_VERSION,
        "experiment": "Fashion-MNIST (Leimkuhler et al., Constraint-Based Regularization of Neural "
                      "Networks, Fig. 5 and appendix 'Circle constraints' table)",
        "status": status,
        "config": {**config_dict, "epochs_completed": epochs_completed},
        "data": data_info,
        "methods": {m: describe(m) for m in config.methods},
        "seeds": list(range(config.seeds)),
        "results": results,
        "summary": {m: summarize(results[m]) for m in done},
        "published": {m: {"test_accuracy_percent": PUBLISHED[m][0], "test_loss": PUBLISHED[m][1]}
                      for m in config.methods if m in PUBLISHED},
        **provenance(argv, start),
    }
    write_json(json_path, out)
    if done:
      plot(results, out["config"], png_path, data_info)
    return out

  bar = tqdm(total=len(config.methods) * n_chunks, unit="chunk", disable=args.quiet, dynamic_ncols=True)
  for chunk in range(n_chunks):
    for m in config.methods:
      bar.set_description(f"epoch {(chunk + 1) * config.eval_every} {m}")
      t0 = time.perf_counter()
      carries[m], metrics = runners[m](carries[m], data)
      metrics = jax.device_get(metrics)
      timing[m]["run_s"] += time.perf_counter() - t0
      timing[m]["epochs"].append((chunk + 1) * config.eval_every)
      hists[m].append(metrics)
      bar.update(1)
      if chunk == 0:
        per_epoch = timing[m]["run_s"] / config.eval_every
        bar.write(f"{m}: compile {timing[m]['compile_s']:.1f} s, {per_epoch:.2f} s/epoch for "
                  f"{config.seeds} seeds (incl. evaluation)")
    if chunk == 0:
      per_epoch = sum(timing[m]["run_s"] for m in config.methods) / config.eval_every
      bar.write(f"projection: {per_epoch:.2f} s per epoch of all methods -> {config.epochs} epochs "
                f"in {per_epoch * config.epochs / 60:.1f} min (this machine, now)")
    accs = "  ".join(f"{m}: {100 * float(np.mean(hists[m][-1]['test_accuracy'])):.2f}%/"
                     f"{float(np.mean(hists[m][-1]['test_loss'])):.3f}" for m in config.methods)
    bar.write(f"epoch {(chunk + 1) * config.eval_every:4d}  test acc/loss  {accs}")
    write("running")
  bar.close()

  LAST_RUN_PARAMS.clear()
  LAST_RUN_PARAMS.update({m: carries[m][0] for m in config.methods})
  out = write("complete")
  print()
  print(summary_table(out["results"], config.methods))
  if data_info.get("synthetic"):
    print("NOTE: synthetic stand-in data, not Fashion-MNIST")
  print(f"wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")
  return out


if __name__ == "__main__":
  main()
