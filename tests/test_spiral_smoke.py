"""Smoke test of benchmarks/paper/spiral.py, the spiral experiment (paper Figs. 2-3)."""

import json
import math
import pathlib

import _smoke as smoke
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def spiral(load_benchmark):
  return load_benchmark("paper.spiral")


@pytest.fixture(scope="module")
def smoke_run(spiral, tmp_path_factory):
  return smoke.run(spiral, "spiral", tmp_path_factory)


def test_json_schema(spiral, smoke_run):
  data = smoke.report(*smoke_run, "spiral", "depths")
  assert data["versions"]["jax"]

  n_seeds = spiral.SMOKE["seeds"]
  depths = spiral.SMOKE["depths"]
  epochs = spiral.SMOKE["epochs"]
  assert data["depths"] == depths
  assert data["seeds"] == list(range(n_seeds))
  assert data["config"]["epochs"] == epochs
  assert set(data["methods"]) == set(spiral.METHOD_ORDER)
  assert set(data["results"]) == set(spiral.METHOD_ORDER)

  for method, per_depth in data["results"].items():
    assert set(per_depth) == {str(d) for d in depths}
    for depth, entry in per_depth.items():
      for key in ("test_accuracy", "train_accuracy", "test_loss", "train_loss"):
        values = entry[key]
        assert isinstance(values, list) and len(values) == n_seeds, (method, depth, key)
        assert all(isinstance(v, float) and math.isfinite(v) for v in values)
      assert all(0.0 <= v <= 1.0 for v in entry["test_accuracy"] + entry["train_accuracy"])
      assert all(v >= 0.0 for v in entry["test_loss"] + entry["train_loss"])
      history = entry["history"]
      n_evals = len(history["epoch"])
      assert history["epoch"][-1] == epochs
      assert np.shape(history["test_accuracy"]) == (n_evals, n_seeds)
      assert history["test_accuracy"][-1] == entry["test_accuracy"]
      summary = data["summary"][method][depth]
      assert summary["test_accuracy_mean"] == pytest.approx(np.mean(entry["test_accuracy"]))
      if method.startswith("ocola"):
        assert len(entry["max_orthogonality_defect"]) == n_seeds
        assert len(entry["projection_fallbacks"]) == n_seeds


def test_png_written(smoke_run):
  out, _ = smoke_run
  png = out / "spiral.png"
  assert png.exists()
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert png.stat().st_size > 10_000


def test_ocola_stays_orthonormal_in_the_run(smoke_run):
  _, data = smoke_run
  for method in ("ocola_od", "ocola_od_tau"):
    for depth in data["depths"]:
      if depth >= 2:  # depth 1 has no hidden-to-hidden matrix
        assert max(data["results"][method][str(depth)]["max_orthogonality_defect"]) <= 1e-5


def test_depth_one_ocola_is_plain_sgd(smoke_run):
  # With a single hidden layer nothing is constrained: o-CoLA-od at tau = 0 is
  # SGD with the same (PyTorch) init, minibatches and step size.
  _, data = smoke_run
  sgd, ocola = data["results"]["sgd"]["1"], data["results"]["ocola_od"]["1"]
  np.testing.assert_allclose(ocola["train_loss"], sgd["train_loss"], rtol=1e-5)
  assert ocola["test_accuracy"] == sgd["test_accuracy"]


def test_trained_hidden_weights_are_orthonormal(spiral, smoke_run):
  # The parameters at the end of the smoke run, straight from main().
  for method in ("ocola_od", "ocola_od_tau"):
    params = spiral.LAST_RUN_PARAMS[method][3]
    assert sorted(params) == ["layer0", "layer1", "layer2", "layer3"]  # input, 2 hidden-to-hidden, output
    for name in ("layer1", "layer2"):
      w = np.asarray(params[name]["kernel"], np.float64)  # (seeds, 100, 100)
      assert w.shape == (spiral.SMOKE["seeds"], 100, 100)
      gram = np.einsum("ski,skj->sij", w, w)
      assert np.max(np.abs(gram - np.eye(100))) <= 1e-5
    # Training moved the constrained weights away from their initialisation.
    init_key = spiral.train.seed_keys(0)[0]
    fresh = spiral.model(3, lambda i: 0 < i < 3).init(init_key, jnp.zeros((1, 2)))["params"]
    assert float(jnp.max(jnp.abs(params["layer1"]["kernel"][0] - fresh["layer1"]["kernel"]))) > 1e-4


