"""Text corpora for word-level language models: readers, vocabulary, and the token stream in windows.

Three corpora, read from a folder named by the caller (a ``--data-dir`` flag):

* ``kjv`` (offline): the King James Bible from Debian's ``bible-kjv``
  (``bible -f "gen1:1-rev22:21"`` prints 31,102 verses, one a line, as "Ge1:1
  text"), or ``kjv.txt`` holding that output. The reference is dropped, the
  text lowercased and split into words, punctuation marks and a separate
  possessive ``'s``; ``<eos>`` ends each verse (PTB style). Split by blocks of
  100 consecutive verses: of every 20 blocks, 18 train, one validation, one
  test (90/5/5, every book in every split). Vocabulary: the 9,998 most frequent
  training tokens plus ``<eos>`` and ``<unk>`` (10,000, as PTB's). 946,576
  tokens; train / valid / test 851,864 / 47,442 / 47,270.
* ``ptb``: ``ptb.{train,valid,test}.txt`` (Mikolov's Penn Treebank, as in
  PyTorch's word_language_model example, ``data/penn``);
* ``wikitext2``: ``wiki.{train,valid,test}.tokens`` (WikiText-2 v1, word level).

For ``ptb`` and ``wikitext2`` the tokens are split on white space and the
vocabulary is every training token (both ship with ``<unk>`` in place).
:func:`windows` cuts a token stream as the example's ``batchify`` and
``get_batch`` do.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

CORPORA = ("kjv", "ptb", "wikitext2")
FILES = {
  "ptb": ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
  "wikitext2": ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
  "kjv": ("kjv.txt",),
}
KJV_RANGE = "gen1:1-rev22:21"
KJV_BLOCK, KJV_CYCLE = 100, 20  # verses per block; block b % 20: 18 -> valid, 19 -> test
KJV_VOCAB = 10_000  # <eos> and <unk> included
INSTALL_HINT = {
  "kjv": "Install Debian's `bible` program (`apt-get install bible-kjv`, which pulls in "
  "bible-kjv-text), or pass --data-dir DIR with kjv.txt, the output of "
  f'`bible -f "{KJV_RANGE}"`.',
  "ptb": "Pass --data-dir DIR holding ptb.train.txt, ptb.valid.txt, ptb.test.txt (Mikolov's "
  "preprocessed Penn Treebank, as in PyTorch's word_language_model example, data/penn).",
  "wikitext2": "Pass --data-dir DIR holding wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens "
  "(WikiText-2 v1, word level, from Salesforce/Merity et al.).",
}
_TOKEN = re.compile(r"'s\b|[a-z0-9]+|[^\sa-z0-9]")


class Corpus(NamedTuple):
  """Train, validation and test token ids (one stream each), the vocabulary, and a JSON-ready description."""

  train: np.ndarray
  valid: np.ndarray
  test: np.ndarray
  vocab: Vocab
  info: dict


def tokenize(line: str) -> list[str]:
  """Lowercased words, single punctuation marks and a separate possessive ``'s``."""
  return _TOKEN.findall(line.lower())


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


def kjv_verses(data_dir: str | None = None) -> list[str]:
  """The verses of the King James Bible, references stripped: ``data_dir/kjv.txt``, or the ``bible``
  program's output when ``data_dir`` is None."""
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


def synthetic_lines(seed: int = 0, words: int = 40) -> tuple[list, list, list]:
  """A tiny learnable stand-in: sentences of 3 to 8 consecutive words (mod ``words``); 600/60/60 lines."""
  rng = np.random.default_rng(seed)
  names = [f"w{i}" for i in range(words)]

  def line():
    start, length = rng.integers(0, words), rng.integers(3, 9)
    return [names[(start + k) % words] for k in range(length)]

  lines = lambda n: [line() for _ in range(n)]

  return lines(600), lines(60), lines(60)


def _read_split_files(name: str, data_dir: str | None) -> tuple[list, dict]:
  paths = [os.path.join(data_dir or ".", f) for f in FILES[name]]
  missing = [p for p in paths if not os.path.isfile(p)]
  if data_dir is None or missing:
    raise FileNotFoundError(
      f"{name}: {', '.join(missing) if data_dir else '--data-dir not given'}. {INSTALL_HINT[name]}"
    )
  splits = []
  for p in paths:
    with open(p, encoding="utf-8") as f:
      splits.append([line.split() for line in f.read().splitlines()])
  info = {
    "source": "files " + ", ".join(paths),
    "synthetic": False,
    "preprocessing": "whitespace tokens, <eos> after each line (as the word_language_model example)",
    "vocabulary": "every training token",
  }
  return splits, info


def corpus(name: str, data_dir: str | None = None, *, synthetic: bool = False) -> Corpus:
  """The corpus ``name`` (one of ``CORPORA``) from ``data_dir``, or the synthetic stand-in.

  Missing files raise ``FileNotFoundError`` with the install hint.
  """
  cap = None
  if synthetic:
    splits = synthetic_lines()
    info = {"source": "SYNTHETIC stand-in (runs of consecutive words over 40 words); not a real corpus"}
    info["synthetic"] = True
  elif name == "kjv":
    verses = kjv_verses(data_dir)
    splits, cap = [list(map(tokenize, s)) for s in split_kjv(verses)], KJV_VOCAB
    info = {
      "source": f"file {os.path.join(data_dir, FILES['kjv'][0])}"
      if data_dir
      else f'`bible -f "{KJV_RANGE}"` (Debian bible-kjv)',
      "synthetic": False,
      "verses": len(verses),
      "preprocessing": "verse reference dropped, lowercased, split into words, punctuation marks "
      "and possessive 's; <eos> after each verse",
      "split": f"blocks of {KJV_BLOCK} consecutive verses; of every {KJV_CYCLE} blocks "
      f"{KJV_CYCLE - 2} train, 1 valid, 1 test",
      "vocabulary": f"{KJV_VOCAB - 2} most frequent training tokens + <eos> + <unk>",
    }
  elif name in FILES:
    splits, info = _read_split_files(name, data_dir)
  else:
    raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, got {name!r}")
  vocab = Vocab.from_tokens(splits[0], cap)
  ids = [vocab.encode(s) for s in splits]
  unk, names = vocab.index["<unk>"], ("train", "valid", "test")
  info.update(
    tokens={k: len(a) for k, a in zip(names, ids)},
    vocab_size=len(vocab),
    types_in_train=len({t for line in splits[0] for t in line}),
    unk_fraction={k: float(np.mean(a == unk)) for k, a in zip(names, ids)},
  )
  return Corpus(*ids, vocab, info)


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
  return jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(np.broadcast_to(real, inputs.shape))
