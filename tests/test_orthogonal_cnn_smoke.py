"""Smoke test of benchmarks/paper/orthogonal_cnn.py: o-CoLA-ud with orthogonal conv kernels vs SGD-m.

The small CNN runs ``--smoke --synthetic`` (no data files needed); the ResNet
only builds and takes one o-CoLA-ud step at width 4 (compiling a ResNet-18 is
what costs time on a CPU). The harness pieces it uses are tested in test_harness.py.
"""

import math

import _smoke as smoke
import jax
import numpy as np
import pytest

import cola_jax as cola
from benchmarks.harness import images, models, schedules, stepwise, vision

pytestmark = pytest.mark.integration

CONSTRAINED = {"conv1/kernel", "conv2/kernel"}


@pytest.fixture(scope="module")
def oc(load_benchmark):
  return load_benchmark("paper.orthogonal_cnn")


@pytest.fixture(scope="module")
def smoke_run(oc, tmp_path_factory):
  return smoke.run(oc, "orthogonal_cnn", tmp_path_factory, "--synthetic")


def test_json_schema(oc, smoke_run):
  data = smoke.report(*smoke_run, "orthogonal_cnn", "status", "data")
  assert data["status"] == "complete" and data["data"]["synthetic"] is True
  assert data["argv"][:2] == ["--smoke", "--synthetic"]
  assert data["versions"]["flax"] and data["machine"]["cpu_count"]
  n_seeds, epochs = oc.SMOKE["seeds"], oc.SMOKE["epochs"]
  config = data["config"]
  assert data["seeds"] == list(range(n_seeds))
  assert config["epochs"] == config["epochs_completed"] == epochs
  assert config["model"] == "small" and config["dataset"] == "fashion_mnist"
  assert config["steps_per_epoch"] == oc.SMOKE["n_train"] // oc.SMOKE["batch_size"]
  assert set(config["constrained_kernels"]) == CONSTRAINED
  assert config["free_conv_kernel"] == "conv0/kernel"
  assert list(data["results"]) == list(oc.METHODS) == list(data["summary"])

  for method, entry in data["results"].items():
    for key in (
      "test_accuracy",
      "best_test_accuracy",
      "test_loss",
      "min_test_loss",
      "train_loss",
      "init_param_l2",
      "time_s",
    ):
      assert len(entry[key]) == n_seeds and all(math.isfinite(v) for v in entry[key]), (method, key)
    assert all(0 <= a <= b <= 1 for a, b in zip(entry["test_accuracy"], entry["best_test_accuracy"]))
    assert all(v > 0 for v in entry["test_loss"])
    history = entry["history"]
    assert history["epoch"] == list(range(1, epochs + 1))
    for key in ("test_accuracy", "test_loss", "train_loss", "train_batch_accuracy"):
      assert np.shape(history[key]) == (epochs, n_seeds)
    assert history["test_accuracy"][-1] == entry["test_accuracy"]
    assert data["summary"][method]["test_accuracy_mean"] == pytest.approx(np.mean(entry["test_accuracy"]))
    assert set(entry["orthogonality_defect"]) == CONSTRAINED | {"conv0/kernel"}
    assert ("constraint_residuals" in entry) == (method == "ocola_ud")


def test_png_written(smoke_run):
  out, _ = smoke_run
  png = out / "orthogonal_cnn.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_constrained_kernels_are_orthonormal(oc, smoke_run):
  _, data = smoke_run
  entry = data["results"]["ocola_ud"]
  assert set(entry["constraint_residuals"]) == CONSTRAINED
  assert max(max(v) for v in entry["constraint_residuals"].values()) <= 1e-5
  assert data["summary"]["ocola_ud"]["max_constraint_residual"] <= 1e-5
  for run in oc.LAST_RUNS["ocola_ud"]:
    params, _, state = run.carry
    residuals = cola.constraint_residuals(params, state)
    assert residuals["conv0"]["kernel"] is None and residuals["dense"]["kernel"] is None
    for name in ("conv1", "conv2"):
      assert float(residuals[name]["kernel"]) <= 1e-5
      kernel = np.asarray(params[name]["kernel"], np.float64)
      q = kernel.reshape(-1, kernel.shape[-1])  # (9 in, out): tall, orthonormal filters
      assert q.shape[0] > q.shape[1]
      np.testing.assert_allclose(q.T @ q, np.eye(q.shape[1]), atol=1e-5)
  # SGD-m's kernels are nowhere near orthonormal: the constraint is what holds them.
  assert min(min(v) for k, v in data["results"]["sgdm"]["orthogonality_defect"].items() if k in CONSTRAINED) > 0.1