def test_smoke_run_defaults_to_a_new_temporary_folder(spiral):
  # --smoke without --out never writes over the committed results/.
  args = spiral.parse_args(["--smoke"])
  assert args.out is None and args.epochs == spiral.SMOKE["epochs"]
  assert spiral.parse_args([]).out == "results/paper/"


def test_help_describes_every_flag(spiral, capsys):
  with pytest.raises(SystemExit) as exit_info:
    spiral.parse_args(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--seeds", "--epochs", "--out", "--smoke", "--depths", "--methods", "--temperature"):
    assert flag in out
  assert "(default: 10)" in out and "(default: 1-10)" in out


def test_bad_flags_are_refused(spiral):
  with pytest.raises(SystemExit):
    spiral.parse_args(["--methods", "adam"])
  with pytest.raises(SystemExit):
    spiral.parse_args(["--depths", "0-3"])
  with pytest.raises(SystemExit):
    spiral.parse_args(["--epochs", "10", "--eval-every", "3"])


def _part(data, methods, depths, path):
  """The JSON a run of only ``methods`` at ``depths`` would have written (cut from the smoke run's)."""
  part = json.loads(json.dumps(data))
  part["config"].update(methods=list(methods), depths=list(depths))
  part.update(depths=list(depths), methods={m: data["methods"][m] for m in methods})
  part["results"] = {m: {str(d): data["results"][m][str(d)] for d in depths} for m in methods}
  path.write_text(json.dumps(part))
  return str(path)


def test_merge_joins_runs_that_split_methods_and_depths(spiral, smoke_run, tmp_path):
  out, data = smoke_run
  data = json.loads((out / "spiral.json").read_text())
  low, high = data["depths"]
  parts = [
    _part(data, ("sgd", "sgd_orth"), data["depths"], tmp_path / "a.json"),
    _part(data, ("ocola_od", "ocola_od_tau"), [low], tmp_path / "b.json"),
    _part(data, ("ocola_od", "ocola_od_tau"), [high], tmp_path / "c.json"),
  ]
  merged = spiral.main(["--merge", *parts, "--out", str(tmp_path / "all")])
  assert merged["results"] == data["results"]
  assert merged["summary"] == data["summary"]
  assert merged["config"] == data["config"]
  assert [run["depths"] for run in merged["merged_from"]] == [data["depths"], [low], [high]]
  assert (tmp_path / "all" / "spiral.png").exists()


def test_merge_refuses_overlaps_gaps_and_other_protocols(spiral, smoke_run, tmp_path):
  out, _ = smoke_run
  data = json.loads((out / "spiral.json").read_text())
  whole = _part(data, spiral.METHOD_ORDER, data["depths"], tmp_path / "whole.json")
  with pytest.raises(SystemExit, match="repeats a depth of sgd"):
    spiral.main(["--merge", whole, whole, "--out", str(tmp_path)])
  gap = _part(data, ("sgd",), data["depths"][:1], tmp_path / "gap.json")
  other = _part(data, ("sgd_orth",), data["depths"], tmp_path / "other.json")
  with pytest.raises(SystemExit, match=f"no run did sgd p={data['depths'][1]}"):
    spiral.main(["--merge", gap, other, "--out", str(tmp_path)])
  longer = json.loads(pathlib.Path(other).read_text())
  longer["config"]["epochs"] += 1
  pathlib.Path(other).write_text(json.dumps(longer))
  with pytest.raises(SystemExit, match="ran another protocol"):
    spiral.main(["--merge", gap, other, "--out", str(tmp_path)])
