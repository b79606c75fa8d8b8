"""The retraction benchmark runs end to end in --smoke mode: every retraction measured, on the manifold.

Only what the reports hold is checked: timings are the benchmark's business, never a test's.
"""

import json

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.slow  # about a minute of compiles: the quick suite keeps within its time
def test_smoke_run_writes_both_reports(load_benchmark, tmp_path):
  retractions = load_benchmark("cost.retractions")
  retractions.main(["--smoke", "--out", str(tmp_path)])
  with open(tmp_path / "retractions.json") as f:
    alone = json.load(f)
  with open(tmp_path / "seq2seq.json") as f:
    seq2seq = json.load(f)
  assert alone["results"] and {"command", "machine", "versions"} <= set(alone["meta"])
  assert seq2seq["config"]["smoke"] is True and seq2seq["targets"]
  residuals = seq2seq["residual_after_steps"]
  assert set(residuals) == {"newton_schulz", "qr", "polar"}
  assert all(0 <= residual < 1e-5 for residual in residuals.values())
