"""The samplers' cost benchmark runs end to end in --smoke mode and writes its documented report.

Only the structure and the byte counts are checked: timings are the benchmark's business, never a test's.
"""

import json
import math

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sampler_cost(load_benchmark):
  return load_benchmark("cost.sampler_cost")


@pytest.mark.slow  # about a minute of compiling: the quick suite keeps within its time
def test_smoke_run_writes_the_documented_report(sampler_cost, tmp_path):
  returned = sampler_cost.main(["--smoke", "--quiet", "--out", str(tmp_path)])

  with open(tmp_path / "sampler_cost.json") as f:
    report = json.load(f)
  assert set(sampler_cost.TOP_KEYS) <= set(report)
  assert {"command", "argv", "date", "machine", "versions"} <= set(report["meta"])
  assert "blackjax" in report["meta"]["versions"]
  assert report["config"]["smoke"] is True and report["config"]["complete"] is True
  for part in ("optimizer", "chains", "noise", "noise_draws"):
    assert report[part] == json.loads(json.dumps(returned[part]))
    for record in report[part]:
      assert set(sampler_cost.RECORD_KEYS) <= set(record), record["name"]
      for key in ("method_ms", "baseline_ms", "ratio"):
        assert math.isfinite(record[key]) and record[key] > 0, (record["name"], key)
      for side in ("method", "baseline"):
        cost = record["compile"][side]
        assert cost["compile_s"] > 0 and cost["compile_cpu_s"] > 0 and cost["temp_bytes"] >= 0, record["name"]

  assert [r["method"] for r in report["optimizer"]] == ["underdamped", "overdamped"]
  sizes = report["config"]["models"]["mlp100"]["sizes"]
  position_bytes = 4 * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
  chains, steps = report["config"]["chains"], report["config"]["integration_steps"]
  for record in report["chains"]:
    assert record["gradients_per_call"] == steps and record["chains"] == chains
    assert record["position_bytes"] == position_bytes
  # blackjax's sgld keeps the position only: its vmapped program takes the chains' positions and their keys
  # (two uint32 each), nothing else; cola's overdamped state is the position too, without constraints.
  sgld = next(r for r in report["chains"] if r["baseline"] == "blackjax.sgld")
  assert sgld["compile"]["baseline"]["argument_bytes"] == chains * (position_bytes + 8)
  assert sgld["compile"]["method"]["argument_bytes"] == chains * (position_bytes + 8)

  # The collection's output is what was asked: the samples, the last states, the step count and XLA's tuple
  # table, whatever the thinning and burn-in; twice the samples, twice the samples' bytes.
  rows = report["collection"]
  assert [r["chains"] for r in rows] == [1, chains, chains, chains]
  assert all(r["excess_bytes"] == 0 for r in rows)
  single, thin, thinned, double = rows
  assert thin["output_bytes"] == thinned["output_bytes"] and (thin["thinning"], thinned["thinning"]) == (1, 10)
  assert double["output_bytes"] - thin["output_bytes"] == chains * thin["num_samples"] * position_bytes
  assert single["position_bytes"] == position_bytes

  impls = report["config"]["impls"]
  assert {(r["impl"], r["kind"]) for r in report["noise"]} == {
    (impl, kind) for impl in (None, *impls) for kind in ("update", "step")
  }
  sizes = report["config"]["models"]["mlp1000"]["sizes"]
  normals = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
  assert [d["impl"] for d in report["noise_draws"]] == impls
  assert all(d["normals"] == normals for d in report["noise_draws"])
  assert {(k["impl"], k["kind"]) for k in report["key_impls"]} == {
    (impl, kind) for impl in impls for kind in ("update", "step")
  }
  threefry = [k for k in report["key_impls"] if k["impl"] == "threefry2x32"]
  assert all(k["saving_vs_threefry"] == 0 and k["buys_over_10_percent"] is False for k in threefry)

  assert len(report["targets"]) == 5
  assert all(t["met"] in (True, False) and math.isfinite(t["value"]) for t in report["targets"])


def test_help_lists_the_options(sampler_cost, capsys):
  with pytest.raises(SystemExit) as exit_info:
    sampler_cost.parse_args(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for option in ("--smoke", "--out", "--chains", "--integration-steps", "--impls"):
    assert option in out


def test_impls_without_the_reference_are_a_usage_error(sampler_cost, capsys):
  with pytest.raises(SystemExit) as exit_info:
    sampler_cost.parse_args(["--impls", "rbg"])
  assert exit_info.value.code == 2
  assert "threefry2x32 is the reference" in capsys.readouterr().err
