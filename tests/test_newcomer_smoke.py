"""The newcomer benchmark (issue 37's first run with optax habits) runs end to end and records every spelling."""

import json
import math

import pytest

pytestmark = pytest.mark.integration


def test_smoke_run_records_every_method(load_benchmark, tmp_path):
  newcomer = load_benchmark("comparisons.newcomer")
  newcomer.main(["--smoke", "--out", str(tmp_path)])
  with open(tmp_path / "newcomer.json") as f:
    report = json.load(f)
  assert set(report["final_loss"]) == set(newcomer.METHODS)
  for losses in report["final_loss"].values():
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
  assert report["config"]["steps"] == 5 and "machine" in report["meta"]
