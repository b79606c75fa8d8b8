"""benchmarks/harness for convolutional models: image data, Flax CNNs, step decay, stepwise training."""

import pickle

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn

from benchmarks.harness import data, images, schedules, stepwise, vision

pytestmark = pytest.mark.integration


def test_cifar10_readers(tmp_path):
  rng = np.random.default_rng(0)
  pixels = rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8)  # CIFAR's channel-major rows
  labels = np.arange(6) % 10
  py, binary = tmp_path / "cifar-10-batches-py", tmp_path / "bin"
  py.mkdir()
  binary.mkdir()
  for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
    with open(py / name, "wb") as f:
      pickle.dump({b"data": pixels[i : i + 1].reshape(1, -1), b"labels": [int(labels[i])]}, f)
    record = np.concatenate([[labels[i]], pixels[i].reshape(-1)]).astype(np.uint8)
    record.tofile(binary / f"{name}.bin")
  for directory in (tmp_path, binary):
    (x_tr, y_tr), (x_te, y_te), _ = images.load_cifar10(str(directory))
    assert x_tr.shape == (5, 32, 32, 3) and x_te.shape == (1, 32, 32, 3)
    np.testing.assert_array_equal(x_tr, pixels[:5].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(y_tr, labels[:5])
    assert y_te.tolist() == [labels[5]]
  dataset = images.image_dataset("cifar10", str(binary), 4, 1)
  assert dataset.x_train.shape == (4, 32, 32, 3) and dataset.info["train"] == "official training images 0..3"
  with pytest.raises(ValueError, match="--n-train 6 but the train set has 5 images"):
    images.image_dataset("cifar10", str(binary), 6, 1)
  with pytest.raises(FileNotFoundError, match="--data-dir"):
    images.load_cifar10(str(tmp_path / "bin" / "missing"))


def test_missing_files_fall_back_to_synthetic_only_when_allowed(tmp_path):
  with pytest.raises(FileNotFoundError, match="Fashion-MNIST IDX files not found"):
    images.image_dataset("fashion_mnist", str(tmp_path), 10, 5)
  dataset = images.image_dataset("fashion_mnist", str(tmp_path), 10, 5, allow_synthetic=True)
  assert dataset.info["synthetic"] and dataset.x_train.shape == (10, 28, 28, 1) and dataset.x_train.dtype == np.uint8
  assert images.image_dataset("cifar10", None, 3, 2, synthetic=True).x_test.shape == (2, 32, 32, 3)


def test_scaler_standardises_per_channel():
  x = np.random.default_rng(1).integers(0, 256, (50, 4, 4, 3), dtype=np.uint8)
  mean, std = images.channel_stats(x)
  y = np.asarray(images.scaler(mean, std)(x)).reshape(-1, 3)
  np.testing.assert_allclose(y.mean(0), 0, atol=1e-5)
  np.testing.assert_allclose(y.std(0), 1, atol=1e-5)


def test_crop_and_flip_is_a_window_of_the_padded_image():
  x = np.arange(2 * 5 * 5, dtype=np.float32).reshape(2, 5, 5, 1) + 1
  out = np.asarray(jax.jit(images.crop_and_flip)(jax.random.key(3), x))
  padded = np.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))
  for image, result in zip(padded, out):
    windows = [image[i : i + 5, j : j + 5] for i in range(9) for j in range(9)]
    assert any(np.array_equal(result, w) or np.array_equal(result, w[:, ::-1]) for w in windows)


def test_step_decay_and_thirds():
  schedule = schedules.step_decay(1.0, 10, (2, 4, 4), 0.5)
  for step, value in ((0, 1.0), (19, 1.0), (20, 0.5), (39, 0.5), (40, 0.125), (1000, 0.125)):
    assert float(schedule(step)) == pytest.approx(value)
  assert schedules.thirds(18) == (6, 12) and schedules.thirds(150) == (50, 100) and schedules.thirds(1) == ()


