"""The memory benchmark of constrained, manifold_muon and hyperspherical_descent runs in --smoke mode."""

import json

import pytest

pytestmark = pytest.mark.integration


def test_smoke_run_writes_every_row(load_benchmark, tmp_path):
  bench = load_benchmark("cost.transform_memory")
  returned = bench.main(["--smoke", "--out", str(tmp_path)])
  report = json.loads((tmp_path / "transform_memory.json").read_text())
  assert report["results"] == json.loads(json.dumps(returned["results"]))
  assert [r["name"] for r in report["results"]] == list(bench.ROWS)
  for row in report["results"]:
    assert row["temp_bytes"] > 0 and row["compile_cpu_s"] > 0
  by_name = {r["name"]: r for r in report["results"]}
  assert by_name["constrained_adam_circle"]["state_bytes"] > by_name["adam"]["state_bytes"]  # the slacks
