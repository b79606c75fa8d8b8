"""The paper's small transformer language model (Table 1, appendix "NLP"): c-CoLA-ud vs SGD-m.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 (Table "NLPexp") and the appendix section "NLP".

What the paper says (by line of its LaTeX source):

* l. 267 and l. 1710: a transformer with 2 encoder layers, each 2-head
  self-attention and a 200-node feed-forward network followed by layer norms;
  Penn Treebank with batch size 1024, Wikitext-2 with batch size 128; the
  lowest validation loss in 200 epochs.
* l. 282-291 (table and caption): c-CoLA-ud at ``tau = 0`` with ``h = 0.4``,
  ``r = 0.5, r_L = 0.1, r_N = 1, r_A = 1`` ("L, N, A: linear, norm and
  self-attention layers"), ``gamma = 0.5`` (Penn Treebank) and ``gamma = 1``
  (Wikitext-2); minimum validation loss 4.81 / 5.09 against SGD-m with
  ``h`` in {0.1, 0.2}, momentum in {0.7, 0.8, 0.9}: 4.87, 4.83, 4.84, 4.83,
  4.83, 4.83 (PTB) and 5.13, 5.13, 5.13, 5.13, 5.14, 5.13 (Wikitext-2).
* l. 1658: PyTorch's default initialisation, SGD-m is ``torch.optim.SGD``.

Everything else is taken from PyTorch's ``word_language_model`` example, whose
``TransformerModel`` (as of 2020) the description matches, and is an
assumption where the paper is silent:

* model: embedding 200 (``U(-0.1, 0.1)``, scaled by ``sqrt(200)``), sinusoidal
  positional encoding, dropout 0.2 (after the positional encoding, on the
  attention weights, after attention, inside and after the feed-forward
  network), 2 post-norm encoder layers (2 heads of 100, ReLU feed-forward
  200, LayerNorm eps 1e-5) with a causal mask, linear decoder (``U(-0.1,
  0.1)``, bias 0), softmax cross-entropy. Initialisation as PyTorch's
  ``nn.MultiheadAttention`` (Xavier-uniform ``in_proj``, zero biases),
  ``nn.Linear`` and ``nn.LayerNorm``; both encoder layers start identical,
  because ``nn.TransformerEncoder`` deep-copies one layer. Plain JAX, written
  here (parameters as a dict of ``(fan_in, fan_out)`` kernels).
* data: the example's ``batchify``: the token stream (``<eos>`` after every
  line) cut into ``batch_size`` contiguous columns, windows of ``bptt = 35``
  tokens taken in order (no shuffling), the last window of each epoch
  shorter (kept, its loss the mean over its own tokens); each window is an
  independent sequence (no state carried). Validation and test: columns of 10
  (the example's ``eval_batch_size``), the loss the mean over every token.
* gradient clipping: the example's ``clip_grad_norm_(0.25)`` (global norm)
  before the optimizer, for both methods (``--clip 0`` turns it off); no
  learning-rate annealing (the example's ``lr /= 4`` belongs to its own
  optimizer loop).
* radii by layer kind: ``r_A`` for the self-attention kernels (``in_proj``
  and ``out_proj``), ``r_L`` for the feed-forward ``linear1``/``linear2``
  kernels, ``r_N`` for the LayerNorm gains, ``r`` for the embedding and the
  decoder (the parameters whose PyTorch names contain none of
  ``self_attn``, ``linear``, ``norm``); biases are free, as in the authors'
  c-CoLA-ud optimizer. Every initial weight is inside its interval. The
  LayerNorm gains start at 1 = ``r_N``, the pole of their circle, where the
  projected gradient vanishes: at ``tau = 0`` they stay exactly 1 (so
  c-CoLA-ud trains with frozen gains; that holds for the authors' update
  formulas as well).
* methods: ``ccola_ud``: ``optax.chain(clip, cola.c_cola_ud(0.4,
  friction=gamma, radius=..., mask=...))``, SGD-m equivalent learning rate
  0.16, momentum ``exp(-0.4 gamma)``; ``sgdm_h<lr>_m<mom>``:
  ``optax.chain(clip, optax.sgd(lr, momentum=mom))`` (PyTorch's SGD). The
  default SGD-m is ``h = 0.1, mom = 0.8``, the paper's best on Penn Treebank;
  ``--grid`` adds the other five of the table.

Corpora (``--corpus``):

* ``kjv`` (default, offline): the King James Bible from Debian's
  ``bible-kjv`` (``apt-get install bible-kjv``; ``bible -f
  "gen1:1-rev22:21"`` prints 31,102 verses, one a line, as "Ge1:1 text"), or
  a file ``kjv.txt`` of that output in ``--data-dir``. The reference is
  dropped, the text lowercased and split into words, punctuation marks and
  a separate possessive ``'s``; ``<eos>`` ends each verse (PTB style). Split
  by blocks of 100 consecutive verses: in every 20 blocks, 18 go to train,
  one to validation, one to test (90/5/5, all books in every split).
  Vocabulary: the 9,998 most frequent training tokens plus ``<eos>`` and
  ``<unk>`` (10,000, as PTB's). 946,576 tokens in all; train / valid / test
  851,864 / 47,442 / 47,270 (PTB: 930k / 74k / 82k with its <eos>), 12,108
  types in train; ``<unk>`` is 0.25 / 0.95 / 0.80 % of the tokens.
* ``ptb``: ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt`` in
  ``--data-dir`` (as in the example's ``data/penn``); batch 1024,
  ``gamma = 0.5`` as in the paper.
* ``wikitext2``: ``wiki.train.tokens``, ``wiki.valid.tokens``,
  ``wiki.test.tokens`` in ``--data-dir``; batch 128, ``gamma = 1``.

For ``ptb`` and ``wikitext2`` the vocabulary is every training token (both
are distributed with ``<unk>`` already in place); ``kjv`` takes the
Wikitext-2 settings (batch 128, ``gamma = 1``), being of PTB's size but
needing more steps per epoch to learn within the compute budget.

Compute budget. The paper's 200 epochs do not fit a 2-core CPU. One step
(128 x 35 tokens, one seed) costs about 15 MFLOP per token, 67 GFLOP, mostly
the 10,000-word decoder; measured on the 2-core AMD EPYC this was written on,
shared with other jobs (load 8 on 2 cores): 1.15-1.2 s of process CPU time
per step (2.0 s wall) for either method, and 7 s of CPU time per evaluation
of the validation and test sets. The default, ``--epochs 2`` (382 steps per
method, 9 evaluations) and one seed, so takes 2 x (382 x 1.2 + 9 x 7) s, about
17 min, where XLA gets one core's worth of time, and about 10 min on 2 idle
cores. It follows the first two epochs only: both methods still improve at the
end, so its "minimum" validation loss is the final one and compares early
training, not the regularisation the paper measures over 200 epochs
(``--epochs 200``: about 6 to 13 hours per method and seed on 2 cores).
The run prints its own projection after the first evaluation interval.

Seed ``s`` fixes the initialisation and the dropout masks, the same for every
method; the data order is fixed (as in the example). All seeds of a method
train at once (``jax.vmap`` over seeds of one compiled ``jax.lax.fori_loop``
over the steps between two evaluations). Methods advance in turn,
``--eval-every`` epochs at a time (fractions allowed; default at least 8
evaluations and at most one per epoch, plus one at initialisation); the JSON
is rewritten after each round, the PNG drawn at the end (``--replot`` draws
it from a partial JSON).

Usage::

    python benchmarks/transformer_lm.py                          # KJV, 2 epochs, both methods: 10-17 min
    python benchmarks/transformer_lm.py --smoke                  # seconds, synthetic corpus
    python benchmarks/transformer_lm.py --corpus ptb --data-dir data/penn --epochs 200
    python benchmarks/transformer_lm.py --corpus wikitext2 --data-dir data/wikitext-2 --grid
    python benchmarks/transformer_lm.py --replot results/transformer_lm.json

Writes ``transformer_lm.json`` and ``transformer_lm.png`` under ``--out``;
prints a table with the published numbers next to ours.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
from _common import finite_list, mean_std, mean_std_fields, nan_array, provenance, torch_uniform, write_json
from harness.report import output_dir

SCHEMA_VERSION = 1
CORPORA = ("kjv", "ptb", "wikitext2")
FILES = {
  "ptb": ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
  "wikitext2": ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
  "kjv": ("kjv.txt",),
}
KJV_RANGE = "gen1:1-rev22:21"
INSTALL_HINT = {
  "kjv": "Install Debian's `bible` program (`apt-get install bible-kjv`, which pulls in "
  "bible-kjv-text), or pass --data-dir DIR with kjv.txt, the output of "
  f'`bible -f "{KJV_RANGE}"`.',
  "ptb": "Pass --data-dir DIR holding ptb.train.txt, ptb.valid.txt, ptb.test.txt (Mikolov's "
  "preprocessed Penn Treebank, as in PyTorch's word_language_model example, data/penn).",
  "wikitext2": "Pass --data-dir DIR holding wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens "
  "(WikiText-2 v1, word level, from Salesforce/Merity et al.).",
}
# Per corpus: batch size and c-CoLA-ud friction (paper: PTB 1024 / 0.5, Wikitext-2 128 / 1).
CORPUS_SETTINGS = {
  "ptb": dict(batch_size=1024, friction=0.5),
  "wikitext2": dict(batch_size=128, friction=1.0),
  "kjv": dict(batch_size=128, friction=1.0),
}
KJV_BLOCK, KJV_CYCLE = 100, 20  # verses per block; block b % 20: 18 -> valid, 19 -> test
VOCAB_CAP = 10_000  # kjv only, <eos> and <unk> included
CCOLA_H = 0.4
RADII = {"other": 0.5, "linear": 0.1, "norm": 1.0, "attention": 1.0}  # r, r_L, r_N, r_A
SGDM_GRID = ((0.1, 0.7), (0.1, 0.8), (0.1, 0.9), (0.2, 0.7), (0.2, 0.8), (0.2, 0.9))
_PUB_SGDM = {"ptb": (4.87, 4.83, 4.84, 4.83, 4.83, 4.83), "wikitext2": (5.13, 5.13, 5.13, 5.13, 5.14, 5.13)}
DEFAULT_EPOCHS = 2
SMOKE = dict(seeds=2, epochs=3, batch_size=16)
# --smoke compiles with fewer LLVM passes: 2/3 of the compile time, which dominates a run of seconds.
SMOKE_COMPILER_OPTIONS = dict(xla_backend_optimization_level=1, xla_llvm_disable_expensive_passes=True)


def sgdm_name(h: float, momentum: float) -> str:
  return f"sgdm_h{h:g}_m{momentum:g}"


# Published minimum validation loss (Table "NLPexp"), per corpus and method.
PUBLISHED = {
  corpus: {"ccola_ud": ccola, **{sgdm_name(h, m): v for (h, m), v in zip(SGDM_GRID, _PUB_SGDM[corpus])}}
  for corpus, ccola in (("ptb", 4.81), ("wikitext2", 5.09))
}
DEFAULT_METHODS = ("ccola_ud", sgdm_name(0.1, 0.8))
GRID_METHODS = tuple(sgdm_name(h, m) for h, m in SGDM_GRID)

# main() leaves the final parameters of its last run here (leaves with a leading seed axis).
LAST_RUN_PARAMS: dict = {}


class Config(NamedTuple):
  corpus: str = "kjv"
  seeds: int = 1
  epochs: int = DEFAULT_EPOCHS
  methods: tuple = DEFAULT_METHODS
  batch_size: int = 128
  bptt: int = 35
  eval_batch_size: int = 10
  eval_every: float = 0.25  # epochs
  d_model: int = 200
  n_heads: int = 2
  d_ff: int = 200
  n_layers: int = 2
  dropout: float = 0.2
  clip: float = 0.25
  friction: float = 1.0


def parse_method(method: str) -> dict:
  """``'ccola_ud'`` or ``'sgdm_h<lr>_m<mom>'`` -> a dict of hyperparameters."""
  if method == "ccola_ud":
    return {"kind": "ccola_ud", "learning_rate": CCOLA_H, "radii": dict(RADII)}
  match = re.fullmatch(r"sgdm_h([0-9.eE+-]+)_m([0-9.eE+-]+)", method)
  try:
    if match is None:
      raise ValueError
    return {"kind": "sgdm", "lr": float(match[1]), "momentum": float(match[2])}
  except ValueError:
    raise ValueError(
      f"unknown method {method!r}: 'ccola_ud' or 'sgdm_h<lr>_m<momentum>', e.g. {DEFAULT_METHODS[1]}"
    ) from None


def describe(method: str, friction: float | None = None) -> str:
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    g = "" if friction is None else f" gamma={friction:g}"
    return f"c-CoLA-ud h={CCOLA_H:g}{g} r=0.5 r_L=0.1 r_N=1 r_A=1"
  return f"SGD-m h={spec['lr']:g} mom={spec['momentum']:g}"


# ----------------------------------------------------------------------------- corpus

_TOKEN = re.compile(r"'s\b|[a-z0-9]+|[^\sa-z0-9]")


def tokenize(line: str) -> list[str]:
  """Lowercased words, single punctuation marks and a separate possessive ``'s``."""
  return _TOKEN.findall(line.lower())