def test_torch_init_of_a_resnet():
  model = vision.model("resnet18", width=2)
  shapes = jax.eval_shape(lambda k: model.init(k, np.zeros((1, 8, 8, 3)), train=False), jax.random.key(0))
  params, batch_stats = vision.torch_init(jax.random.key(1), shapes)
  block = params["stage2_block0"]
  kernels = (params["conv0"]["kernel"], block["conv1"]["kernel"], params["dense"]["kernel"])
  for kernel, fan_in in zip(kernels, (3 * 9, 2 * 9, 16)):
    assert 0.8 / np.sqrt(fan_in) < np.max(np.abs(kernel)) <= 1 / np.sqrt(fan_in)
  assert np.all(block["bn1"]["scale"] == 1) and np.all(block["bn1"]["bias"] == 0)
  assert np.all(batch_stats["bn0"]["mean"] == 0) and np.all(batch_stats["bn0"]["var"] == 1)
  with pytest.raises(ValueError, match="resnet50"):
    vision.model("resnet50")


def test_orthogonality_defects_of_tall_and_wide_kernels():
  q = np.linalg.qr(np.random.default_rng(2).normal(size=(18, 4)))[0]
  params = {"tall": {"kernel": q.reshape(3, 3, 2, 4)}, "wide": {"kernel": q.T.reshape(1, 1, 4, 18)}, "b": np.ones(3)}
  defects = vision.orthogonality_defects(params)
  assert set(defects) == {"tall/kernel", "wide/kernel"} and max(defects.values()) < 1e-12
  assert vision.orthogonality_defects({"c": {"kernel": 2 * q.reshape(3, 3, 2, 4)}})["c/kernel"] == pytest.approx(3)


class DenseBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(6, name="dense0")(x.reshape(len(x), -1))
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x))
    return nn.Dense(10, name="dense1")(x)


def test_stepwise_runs_take_full_batches_and_update_batch_stats():
  (x_tr, y_tr), (x_te, y_te) = data.synthetic_images(20, 7, shape=(4, 4, 1))
  on_device = stepwise.device_data(data.Dataset(x_tr, y_tr, x_te, y_te, {}), eval_batch=3)
  assert [len(c[0]) for c in on_device.test_chunks] == [3, 3, 3] and float(on_device.test_chunks[-1][2].sum()) == 1
  model = DenseBatchNorm()
  sgd = stepwise.method(model, optax.sgd(0.1), (4, 4, 1), 8, images.scaler(0.0, 1.0))
  runs = [stepwise.Run(sgd, seed, on_device, eval_every=2) for seed in (0, 1)]
  momentum = stepwise.Run(stepwise.method(model, optax.sgd(0.1, 0.9), (4, 4, 1), 8), 0, on_device, eval_every=2)
  jax.tree.map(np.testing.assert_array_equal, runs[0].init_variables, momentum.init_variables)  # same seed, same init
  kernels = [run.init_variables[0]["dense0"]["kernel"] for run in runs]
  assert not np.array_equal(kernels[0], kernels[1])
  for run in runs:
    run.advance()
    run.advance()
  run = runs[0]
  assert run.steps_per_epoch == 2 and run.epochs_done == 4 and run.history["epoch"] == [2, 4]  # 20 = 2 x 8 + 4 skipped
  assert not np.allclose(run.carry[1]["bn"]["mean"], 0) and not np.allclose(run.carry[1]["bn"]["var"], 1)
  entry = stepwise.entry(runs)
  assert entry["test_accuracy"] == [r.history["test_accuracy"][-1] for r in runs]
  assert all(b >= a for a, b in zip(entry["test_accuracy"], entry["best_test_accuracy"]))
  assert np.shape(entry["history"]["train_loss"]) == (2, 2) and entry["best_test_accuracy_epoch"][0] in (2, 4)
  # Evaluation uses the running statistics: the test loss is the mean over the 7 test examples.
  params, batch_stats, _ = run.carry
  logits = model.apply({"params": params, "batch_stats": batch_stats}, x_te.astype(np.float32) / 255)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_te).mean()
  assert run.history["test_loss"][-1] == pytest.approx(float(loss), rel=1e-5)
