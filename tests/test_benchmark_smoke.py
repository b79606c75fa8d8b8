"""The step-overhead benchmark runs end to end in --smoke mode and writes its report.

Only the structure of the report is checked: timings are the benchmark's
business, never a test's.
"""

import json
import math

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def step_overhead(load_benchmark):
  return load_benchmark("cost.step_overhead")


@pytest.mark.slow  # a long run: the quick suite keeps within its time
def test_smoke_run_writes_the_documented_report(step_overhead, tmp_path):
  pytest.importorskip("matplotlib")
  returned = step_overhead.main(["--smoke", "--no-progress", "--out", str(tmp_path)])

  with open(tmp_path / "step_overhead.json") as f:
    report = json.load(f)
  assert (tmp_path / "step_overhead.png").stat().st_size > 0
  assert set(step_overhead.TOP_KEYS) <= set(report)
  assert report["results"] == json.loads(json.dumps(returned["results"]))

  meta = report["meta"]
  assert {"command", "argv", "date", "machine"} <= set(meta)
  assert "jax" in meta["machine"] and "cpu_count" in meta["machine"]
  assert report["config"]["smoke"] is True and report["config"]["complete"] is True

  assert report["results"], "no measurement was made"
  for record in report["results"]:
    assert set(step_overhead.RESULT_KEYS) <= set(record)
    assert record["kind"] in step_overhead.KINDS
    assert record["method"] in step_overhead.METHODS
    for key in ("method_ms", "baseline_ms", "ratio"):
      assert math.isfinite(record[key]) and record[key] > 0
  assert {r["temperature"] > 0 for r in report["results"]} == {False, True}
  # The memory traffic of the c-CoLA-ud update: at least its 4 inputs and 3
  # outputs (weight, slack, momentum, gradient), more than SGD-m's.
  passes = [r["array_passes"] for r in report["results"] if r["kind"] == "update"]
  assert passes and all(p["method"] and p["baseline"] for p in passes)
  for p in passes:
    assert p["method"]["reads"] >= 4 and p["method"]["writes"] >= 3
    assert p["method"]["reads"] + p["method"]["writes"] > p["baseline"]["reads"] + p["baseline"]["writes"]

  # Every target the issue names is measured in smoke mode too.
  assert len(report["targets"]) == 4
  for target in report["targets"]:
    assert {"name", "value", "limit", "met"} <= set(target)
    assert target["value"] is not None and target["met"] in (True, False)

  bound = report["projection_floor"]
  assert bound["layers"] >= 1 and bound["ratio_bound"] > 1
  for key in ("products_ms", "sgd_step_ms"):
    assert math.isfinite(bound[key]) and bound[key] > 0

  # State sizes: c-CoLA-ud keeps a slack and a momentum per constrained
  # weight, SGD-m one momentum per parameter.
  sizes = report["state_bytes"]["mlp784"]["c_cola_ud"]
  assert sizes["baseline"] == sizes["params"]
  assert sizes["params"] < sizes["method"] < 2 * sizes["params"] + 64


def test_help_lists_the_options(step_overhead, capsys):
  with pytest.raises(SystemExit) as exit_info:
    step_overhead.parse_args(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for option in ("--smoke", "--out", "--skip-heavy"):
    assert option in out


@pytest.mark.slow  # a long run: the quick suite keeps within its time
def test_an_interrupted_run_keeps_what_it_measured(step_overhead, tmp_path, monkeypatch):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(step_overhead, "projection_floor", interrupted)
  with pytest.raises(KeyboardInterrupt):
    step_overhead.main(["--smoke", "--no-progress", "--out", str(tmp_path)])

  with open(tmp_path / "step_overhead.json") as f:
    report = json.load(f)
  assert report["config"]["complete"] is False
  assert len(report["results"]) == len(step_overhead.SMOKE_JOBS)
  assert report["projection_floor"] is None
