"""Smoke test of benchmarks/comparisons/muon.py (Muon and the manifold): its --smoke path, without torch.

The reference's rules are skipped when torch or its source is absent; Fashion-MNIST falls back to a
synthetic stand-in when the IDX files are missing.
"""

import importlib
import json
import pathlib

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  muon = importlib.import_module("benchmarks.comparisons.muon")
  out = tmp_path_factory.mktemp("muon")
  returned = muon.main(["--smoke", "--out", str(out), "--methods", "manifold_muon,reference"])
  return muon, out, returned


def test_writes_the_json_and_the_figure(smoke):
  _, out, returned = smoke
  data = json.loads((out / "muon.json").read_text())
  assert data == json.loads(json.dumps(returned))
  assert (out / "muon.png").stat().st_size > 0
  assert {"runs", "grid", "summary", "config", "invocations", "data"} <= set(data)
  versions = data["invocations"][-1]["versions"]
  assert {"jax", "jaxlib", "optax"} <= set(versions)


def test_runs_have_seeds_accuracy_speed_and_residual(smoke):
  muon, _, returned = smoke
  method = "manifold_muon" if hasattr(muon.cola, "manifold_muon") else "muon_on_manifold"
  rows = [r for r in returned["runs"] if r["method"] == method]
  assert [r["seed"] for r in rows] == [0, 1]  # vmapped over two seeds
  for r in rows:
    assert 0 <= r["test_accuracy"] <= 1 and r["ms_per_step"] > 0
    assert r["residual"] < 1e-5  # on the Stiefel manifold
  if method == "manifold_muon":
    assert returned["dual"][method]["steps"] > 0


def test_reference_is_skipped_without_its_source(smoke):
  _, _, returned = smoke
  skipped = returned["invocations"][-1]["skipped"]
  assert set(skipped) == {"reference_manifold_muon", "reference_hyperspherical_descent", "reference_adamw"}


def test_the_page_quotes_the_committed_results():
  """docs/muon.md's table is the one the committed results/comparisons/muon.json gives."""
  muon = importlib.import_module("benchmarks.comparisons.muon")
  report = importlib.import_module("benchmarks.comparisons.muon_report")
  root = pathlib.Path(__file__).resolve().parents[1]
  results = json.loads((root / "results" / "comparisons" / "muon.json").read_text())
  assert report.table(results, muon.LABELS) in (root / "docs" / "muon.md").read_text()
