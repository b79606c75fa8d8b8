"""Smoke test of benchmarks/comparisons/muon_direction.py (the direction's cost against its suboptimality)."""

import importlib
import json

import _rounding as rounding
import numpy as np
import pytest

pytestmark = pytest.mark.integration


def test_the_certified_gaps_bound_the_measured_suboptimality(tmp_path):
  bench = importlib.import_module("benchmarks.comparisons.muon_direction")
  returned = bench.main(["--smoke", "--out", str(tmp_path)])
  data = json.loads((tmp_path / "muon_direction.json").read_text())
  assert data == json.loads(json.dumps(returned))
  assert {"admm_gap_0.01", "admm_10_iterations", "projected_msign", "spel"} == set(data["variants"])
  entries = [(k, w[0] * w[1]) for k, w in data["config"]["shapes"].items()]
  for name, variant in data["variants"].items():
    assert variant["ms_median"] > 0
    for layer, size in entries:
      exact = np.asarray(data["exact_gap"][layer])
      measured = np.asarray(variant["suboptimality"][layer])
      # The measured values are float64 sums of float32 products; the certificates float32 sums.
      slack = exact + rounding.roundings(2 * size)
      assert np.all(measured >= -slack)  # nothing beats the exact direction
      if name.startswith("admm_gap_"):
        gaps = np.asarray(variant["certified_gap"][layer])
        assert np.all(gaps <= 0.01) and np.all(measured <= gaps + slack)
