"""Data sources: the paper's spiral, Fashion-MNIST IDX files, scikit-learn's digits.

Each returns a :class:`Dataset` of float32 inputs and integer (or 0/1 float)
labels as numpy arrays; files are read from directories named by the caller
(a ``--data-dir`` flag), so the same script runs where the data was carried.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
from typing import NamedTuple

import numpy as np


class Dataset(NamedTuple):
  """Training and test arrays plus a JSON-ready description of where they came from."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  info: dict


# ----------------------------------------------------------------------------- spiral


def spiral_points(rng: np.random.Generator, n: int, noise: float = 0.02, turns: int = 4):
  """``n`` points of the two-class spiral, ``n // 2`` of class 0 first, then class 1.

  Class 0: radius ``2 sqrt(t)``, angle ``2 turns sqrt(t) pi`` with ``t ~ U(0, 1)``;
  class 1: the angle plus ``pi``; then Gaussian noise of scale ``noise``.
  Returns ``(x float32 (n, 2), y float32 in {0, 1})``.
  """
  labels = np.concatenate([np.zeros(n // 2), np.ones(n - n // 2)])
  s = np.sqrt(rng.uniform(size=n))
  angle = 2 * turns * s * np.pi + np.pi * labels
  x = np.stack([2 * s * np.cos(angle), 2 * s * np.sin(angle)], axis=1)
  x = x + noise * rng.standard_normal((n, 2))
  return x.astype(np.float32), labels.astype(np.float32)


def spiral(n_train: int = 500, n_test: int = 1000, *, noise: float = 0.02, turns: int = 4, seed: int = 0) -> Dataset:
  """The paper's 4-turn spiral (Sec. 4): independent training and test draws from ``seed``."""
  train_rng, test_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
  x_tr, y_tr = spiral_points(train_rng, n_train, noise, turns)
  x_te, y_te = spiral_points(test_rng, n_test, noise, turns)
  info = {"source": f"{turns}-turn two-class spiral, noise {noise}", "seed": seed, "synthetic": True}
  return Dataset(x_tr, y_tr, x_te, y_te, info)


# ----------------------------------------------------------------------------- Fashion-MNIST

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = {
  "train_images": "train-images-idx3-ubyte",
  "train_labels": "train-labels-idx1-ubyte",
  "test_images": "t10k-images-idx3-ubyte",
  "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_HINT = (
  "Install Debian's package (`apt-get install dataset-fashion-mnist`, files under "
  f"{FASHION_MNIST_DIR}) or pass --data-dir DIR with the four IDX files "
  f"{', '.join(IDX_FILES.values())} (each may be gzipped, '.gz')."
)


def read_idx(path: str) -> np.ndarray:
  """An unsigned-byte IDX file (optionally gzipped) as a numpy array."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    raw = f.read()
  zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
  if zero != 0 or dtype_code != 0x08:
    raise ValueError(f"{path}: not an unsigned-byte IDX file")
  shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
  data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
  if data.size != math.prod(shape):
    raise ValueError(f"{path}: expected {math.prod(shape)} values, found {data.size}")
  return data.reshape(shape)


def find_idx_files(data_dir: str) -> dict | None:
  """Paths of the four IDX files under ``data_dir`` (plain or ``.gz``), or None."""
  paths = {}
  for key, name in IDX_FILES.items():
    dotted = name.replace("-idx", ".idx")
    for candidate in (name, name + ".gz", dotted, dotted + ".gz"):
      if os.path.isfile(os.path.join(data_dir, candidate)):
        paths[key] = os.path.join(data_dir, candidate)
        break
    else:
      return None
  return paths


def synthetic_images(n_train: int, n_test: int, seed: int = 0, shape: tuple = (28, 28)):
  """A stand-in of Fashion-MNIST's shapes (uint8 images of ``shape``, 10 classes): prototypes + noise."""
  rng = np.random.default_rng(seed)
  size = math.prod(shape)
  prototypes = rng.uniform(0, 255, (10, size))

  def draw(n):
    y = rng.integers(0, 10, n).astype(np.int32)
    x = np.clip(prototypes[y] * rng.uniform(0.3, 1.0, (n, 1)) + rng.normal(0, 60, (n, size)), 0, 255)
    return x.astype(np.uint8).reshape(n, *shape), y

  return draw(n_train), draw(n_test)


def fashion_mnist(
  data_dir: str | None = None,
  n_train: int = 10_000,
  n_test: int = 60_000,
  *,
  test_from: str = "rest",
  allow_synthetic: bool = False,
  synthetic: bool = False,
) -> Dataset:
  """Fashion-MNIST as ``(n, 28, 28)`` float32 images in [0, 1] and int32 labels.

  Training set: the first ``n_train`` official training images. Test set
  (``test_from``): ``"rest"``, the remaining training images followed by the
  official test images (the paper's 10k/60k split), or ``"official"``, the
  official test images; the first ``n_test`` of them. Missing files raise
  ``FileNotFoundError`` with the install hint, unless ``allow_synthetic``:
  then, as always with ``synthetic``, a synthetic stand-in, flagged in ``info``.
  """
  directory = data_dir or FASHION_MNIST_DIR
  paths = None if synthetic else find_idx_files(directory)
  if paths is None:
    if not (allow_synthetic or synthetic):
      raise FileNotFoundError(f"Fashion-MNIST IDX files not found in {directory}. {FASHION_MNIST_HINT}")
    (x_tr, y_tr), (x_te, y_te) = synthetic_images(n_train, n_test)
    info = {
      "source": "SYNTHETIC stand-in (class prototypes + noise, Fashion-MNIST's shapes); "
      "not Fashion-MNIST: numbers are meaningless for the paper",
      "synthetic": True,
    }
  else:
    arrays = {k: read_idx(p) for k, p in paths.items()}
    x_all, y_all = arrays["train_images"], arrays["train_labels"].astype(np.int32)
    x_off, y_off = arrays["test_images"], arrays["test_labels"].astype(np.int32)
    if len(x_all) != len(y_all) or len(x_off) != len(y_off):
      raise ValueError(f"{directory}: images and labels disagree in number")
    if test_from == "rest":
      pool_x, pool_y = np.concatenate([x_all[n_train:], x_off]), np.concatenate([y_all[n_train:], y_off])
      described = (
        f"official training images {n_train}..{len(x_all) - 1}, then official test images "
        f"0..{len(x_off) - 1}; the first {n_test} of these"
      )
    elif test_from == "official":
      pool_x, pool_y = x_off, y_off
      described = f"official test images 0..{n_test - 1}"
    else:
      raise ValueError(f"test_from must be 'rest' or 'official', got {test_from!r}")
    if n_test > len(pool_x) or n_train > len(x_all):
      raise ValueError(
        f"n_train = {n_train}, n_test = {n_test}: only {len(x_all)} training and {len(pool_x)} test images available"
      )
    x_tr, y_tr, x_te, y_te = x_all[:n_train], y_all[:n_train], pool_x[:n_test], pool_y[:n_test]
    info = {
      "source": "fashion-mnist IDX",
      "synthetic": False,
      "files": paths,
      "train": f"official training images 0..{n_train - 1}",
      "test": described,
    }
  scale = lambda x: (x.reshape(len(x), 28, 28) / np.float32(255)).astype(np.float32)
  return Dataset(scale(x_tr), y_tr, scale(x_te), y_te, info)


# ----------------------------------------------------------------------------- digits


def digits(n_train: int = 500, *, seed: int = 0) -> Dataset:
  """scikit-learn's 8x8 digits (1797 images, shipped with the package) as 64 features in [0, 1].

  A random ``n_train`` images (``seed``) for training, the other images for testing.
  """
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  if not 0 < n_train < len(x):
    raise ValueError(f"n_train must be in 1..{len(x) - 1}, got {n_train}")
  order = np.random.default_rng(seed).permutation(len(x))
  x = (x / 16.0).astype(np.float32)[order]
  y = y.astype(np.int32)[order]
  info = {
    "source": "scikit-learn load_digits (8x8, 10 classes)",
    "synthetic": False,
    "split_seed": seed,
    "train": f"{n_train} random images",
    "test": f"the other {len(x) - n_train} images",
  }
  return Dataset(x[:n_train], y[:n_train], x[n_train:], y[n_train:], info)
