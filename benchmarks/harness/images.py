"""Image data sets as uint8 ``(n, height, width, channels)`` arrays: Fashion-MNIST, CIFAR-10.

Images stay uint8 (a quarter of float32's memory on the device) and are scaled
to [0, 1] and standardised per channel batch by batch (:func:`scaler`);
training batches can be augmented by :func:`crop_and_flip`.
"""

from __future__ import annotations

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np

from . import data

SHAPES = {"fashion_mnist": (28, 28, 1), "cifar10": (32, 32, 3)}
CIFAR_FILES = {
  "py": ([f"data_batch_{i}" for i in range(1, 6)], "test_batch"),
  "bin": ([f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin"),
}


def find_cifar10(data_dir: str) -> tuple[str, dict] | None:
  """``(format, {'train': [paths], 'test': path})`` of the CIFAR-10 batches under ``data_dir``
  (or its ``cifar-10-batches-py`` / ``cifar-10-batches-bin`` folder), or None."""
  for directory in (data_dir, *(os.path.join(data_dir, f"cifar-10-batches-{fmt}") for fmt in CIFAR_FILES)):
    for fmt, (train, test) in CIFAR_FILES.items():
      paths = [os.path.join(directory, f) for f in (*train, test)]
      if all(os.path.isfile(p) for p in paths):
        return fmt, {"train": paths[:-1], "test": paths[-1]}
  return None


def read_cifar10_batch(path: str, fmt: str):
  """One CIFAR-10 batch, python (pickled) or binary ``fmt``, as ``(uint8 (n, 32, 32, 3), int32 labels)``."""
  if fmt == "py":
    with open(path, "rb") as f:
      batch = pickle.load(f, encoding="bytes")
    x, y = np.asarray(batch[b"data"], np.uint8), np.asarray(batch[b"labels"], np.int32)
  else:
    raw = np.fromfile(path, np.uint8).reshape(-1, 1 + 3072)
    x, y = raw[:, 1:], raw[:, 0].astype(np.int32)
  return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y


def load_cifar10(data_dir: str | None):
  """``((x_train, y_train), (x_test, y_test), files)``: the 50k training and 10k test images."""
  found = find_cifar10(data_dir) if data_dir else None
  if found is None:
    raise FileNotFoundError(
      f"CIFAR-10 batches not found in {data_dir!r}: pass --data-dir DIR holding the python "
      "(data_batch_1..5, test_batch) or binary (data_batch_1.bin..5.bin, test_batch.bin) "
      "batches, or their cifar-10-batches-py / cifar-10-batches-bin folder."
    )
  fmt, paths = found
  parts = [read_cifar10_batch(p, fmt) for p in paths["train"]]
  train = (np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))
  return train, read_cifar10_batch(paths["test"], fmt), {"format": fmt, **paths}


def load_fashion_mnist(data_dir: str | None):
  """``((x_train, y_train), (x_test, y_test), files)``: the official 60k training and 10k test images."""
  directory = data_dir or data.FASHION_MNIST_DIR
  paths = data.find_idx_files(directory)
  if paths is None:
    raise FileNotFoundError(f"Fashion-MNIST IDX files not found in {directory}. {data.FASHION_MNIST_HINT}")
  x_tr, y_tr, x_te, y_te = (data.read_idx(paths[k]) for k in data.IDX_FILES)
  return (x_tr[..., None], y_tr.astype(np.int32)), (x_te[..., None], y_te.astype(np.int32)), paths


def image_dataset(
  name: str,
  data_dir: str | None,
  n_train: int,
  n_test: int,
  *,
  synthetic: bool = False,
  allow_synthetic: bool = False,
):
  """The first ``n_train`` official training and ``n_test`` official test images of ``name``
  (``"fashion_mnist"`` or ``"cifar10"``) as a :class:`harness.data.Dataset` of uint8 images.
  Missing files raise ``FileNotFoundError`` naming ``--data-dir``, unless ``allow_synthetic``:
  then, as always with ``synthetic``, a stand-in of the same shapes (class prototypes + noise)."""
  load = load_fashion_mnist if name == "fashion_mnist" else load_cifar10
  if not synthetic:
    try:
      (x_tr, y_tr), (x_te, y_te), files = load(data_dir)
    except FileNotFoundError:
      if not allow_synthetic:
        raise
      synthetic = True
  if synthetic:
    (x_tr, y_tr), (x_te, y_te) = data.synthetic_images(n_train, n_test, shape=SHAPES[name])
    info = {
      "source": f"SYNTHETIC stand-in ({'x'.join(map(str, SHAPES[name]))} class prototypes + noise); "
      "numbers are meaningless for the paper",
      "synthetic": True,
    }
    return data.Dataset(x_tr, y_tr, x_te, y_te, info)
  for split, x, n in (("train", x_tr, n_train), ("test", x_te, n_test)):
    if n > len(x):
      raise ValueError(f"--n-{split} {n} but the {split} set has {len(x)} images")
  info = {
    "source": "fashion-mnist IDX" if name == "fashion_mnist" else "CIFAR-10 batches",
    "synthetic": False,
    "files": files,
    "train": f"official training images 0..{n_train - 1}",
    "test": f"official test images 0..{n_test - 1}",
  }
  return data.Dataset(x_tr[:n_train], y_tr[:n_train], x_te[:n_test], y_te[:n_test], info)


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and standard deviation of uint8 images scaled to [0, 1] (float32)."""
  x = images.reshape(-1, images.shape[-1]).astype(np.float64) / 255.0
  return x.mean(0).astype(np.float32), x.std(0).astype(np.float32)


def scaler(mean, std):
  """``uint8 images -> (images / 255 - mean) / std`` in float32, per channel."""
  mean, std = jnp.asarray(mean), jnp.asarray(std)
  return lambda x: (x.astype(jnp.float32) / 255.0 - mean) / std


def crop_and_flip(key, x):
  """A random crop of each image padded by 4 (zeros) and a random horizontal flip."""
  n, height, width, channels = x.shape
  crop_key, flip_key = jax.random.split(key)
  offsets = jax.random.randint(crop_key, (n, 2), 0, 9)
  flips = jax.random.bernoulli(flip_key, 0.5, (n,))
  padded = jnp.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))

  def one(image, offset, flip):
    image = jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, channels))
    return jnp.where(flip, image[:, ::-1], image)

  return jax.vmap(one)(padded, offsets, flips)