def kjv_verses(data_dir: str | None = None) -> list[str]:
  """The 31,102 verses of the King James Bible, references stripped."""
  path = os.path.join(data_dir, FILES["kjv"][0]) if data_dir else None
  if path and os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      text = f.read()
  elif data_dir is None and shutil.which("bible"):
    text = subprocess.run(["bible", "-f", KJV_RANGE], capture_output=True, text=True, check=True).stdout
  else:
    where = f"{path} not found" if path else "the `bible` program is not installed"
    raise FileNotFoundError(f"KJV corpus: {where}. {INSTALL_HINT['kjv']}")
  verses = [line.split(" ", 1)[1] for line in text.splitlines() if " " in line.strip()]
  if not verses:
    raise ValueError("KJV corpus: no verses found (expected lines like 'Ge1:1 In the beginning ...')")
  return verses


def split_kjv(verses: Sequence[str]) -> tuple[list, list, list]:
  """Train/valid/test by blocks of ``KJV_BLOCK`` verses: 18 of every 20 blocks train, 1 valid, 1 test."""
  splits = ([], [], [])
  for i, verse in enumerate(verses):
    b = (i // KJV_BLOCK) % KJV_CYCLE
    splits[0 if b < KJV_CYCLE - 2 else (1 if b == KJV_CYCLE - 2 else 2)].append(verse)
  return splits


def read_lines(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return f.read().splitlines()


class Vocab:
  """Word <-> id; words outside it map to ``<unk>``."""

  def __init__(self, words: Sequence[str]):
    self.words = list(words)
    self.index = {w: i for i, w in enumerate(self.words)}
    if len(self.index) != len(self.words):
      raise ValueError("duplicate words in the vocabulary")

  def __len__(self):
    return len(self.words)

  @classmethod
  def from_tokens(cls, lines: Sequence[Sequence[str]], cap: int | None = None) -> Vocab:
    """``<eos>``, ``<unk>``, then training tokens by decreasing count (ties alphabetical), ``cap`` in all."""
    counts = collections.Counter(t for line in lines for t in line)
    ranked = sorted((w for w in counts if w not in ("<eos>", "<unk>")), key=lambda w: (-counts[w], w))
    return cls(["<eos>", "<unk>"] + ranked[: None if cap is None else cap - 2])

  def encode(self, lines: Sequence[Sequence[str]]) -> np.ndarray:
    """One id stream, ``<eos>`` after every line."""
    unk, eos = self.index["<unk>"], self.index["<eos>"]
    return np.array([i for line in lines for i in [self.index.get(t, unk) for t in line] + [eos]], np.int32)

  def decode(self, ids) -> list[str]:
    return [self.words[int(i)] for i in ids]


def synthetic_corpus(seed: int = 0):
  """A tiny learnable stand-in: 40 words, each sentence a run of consecutive words (mod 40)."""
  rng = np.random.default_rng(seed)
  words = [f"w{i}" for i in range(40)]

  def lines(n):
    out = []
    for _ in range(n):
      start, length = rng.integers(0, 40), rng.integers(3, 9)
      out.append([words[(start + k) % 40] for k in range(length)])
    return out

  return lines(600), lines(60), lines(60)


def make_corpus(corpus: str, data_dir: str | None = None, synthetic: bool = False):
  """``(train, valid, test ids, vocab, info)`` for ``corpus`` (or the synthetic stand-in)."""
  if synthetic:
    train, valid, test = synthetic_corpus()
    vocab = Vocab.from_tokens(train)
    info = {
      "source": "SYNTHETIC stand-in (runs of consecutive words over 40 words); not a real corpus",
      "synthetic": True,
    }
  elif corpus == "kjv":
    verses = kjv_verses(data_dir)
    train, valid, test = (list(map(tokenize, s)) for s in split_kjv(verses))
    vocab = Vocab.from_tokens(train, VOCAB_CAP)
    info = {
      "source": ("file " + os.path.join(data_dir, FILES["kjv"][0]))
      if data_dir
      else f'`bible -f "{KJV_RANGE}"` (Debian bible-kjv)',
      "synthetic": False,
      "verses": len(verses),
      "preprocessing": "verse reference dropped, lowercased, split into words, punctuation marks "
      "and possessive 's; <eos> after each verse",
      "split": f"blocks of {KJV_BLOCK} consecutive verses; of every {KJV_CYCLE} blocks "
      f"{KJV_CYCLE - 2} train, 1 valid, 1 test",
      "vocabulary": f"{VOCAB_CAP - 2} most frequent training tokens + <eos> + <unk>",
    }
  else:
    directory = data_dir or "."
    paths = [os.path.join(directory, name) for name in FILES[corpus]]
    missing = [p for p in paths if not os.path.isfile(p)]
    if data_dir is None or missing:
      raise FileNotFoundError(
        f"{corpus}: {', '.join(missing) if data_dir else '--data-dir not given'}. {INSTALL_HINT[corpus]}"
      )
    train, valid, test = ([line.split() for line in read_lines(p)] for p in paths)
    vocab = Vocab.from_tokens(train)
    info = {
      "source": "files " + ", ".join(paths),
      "synthetic": False,
      "preprocessing": "whitespace tokens, <eos> after each line (as the word_language_model example)",
      "vocabulary": "every training token",
    }
  ids = [vocab.encode(s) for s in (train, valid, test)]
  unk = vocab.index["<unk>"]
  info.update(
    {
      "tokens": {k: len(a) for k, a in zip(("train", "valid", "test"), ids)},
      "vocab_size": len(vocab),
      "types_in_train": len({t for line in train for t in line}),
      "unk_fraction": {k: float(np.mean(a == unk)) for k, a in zip(("train", "valid", "test"), ids)},
    }
  )
  return (*ids, vocab, info)


def windows(ids: np.ndarray, batch_size: int, bptt: int):
  """The example's ``batchify`` + ``get_batch``, padded to full windows.

  Returns ``(inputs, targets, weights)``, each ``(n_windows, batch_size,
  bptt)``: column ``j`` is the ``j``-th contiguous stretch of the stream,
  window ``k`` its rows ``k bptt .. k bptt + bptt - 1``; weights are 1 on real
  tokens and 0 on the padding of the last, shorter window.
  """
  rows = len(ids) // batch_size
  if rows < 2:
    raise ValueError(f"{len(ids)} tokens are too few for {batch_size} columns")
  grid = ids[: rows * batch_size].reshape(batch_size, rows)
  n_windows = -(-(rows - 1) // bptt)
  padded = np.zeros((batch_size, n_windows * bptt + 1), np.int32)
  padded[:, :rows] = grid
  real = (np.arange(n_windows * bptt) < rows - 1).astype(np.float32).reshape(n_windows, 1, bptt)
  split = lambda a: a.reshape(batch_size, n_windows, bptt).transpose(1, 0, 2)
  inputs, targets = split(padded[:, :-1]), split(padded[:, 1:])
  weights = np.broadcast_to(real, inputs.shape)
  return jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(weights)


# ----------------------------------------------------------------------------- model


def init_transformer(key: jax.Array, vocab_size: int, config: Config) -> dict:
  """PyTorch's initialisation of the example's ``TransformerModel`` (see the module docstring)."""
  d, f = config.d_model, config.d_ff
  k = jax.random.split(key, 8)
  xavier = math.sqrt(6.0 / (d + 3 * d))  # in_proj_weight is (3d, d)
  layer = {
    "attention": {
      "in_kernel": jax.random.uniform(k[0], (d, 3 * d), jnp.float32, -xavier, xavier),
      "in_bias": jnp.zeros(3 * d),
      "out_kernel": torch_uniform(k[1], (d, d), d),
      "out_bias": jnp.zeros(d),
    },
    "linear1": {"kernel": torch_uniform(k[2], (d, f), d), "bias": torch_uniform(k[3], (f,), d)},
    "linear2": {"kernel": torch_uniform(k[4], (f, d), f), "bias": torch_uniform(k[5], (d,), f)},
    "norm1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
    "norm2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
  }
  params = {
    "embedding": {"weight": jax.random.uniform(k[6], (vocab_size, d), jnp.float32, -0.1, 0.1)},
    "decoder": {
      "kernel": jax.random.uniform(k[7], (d, vocab_size), jnp.float32, -0.1, 0.1),
      "bias": jnp.zeros(vocab_size),
    },
  }
  # The encoder layers stacked on a leading axis (scanned over), all copies of one layer.
  params["layers"] = jax.tree.map(lambda a: jnp.broadcast_to(a, (config.n_layers,) + a.shape), layer)
  return params


def layer_kind(path) -> str | None:
  """The radius group of a parameter (``RADII`` key), or None for biases (free)."""
  names = [getattr(p, "key", None) for p in path]
  if names[-1] in ("bias", "in_bias", "out_bias"):
    return None
  if "attention" in names:
    return "attention"
  if names[-2] in ("linear1", "linear2"):
    return "linear"
  if names[-2].startswith("norm"):
    return "norm"
  return "other"


def radius_tree(params, radii: dict):
  """A pytree like ``params`` with each constrained leaf's radius, None for the free ones."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: None if layer_kind(path) is None else radii[layer_kind(path)], params
  )


def positional_encoding(length: int, d: int) -> jax.Array:
  pos = np.arange(length)[:, None]
  freq = np.exp(-math.log(10000.0) * np.arange(0, d, 2) / d)
  pe = np.zeros((length, d), np.float32)
  pe[:, 0::2], pe[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq)
  return jnp.asarray(pe)


def _dropout(key, x, rate):
  if rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def _layer_norm(x, p, eps=1e-5):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _attention(x, p, n_heads, key, rate):
  """Causal multi-head self-attention on ``x`` of shape (batch, time, d)."""
  b, t, d = x.shape
  qkv = (x @ p["in_kernel"] + p["in_bias"]).reshape(b, t, 3, n_heads, d // n_heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // n_heads)
  causal = jnp.tril(jnp.ones((t, t), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  out = jnp.einsum("bhqk,bkhc->bqhc", _dropout(key, weights, rate), v).reshape(b, t, d)
  return out @ p["out_kernel"] + p["out_bias"]


def transformer(params, tokens, config: Config, key: jax.Array | None = None):
  """Logits ``(batch, time, vocab)`` of ``tokens`` ``(batch, time)``; dropout on when ``key`` is given."""
  rate = config.dropout if key is not None else 0.0
  keys = jax.random.split(jax.random.key(0) if key is None else key, 1 + config.n_layers)
  x = params["embedding"]["weight"][tokens] * math.sqrt(config.d_model)
  x = _dropout(keys[0], x + positional_encoding(tokens.shape[-1], config.d_model), rate)

  def encoder_layer(x, layer):
    p, key = layer
    k = jax.random.split(key, 4)
    a = _attention(x, p["attention"], config.n_heads, k[0], rate)
    x = _layer_norm(x + _dropout(k[1], a, rate), p["norm1"])
    hidden = _dropout(k[2], jax.nn.relu(x @ p["linear1"]["kernel"] + p["linear1"]["bias"]), rate)
    return _layer_norm(
      x + _dropout(k[3], hidden @ p["linear2"]["kernel"] + p["linear2"]["bias"], rate), p["norm2"]
    ), None

  x, _ = jax.lax.scan(encoder_layer, x, (params["layers"], keys[1:]))
  return x @ params["decoder"]["kernel"] + params["decoder"]["bias"]


def token_losses(params, tokens, targets, config: Config, key=None):
  return optax.softmax_cross_entropy_with_integer_labels(transformer(params, tokens, config, key), targets)


# ----------------------------------------------------------------------------- training


def make_optimizer(method: str, config: Config, params) -> optax.GradientTransformation:
  """Gradient clipping (``config.clip``, 0 = none), then c-CoLA-ud or SGD-m."""
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    radii = radius_tree(params, spec["radii"])
    mask = jax.tree.map(lambda r: r is not None, radii, is_leaf=lambda r: r is None)
    tx = cola.c_cola_ud(spec["learning_rate"], friction=config.friction, radius=radii, mask=mask)
  else:
    tx = optax.sgd(spec["lr"], momentum=spec["momentum"])
  return optax.chain(optax.clip_by_global_norm(config.clip), tx) if config.clip > 0 else tx


def max_abs_by_kind(params) -> dict:
  """``max |w|`` over the constrained leaves of each kind (of one seed's parameters)."""
  found: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    kind = layer_kind(path)
    if kind is not None:
      m = jnp.max(jnp.abs(leaf))
      found[kind] = m if kind not in found else jnp.maximum(found[kind], m)
  return found


def seed_keys(seed):
  """(init key, dropout key) of one seed, the same for every method."""
  return tuple(jax.random.split(jax.random.key(seed)))


def window_sums(params, data, config: Config):
  """Per window of ``data = (inputs, targets, weights)``: (sum of token losses, tokens), no dropout."""

  def one(window):
    x, y, w = window
    return jnp.sum(token_losses(params, x, y, config) * w), jnp.sum(w)

  return jax.lax.map(one, data)


def evaluate(params, data, config: Config):
  """Mean token loss over the windows ``data``."""
  sums, counts = window_sums(params, data, config)
  return jnp.sum(sums) / jnp.sum(counts)


def build(method: str, config: Config, vocab_size: int):
  """``init(seeds) -> carry`` and the jitted ``run_chunk(carry, data, n_steps) -> (carry, metrics)``.

  ``run_chunk`` takes ``n_steps`` training steps (a traced count, so one
  compilation serves every chunk; 0 only evaluates), cycling through the
  training windows in order, then evaluates on the validation and test
  windows; vmapped over seeds.
  """
  template = jax.eval_shape(lambda: init_transformer(jax.random.key(0), vocab_size, config))
  tx = make_optimizer(method, config, template)

  def init_one(seed):
    init_key, dropout_key = seed_keys(seed)
    params = init_transformer(init_key, vocab_size, config)
    return params, tx.init(params), dropout_key, jnp.zeros((), jnp.int32)

  def window_loss(params, x, y, w, key):
    return jnp.sum(token_losses(params, x, y, config, key) * w) / jnp.sum(w)

  def held_out_losses(params, valid, test):
    """Validation and test loss, in one pass over both sets' windows (one traced forward pass)."""
    sums, counts = window_sums(params, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), valid, test), config)
    n = valid[0].shape[0]
    return dict(valid_loss=jnp.sum(sums[:n]) / jnp.sum(counts[:n]), test_loss=jnp.sum(sums[n:]) / jnp.sum(counts[n:]))

  def chunk_one(carry, data, n_steps):
    params, opt_state, dropout_key, step = carry
    train, valid, test = data

    def train_step(_, inner):
      params, opt_state, step, loss_sum, count = inner
      x, y, w = (a[step % a.shape[0]] for a in train)
      loss, grads = jax.value_and_grad(window_loss)(params, x, y, w, jax.random.fold_in(dropout_key, step))
      updates, opt_state = tx.update(grads, opt_state, params)
      return (
        optax.apply_updates(params, updates),
        opt_state,
        step + 1,
        loss_sum + loss * jnp.sum(w),
        count + jnp.sum(w),
      )

    params, opt_state, step, loss_sum, count = jax.lax.fori_loop(
      0, n_steps, train_step, (params, opt_state, step, jnp.zeros(()), jnp.zeros(()))
    )
    metrics = dict(
      train_loss=jnp.where(count > 0, loss_sum / jnp.maximum(count, 1.0), jnp.nan),
      **held_out_losses(params, valid, test),
      **{f"max_abs_w_{k}": v for k, v in max_abs_by_kind(params).items()},
    )
    return (params, opt_state, dropout_key, step), metrics

  return jax.jit(jax.vmap(init_one)), jax.jit(jax.vmap(chunk_one, in_axes=(0, None, None)))


def eval_schedule(total_steps: int, eval_steps: int) -> list[int]:
  """Steps per chunk: 0 (the evaluation at initialisation), then ``eval_steps`` each, the last one shorter."""
  return [0] + [min(eval_steps, total_steps - done) for done in range(0, total_steps, eval_steps)]


# ----------------------------------------------------------------------------- reporting


def summarize(entry: dict) -> dict:
  return mean_std_fields(entry, ("min_valid_loss", "final_valid_loss", "test_loss_at_min_valid", "final_train_loss"))


def summary_table(results: dict, methods: Sequence[str], corpus: str, friction: float) -> str:
  published = PUBLISHED.get(corpus, {})
  name_w = max(len(describe(m, friction)) for m in methods)
  head = (
    f"{'method':<{name_w}}  {'min valid loss':>15}  {'(ppl)':>6}  {'at epoch':>8}  "
    f"{'final valid loss':>16}  {'test loss at min':>16}  {'published min':>13}"
  )
  lines = [head, "-" * len(head)]
  for m in methods:
    r = results[m]
    cells = [
      f"{mean:6.3f} ± {std:5.3f}"
      for mean, std in (mean_std(r[k]) for k in ("min_valid_loss", "final_valid_loss", "test_loss_at_min_valid"))
    ]
    ppl = math.exp(mean_std(r["min_valid_loss"])[0])
    epoch = "/".join(str(e) for e in r["min_valid_loss_epoch"])
    pub = f"{published[m]:.2f}" if m in published else "-"
    lines.append(
      f"{describe(m, friction):<{name_w}}  {cells[0]:>15}  {ppl:6.1f}  {epoch:>8}  "
      f"{cells[1]:>16}  {cells[2]:>16}  {pub:>13}"
    )
  return "\n".join(lines)


def plot(results: dict, config: dict, path: str, data_info: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods = [m for m in config["methods"] if results.get(m)]
  cmap = plt.get_cmap("tab10")
  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  for i, m in enumerate(methods):
    h = results[m]["history"]
    color = "black" if m == "ccola_ud" else cmap(i % cmap.N)
    for ax, key, start in ((axes[0], "valid_loss", 0), (axes[1], "train_loss", 1)):  # no training at step 0
      a, epoch = nan_array(h[key][start:]), h["epoch"][start:]
      mean, std = np.nanmean(a, axis=1), np.nanstd(a, axis=1)
      ax.plot(
        epoch,
        mean,
        color=color,
        lw=2 if m == "ccola_ud" else 1.2,
        label=describe(m, config["friction"]),
        marker="o" if len(h["epoch"]) < 12 else None,
      )
      ax.fill_between(epoch, mean - std, mean + std, color=color, alpha=0.15)
  published = PUBLISHED.get(config["corpus_used"], {})
  for i, m in enumerate(methods):
    if m in published:
      axes[0].axhline(published[m], color="black" if m == "ccola_ud" else cmap(i % cmap.N), ls=":", lw=1)
  axes[0].set(
    xlabel="epoch",
    ylabel="validation loss (nats/token)",
    title="validation loss (mean ± std over seeds)" + ("; dotted: published minima" if published else ""),
  )
  axes[1].set(
    xlabel="epoch",
    ylabel="training loss (dropout on)",
    title="training loss, mean over the steps since the previous evaluation",
  )
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  synthetic = " — SYNTHETIC DATA" if data_info.get("synthetic") else ""
  fig.suptitle(
    f"Transformer LM on {config['corpus_used']} ({data_info['tokens']['train']:,} train tokens, "
    f"vocab {data_info['vocab_size']:,}), batch {config['batch_size']} x bptt {config['bptt']}, "
    f"{config['seeds']} seed(s), {config['epochs_completed']} of {config['epochs']} epochs{synthetic}"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv):
  p = argparse.ArgumentParser(
    description="The paper's transformer language model (Table 1): c-CoLA-ud vs SGD-m on a 2-layer, "
    "2-head, 200-unit transformer; minimum validation loss per method.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--corpus",
    choices=CORPORA,
    default="kjv",
    help="kjv: King James Bible from Debian's bible-kjv (offline default); ptb, wikitext2: files in --data-dir",
  )
  p.add_argument(
    "--data-dir",
    default=None,
    help="directory with ptb.{train,valid,test}.txt, wiki.{train,valid,test}.tokens, or "
    "kjv.txt (the output of `bible -f`)",
  )
  p.add_argument("--seeds", type=int, default=1, help="number of seeds (0..seeds-1)")
  p.add_argument(
    "--epochs",
    type=int,
    default=DEFAULT_EPOCHS,
    help="training epochs (the paper: 200; the default takes 10-17 min on 2 CPU cores)",
  )
  p.add_argument(
    "--eval-every",
    type=float,
    default=None,
    help="epochs between evaluations, fractions allowed (default min(1, epochs / 8): at least "
    "8 evaluations, at most one per epoch); plus one at initialisation",
  )
  p.add_argument(
    "--methods", default=",".join(DEFAULT_METHODS), help="comma list of 'ccola_ud' and 'sgdm_h<lr>_m<momentum>'"
  )
  p.add_argument("--grid", action="store_true", help="add the table's SGD-m grid (h 0.1, 0.2 x mom 0.7, 0.8, 0.9)")
  p.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="training columns (default: ptb 1024, wikitext2 128, as the paper; kjv 128)",
  )
  p.add_argument(
    "--friction", type=float, default=None, help="c-CoLA-ud gamma (default: ptb 0.5, wikitext2 1, as the paper; kjv 1)"
  )
  p.add_argument("--bptt", type=int, default=35, help="window length")
  p.add_argument("--clip", type=float, default=0.25, help="global gradient-norm clip (0: none)")
  p.add_argument(
    "--out", default=None, help="output directory (default: results/; a --smoke run: a new temporary folder)"
  )
  p.add_argument(
    "--smoke",
    action="store_true",
    help=f"tiny run for tests on a synthetic corpus: {SMOKE['seeds']} seeds, {SMOKE['epochs']} "
    f"epochs, batch {SMOKE['batch_size']}",
  )
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.add_argument("--replot", metavar="JSON", help="only redraw the PNG (next to JSON) from a transformer_lm.json")
  args = p.parse_args(argv)
  if args.replot:
    return args, None
  if args.smoke:
    args.seeds, args.epochs = SMOKE["seeds"], SMOKE["epochs"]
    args.batch_size = args.batch_size or SMOKE["batch_size"]
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  if args.grid:
    methods += [m for m in GRID_METHODS if m not in methods]
  for m in methods:
    try:
      parse_method(m)
    except ValueError as error:
      p.error(str(error))
  if min(args.seeds, args.epochs, args.bptt) < 1 or (args.batch_size is not None and args.batch_size < 1):
    p.error("--seeds, --epochs, --bptt and --batch-size must be positive")
  if args.eval_every is None:
    args.eval_every = min(1.0, args.epochs / 8)
  elif not args.eval_every > 0:
    p.error("--eval-every must be positive")
  settings = CORPUS_SETTINGS[args.corpus]
  config = Config(
    corpus=args.corpus,
    seeds=args.seeds,
    epochs=args.epochs,
    methods=tuple(dict.fromkeys(methods)),
    batch_size=args.batch_size or settings["batch_size"],
    bptt=args.bptt,
    eval_every=args.eval_every,
    clip=args.clip,
    friction=settings["friction"] if args.friction is None else args.friction,
  )
  return args, config


def _entry(hist: list, timing: dict, method: str, config: Config, steps_per_epoch: int) -> dict:
  """The JSON entry of a method from its per-evaluation metric dicts (arrays over seeds).

  The first evaluation is at initialisation; minima are taken over the later ones.
  """
  if len(hist) < 2:
    return {}
  stack = {k: np.stack([c[k] for c in hist]) for k in hist[0]}
  valid, test = stack["valid_loss"], stack["test_loss"]
  epochs = np.array(timing["steps"]) / steps_per_epoch
  best = 1 + np.argmin(np.where(np.isfinite(valid[1:]), valid[1:], np.inf), axis=0)
  seeds = np.arange(valid.shape[1])
  spec = parse_method(method)
  if spec["kind"] == "ccola_ud":
    spec = {
      **spec,
      "friction": config.friction,
      "sgd_momentum_equivalent": dict(
        zip(("learning_rate", "momentum"), cola.langevin_to_sgd_momentum(CCOLA_H, config.friction))
      ),
    }
  trained_s = timing["run_s"] - timing["init_eval_s"]
  return {
    "min_valid_loss": finite_list(valid[best, seeds]),
    "min_valid_loss_epoch": [round(float(e), 4) for e in epochs[best]],
    "final_valid_loss": finite_list(valid[-1]),
    "test_loss_at_min_valid": finite_list(test[best, seeds]),
    "final_test_loss": finite_list(test[-1]),
    "final_train_loss": finite_list(stack["train_loss"][-1]),
    "valid_loss_at_init": finite_list(valid[0]),
    "max_abs_weight": {k[len("max_abs_w_") :]: finite_list(stack[k][-1]) for k in stack if k.startswith("max_abs_w_")},
    "history": {
      "step": list(timing["steps"]),
      "epoch": [round(float(e), 4) for e in epochs],
      **{k: finite_list(stack[k]) for k in ("valid_loss", "test_loss", "train_loss")},
    },
    "compile_time_s": timing["compile_s"],
    "run_time_s": timing["run_s"],
    "time_per_epoch_s": trained_s * steps_per_epoch / max(1, timing["steps"][-1]),
    "hyperparameters": spec,
  }


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the experiment, writes ``transformer_lm.json`` and ``transformer_lm.png`` under ``--out``.

  Returns the dict written to ``transformer_lm.json``.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args, config = parse_args(argv)
  if args.replot:
    with open(args.replot) as f:
      out = json.load(f)
    png_path = os.path.join(os.path.dirname(os.path.abspath(args.replot)), "transformer_lm.png")
    plot(out["results"], out["config"], png_path, out["data"])
    done = [m for m in out["config"]["methods"] if out["results"][m]]
    print(summary_table(out["results"], done, out["config"]["corpus_used"], out["config"]["friction"]))
    print(f"wrote {png_path}")
    return out
  args.out = output_dir(args.out or (None if args.smoke else "results/"), "transformer_lm")
  start = time.perf_counter()
  try:
    train_ids, valid_ids, test_ids, vocab, data_info = make_corpus(config.corpus, args.data_dir, args.smoke)
  except FileNotFoundError as error:
    sys.exit(f"error: {error}")
  corpus_name = "synthetic" if data_info["synthetic"] else config.corpus
  data = (
    windows(train_ids, config.batch_size, config.bptt),
    windows(valid_ids, config.eval_batch_size, config.bptt),
    windows(test_ids, config.eval_batch_size, config.bptt),
  )
  steps_per_epoch = int(data[0][0].shape[0])
  eval_steps = max(1, round(config.eval_every * steps_per_epoch))
  schedule = eval_schedule(config.epochs * steps_per_epoch, eval_steps)

  from tqdm.auto import tqdm

  seeds = jnp.arange(config.seeds)
  runners, carries, hists, timing = {}, {}, {}, {}
  for m in config.methods:
    init, run_chunk = build(m, config, len(vocab))
    t0 = time.perf_counter()
    carries[m] = init(seeds)
    runners[m] = run_chunk.lower(carries[m], data, jnp.int32(0)).compile(
      compiler_options=SMOKE_COMPILER_OPTIONS if args.smoke else None
    )
    timing[m] = {"compile_s": time.perf_counter() - t0, "run_s": 0.0, "init_eval_s": 0.0, "steps": []}
    hists[m] = []

  json_path = os.path.join(args.out, "transformer_lm.json")
  png_path = os.path.join(args.out, "transformer_lm.png")
  config_dict = {
    **config._asdict(),
    "methods": list(config.methods),
    "corpus_used": corpus_name,
    "steps_per_epoch": steps_per_epoch,
    "eval_every_steps": eval_steps,
    "tokens_per_step": config.batch_size * config.bptt,
    "radii": {
      "r (embedding, decoder)": RADII["other"],
      "r_L (feed-forward linear1, linear2)": RADII["linear"],
      "r_N (LayerNorm gains)": RADII["norm"],
      "r_A (self-attention in_proj, out_proj)": RADII["attention"],
      "biases": None,
    },
    "init": "PyTorch word_language_model TransformerModel: embedding, decoder U(-0.1, 0.1), "
    "decoder bias 0; MultiheadAttention in_proj Xavier-uniform, out_proj U(+-1/sqrt(d)), "
    "attention biases 0; linear1/2 nn.Linear default; LayerNorm 1, 0; both layers identical",
    "log_vocab_size": math.log(len(vocab)),
    "pairing": "seed s fixes init and dropout masks, the same for every method; data order fixed",
  }

  def write(status: str) -> dict:
    results = {m: _entry(hists[m], timing[m], m, config, steps_per_epoch) for m in config.methods}
    done = [m for m in config.methods if results[m]]
    steps_done = min((timing[m]["steps"][-1] if timing[m]["steps"] else 0) for m in config.methods)
    out = {
      "schema_version": SCHEMA_VERSION,
      "experiment": "Transformer language model (Leimkuhler et al., Constraint-Based Regularization of "
      "Neural Networks, Table 'NLPexp' and appendix 'NLP')",
      "status": status,
      "config": {**config_dict, "epochs_completed": round(steps_done / steps_per_epoch, 4)},
      "data": data_info,
      "methods": {m: describe(m, config.friction) for m in config.methods},
      "seeds": list(range(config.seeds)),
      "results": results,
      "summary": {m: summarize(results[m]) for m in done},
      "published": {
        "min_valid_loss": PUBLISHED,
        "note": "minimum validation loss in 200 epochs, Penn Treebank (batch 1024, gamma 0.5) "
        "and Wikitext-2 (batch 128, gamma 1); none for kjv",
      },
      **provenance(argv, start),
    }
    write_json(json_path, out)
    if status == "complete":  # a partial run: --replot draws its figure
      plot(results, out["config"], png_path, data_info)
    return out

  bar = tqdm(total=len(config.methods) * sum(schedule), unit="step", disable=args.quiet, dynamic_ncols=True)
  bar.write(
    f"{corpus_name}: {data_info['tokens']} tokens, vocab {len(vocab)}; {steps_per_epoch} steps/epoch, "
    f"evaluation every {eval_steps} steps"
  )
  for chunk, n_steps in enumerate(schedule):
    for m in config.methods:
      steps = (timing[m]["steps"][-1] if timing[m]["steps"] else 0) + n_steps
      bar.set_description(f"epoch {steps / steps_per_epoch:.2f} {m}")
      t0 = time.perf_counter()
      carries[m], metrics = runners[m](carries[m], data, jnp.int32(n_steps))
      metrics = jax.device_get(metrics)
      timing[m]["run_s"] += time.perf_counter() - t0
      if chunk == 0:
        timing[m]["init_eval_s"] = timing[m]["run_s"]
      timing[m]["steps"].append(steps)
      hists[m].append(metrics)
      bar.update(n_steps)
    if chunk == 1:
      # chunk 0 only evaluated; chunk 1 trained n_steps and evaluated once more.
      eval_s = {m: timing[m]["init_eval_s"] for m in config.methods}
      step_s = {m: (timing[m]["run_s"] - 2 * eval_s[m]) / n_steps for m in config.methods}
      for m in config.methods:
        bar.write(
          f"{m}: compile {timing[m]['compile_s']:.1f} s, evaluation {eval_s[m]:.1f} s, "
          f"{step_s[m]:.2f} s/step for {config.seeds} seed(s)"
        )
      total = sum(step_s[m] * sum(schedule) + eval_s[m] * len(schedule) for m in config.methods)
      bar.write(f"projection: {config.epochs} epochs of all methods in about {total / 60:.1f} min (this machine, now)")
    losses = "  ".join(f"{m}: {float(np.mean(hists[m][-1]['valid_loss'])):.3f}" for m in config.methods)
    bar.write(f"epoch {timing[config.methods[0]]['steps'][-1] / steps_per_epoch:6.2f}  valid loss  {losses}")
    write("running")
  bar.close()

  LAST_RUN_PARAMS.clear()
  LAST_RUN_PARAMS.update({m: carries[m][0] for m in config.methods})
  out = write("complete")
  print()
  print(summary_table(out["results"], config.methods, corpus_name, config.friction))
  if data_info.get("synthetic"):
    print("NOTE: synthetic stand-in corpus, not a real one")
  print(f"wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")
  return out


if __name__ == "__main__":
  main()
