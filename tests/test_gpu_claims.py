"""benchmarks/paper/gpu_claims.py, the GPU run against a deadline, rehearsed on a CPU.

Quick: the paired verdicts, the join of runs that split the seeds, what the committed results leave
to run, and a unit stopped at its deadline. Slow: the whole run at ``--smoke`` size, merged, and a
second run that finds nothing left to do.
"""

import json
import os

import numpy as np
import pytest
from scipy import stats

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gc(load_benchmark):
  return load_benchmark("paper.gpu_claims")


@pytest.fixture(scope="module")
def report(load_benchmark):
  return load_benchmark("paper.gpu_claims_report")


def test_paired_verdicts_follow_the_t_interval_of_the_seed_differences(report):
  out = report.paired([0.93, 0.94, 0.95, 0.94, 0.96], [0.92, 0.92, 0.92, 0.90, 0.91], "higher")
  d = np.array([0.01, 0.02, 0.03, 0.04, 0.05])
  half = stats.t.ppf(0.975, 4) * d.std(ddof=1) / np.sqrt(5)
  np.testing.assert_allclose(out["differences"], d, atol=1e-12)
  np.testing.assert_allclose(out["difference_ci95"], [d.mean() - half, d.mean() + half], rtol=1e-9)
  assert out["verdict"] == "holds beyond the seed spread" and out["seeds_favouring_claim"] == 5
  # lower is better: a claimed method with the higher losses is reversed
  assert report.paired([3.6, 3.7, 3.65], [3.5, 3.55, 3.52], "lower")["verdict"] == "reversed"
  assert report.paired([3.50, 3.56, 3.49], [3.52, 3.52, 3.52], "lower")["verdict"] == "within the seed spread"
  assert report.paired([3.5], [3.6], "lower")["verdict"].startswith("one seed")


def test_a_stopped_run_is_compared_over_the_epochs_both_methods_reached(report):
  entry = {"history": {"epoch": [0, 1, 2, 3], "valid_loss": [[9, 9], [4, 5], [3, 4], [2, None]]}}
  assert report.per_seed(entry, "min_valid_loss", 2) == [3, 4]
  assert report.per_seed(entry, "min_valid_loss", 3)[0] == 2
  accuracy = {"history": {"epoch": [1, 2], "test_accuracy": [[0.5, 0.6], [0.7, 0.8]]}}
  assert report.per_seed(accuracy, "test_accuracy", 1) == [0.5, 0.6]
  assert report.per_seed(accuracy, "test_accuracy", 2) == [0.7, 0.8]


def part(seeds, values, epochs=(1, 2), config_extra=None):
  n = len(seeds)
  return {
    "status": "complete",
    "config": {"epochs": 2, "seeds": n, "epochs_completed": 2, **(config_extra or {})},
    "data": {"source": "x"},
    "seeds": list(seeds),
    "results": {
      "a": {
        "test_accuracy": list(values),
        "history": {"epoch": list(epochs), "test_accuracy": [list(values) for _ in epochs]},
        "defects": {"conv1": [v / 10 for v in values]},
        "time_per_epoch_s": float(n),
      }
    },
    "command": f"run {seeds}",
    "argv": [],
    "date": "2026-11-27",
    "machine": {},
    "versions": {},
    "wall_time_s": 10.0,
  }


def test_join_seeds_concatenates_per_seed_values_in_seed_order(load_benchmark):
  records = load_benchmark("harness.records")
  joined = records.join_seeds([part([2, 3], [0.3, 0.4]), part([0], [0.1])])
  a = joined["results"]["a"]
  assert joined["seeds"] == [0, 2, 3] and joined["config"]["seeds"] == 3
  assert a["test_accuracy"] == [0.1, 0.3, 0.4]
  assert a["history"]["test_accuracy"] == [[0.1, 0.3, 0.4]] * 2
  assert a["defects"]["conv1"] == pytest.approx([0.01, 0.03, 0.04])
  assert a["time_per_epoch_s"] == pytest.approx((1 * 1 + 2 * 2) / 3)  # weighted by each run's seeds
  with pytest.raises(ValueError, match="a seed is in more than one run"):
    records.join_seeds([part([0], [0.1]), part([0, 1], [0.1, 0.2])])
  with pytest.raises(ValueError, match="differ in more than their seeds: constraints"):
    records.join_seeds([part([0], [0.1]), part([1], [0.2], config_extra={"constraints": "new"})])
  with pytest.raises(ValueError, match="different epochs"):
    records.join_seeds([part([0], [0.1]), part([1], [0.2], epochs=(1, 3))])


def write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f)