def test_first_conv_is_free(oc, smoke_run):
  _, data = smoke_run
  params = oc.LAST_RUNS["ocola_ud"][0].params
  constraints = oc.ORTHOGONAL(params)
  assert constraints["conv0"]["kernel"] is None and constraints["dense"]["kernel"] is None
  assert all(constraints[name]["bias"] is None for name in ("conv0", "conv1", "conv2", "dense"))
  assert isinstance(constraints["conv1"]["kernel"], cola.Orthogonal)
  assert params["conv0"]["kernel"].shape == (3, 3, 1, 16)  # a 9 x 16 (wide) matrix
  for run in oc.LAST_RUNS["ocola_ud"]:
    init, final = run.init_variables[0], run.params
    moved = np.max(np.abs(np.asarray(final["conv0"]["kernel"]) - np.asarray(init["conv0"]["kernel"])))
    assert moved > 1e-4
  # Its rows are far from orthonormal, before and after training.
  assert min(data["results"]["ocola_ud"]["orthogonality_defect"]["conv0/kernel"]) > 0.1


def test_methods_start_from_the_same_parameters(oc, smoke_run):
  _, data = smoke_run
  inits = {m: [run.init_variables for run in oc.LAST_RUNS[m]] for m in oc.METHODS}
  for seed in range(oc.SMOKE["seeds"]):
    for m in oc.METHODS[1:]:
      jax.tree.map(np.testing.assert_array_equal, inits[m][seed], inits["ocola_ud"][seed])
  l2 = [data["results"][m]["init_param_l2"] for m in oc.METHODS]
  assert l2[0] == l2[1] == l2[2] and l2[0][0] != l2[0][1]  # same per seed, different seeds differ
  # PyTorch's init: U(+-1/sqrt(fan_in)) for kernels and biases, fan_in = kh*kw*in for a conv.
  params = inits["sgdm"][0][0]
  for name, fan_in in (("conv0", 9), ("conv1", 9 * 16), ("conv2", 9 * 32), ("dense", 7 * 7 * 64)):
    bound = 1 / math.sqrt(fan_in)
    assert 0.9 * bound < np.max(np.abs(params[name]["kernel"])) <= bound, name
    assert 0 < np.max(np.abs(params[name]["bias"])) <= bound, name
  # It is off the manifold: o-CoLA-ud's first update projects it.
  init_defect = data["results"]["ocola_ud"]["init_orthogonality_defect"]
  assert min(min(init_defect[k]) for k in CONSTRAINED) > 0.1


def test_ocola_step_size_matches_sgdm_schedule(oc):
  steps, decay = 10, (2, 4)
  tx_h = schedules.step_decay(math.sqrt(oc.SGD_LR), steps, decay, math.sqrt(oc.DECAY_FACTOR))
  tx_lr = schedules.step_decay(oc.SGD_LR, steps, decay, oc.DECAY_FACTOR)
  for step, lr in ((0, 0.1), (19, 0.1), (20, 0.01), (39, 0.01), (40, 1e-3), (100, 1e-3)):
    assert float(tx_lr(step)) == pytest.approx(lr, rel=1e-6)
    assert float(tx_h(step)) ** 2 == pytest.approx(lr, rel=1e-5)


@pytest.mark.slow  # compiling a ResNet step: 131 s here on a loaded 2-core CPU, the quick suite's longest test
def test_resnet_one_step_keeps_its_constraints(oc):
  dataset = images.image_dataset("cifar10", None, 8, 8, synthetic=True)
  fns = stepwise.method(
    vision.model("resnet18", width=4),
    oc.make_optimizer("ocola_ud", 1, ()),
    dataset.x_train.shape[1:],
    8,
    images.scaler(*images.channel_stats(dataset.x_train)),
    images.crop_and_flip,
  )
  run = stepwise.Run(fns, 0, stepwise.device_data(dataset), eval_every=1)
  params0, stats0 = run.init_variables
  assert set(stats0) >= {"bn0", "stage1_block0"}  # BatchNorm running statistics exist
  run.advance()  # one step (8 images, batch 8), then the test set
  params, stats, state = run.carry
  assert np.isfinite(run.history["train_loss"][-1]) and np.isfinite(run.history["test_loss"][-1])
  residuals = cola.constraint_residuals(params, state)
  flat = {models.param_path(p): float(v) for p, v in jax.tree_util.tree_flatten_with_path(residuals)[0]}
  # 16 block convs and 3 shortcut convs; the stem conv0 is free.
  assert len(flat) == 19 and "conv0/kernel" not in flat and max(flat.values()) <= 1e-5
  shortcut = params["stage2_block0"]["shortcut_conv"]["kernel"]
  assert shortcut.shape == (1, 1, 4, 8)  # a 4 x 8 (wide) matrix: orthonormal rows
  w = np.asarray(shortcut, np.float64).reshape(4, 8)
  np.testing.assert_allclose(w @ w.T, np.eye(4), atol=1e-5)
  assert residuals["conv0"]["kernel"] is None
  # The running statistics moved in training mode.
  assert not np.allclose(np.asarray(stats["bn0"]["mean"]), np.asarray(stats0["bn0"]["mean"]))