def test_the_plan_leaves_out_what_is_committed(gc, tmp_path):
  args = gc.parse_args(["--results", str(tmp_path), "--out", str(tmp_path / "run")])
  assert [u.part for u in gc.plan(args)] == ["transformer"] * 2 + ["resnet18"] * 5 + ["scale"] * 7 + [
    "retractions",
    "stiefel_projection",
  ]
  lm = {
    "status": "complete",
    "config": {"epochs": 200},
    "seeds": [0, 4],
    "results": {"ccola_ud": {}, "sgdm_h0.1_m0.8": {}},
  }
  write(str(tmp_path / "paper" / "transformer_lm.json"), lm)
  lm_units = [u for u in gc.plan(args) if u.part == "transformer"]
  assert [u.name for u in lm_units] == ["ccola_ud_seeds1-3", "sgdm_h0.1_m0.8_seeds1-3"]  # the seeds not committed
  assert lm_units[0].args[lm_units[0].args.index("--first-seed") + 1] == "1"
  grouped = gc.parse_args(["--results", str(tmp_path), "--seed-groups", "0,1-2,3"])
  assert [u.name for u in gc.plan(grouped) if u.part == "transformer"][:2] == ["ccola_ud_seeds1-2", "ccola_ud_seeds3-3"]
  lm = {"status": "complete", "config": {"epochs": 200}, "seeds": list(range(5)), "results": {"ccola_ud": {}}}
  write(str(tmp_path / "paper" / "transformer_lm.json"), lm)
  cnn_config = {**gc.RESNET, "constraints": repr(gc.orthogonal_cnn.ORTHOGONAL)}
  write(
    str(tmp_path / "paper" / "orthogonal_cnn_resnet18.json"),
    {"status": "complete", "config": cnn_config, "seeds": [0, 1]},
  )
  rows = [{"family": "box", "dynamics": d, "temperature": t} for d in ("od", "ud") for t in (0.0, 1e-6)]
  write(
    str(tmp_path / "cost" / "scale.json"),
    {"results": rows[:3] + [{"family": "circle", "dynamics": "od", "temperature": 1e-6}, rows[3]]},
  )
  units = gc.plan(args)
  assert [u.name for u in units if u.part == "transformer"] == ["sgdm_h0.1_m0.8_seeds0-4"]
  assert [u.name for u in units if u.part == "resnet18"] == ["seed2", "seed3", "seed4"]
  assert "box" not in [u.name for u in units if u.part == "scale"] and "circle" in [u.name for u in units]
  # seeds of another protocol or of older constraints are run again
  write(
    str(tmp_path / "paper" / "orthogonal_cnn_resnet18.json"),
    {"status": "complete", "config": {**cnn_config, "constraints": "old"}, "seeds": [0]},
  )
  assert [u.name for u in gc.plan(args) if u.part == "resnet18"] == [f"seed{s}" for s in range(5)]


def test_a_unit_running_at_the_deadline_is_stopped_and_later_ones_are_not_started(gc, tmp_path):
  args = gc.parse_args(
    [
      "--smoke",
      "--deadline",
      "4",
      "--parts",
      "transformer,resnet18",
      "--seeds",
      "1",
      "--results",
      str(tmp_path / "none"),
      "--out",
      str(tmp_path / "run"),
    ]
  )
  units = gc.run(args, [])
  assert [u.status for u in units[:2]] == ["stopped at the deadline"] * 2  # a smoke unit takes 20 s or more
  assert all(4 <= u.wall_s < 4 + gc.STOP_GRACE_S + 5 for u in units[:2])
  assert units[2].part == "resnet18" and units[2].status.startswith("not started")
  plan = json.loads((tmp_path / "run" / "gpu_claims.json").read_text())
  assert [u["status"] for u in plan["units"]] == [u.status for u in units]
  assert "--methods ccola_ud" in plan["units"][0]["command"]


@pytest.mark.slow
def test_the_smoke_run_merges_into_a_comparison_and_a_second_run_has_nothing_left(gc, tmp_path):
  results, run_dir = tmp_path / "results", tmp_path / "run"
  args = ["--smoke", "--seeds", "2", "--results", str(results), "--parts", "transformer,resnet18,retractions"]
  units = gc.main([*args, "--deadline", "900", "--out", str(run_dir)])
  assert [u.status for u in units] == ["complete"] * len(units)
  claims = gc.main(["--merge", str(run_dir), "--results", str(results)])
  assert set(claims) == {"transformer_lm", "resnet18_vs_sgdm", "resnet18_vs_sgdm_wd"}
  assert all(c["seeds"] == [0, 1] and c["n_seeds"] == 2 for c in claims.values())
  lm = json.loads((results / "paper" / "transformer_lm.json").read_text())
  for m, values in claims["transformer_lm"]["values"].items():  # from the curves: the runs' own minima
    np.testing.assert_allclose(values, lm["results"][m]["min_valid_loss"], rtol=1e-7)
  cnn = json.loads((results / "paper" / "orthogonal_cnn_resnet18.json").read_text())
  assert cnn["seeds"] == [0, 1] and len(cnn["joined_from"]) == 2
  assert (results / "paper" / "claims.png").exists() and (results / "cost" / "retractions.json").exists()
  assert gc.main([*args, "--deadline", "60", "--out", str(tmp_path / "again")]) == []
