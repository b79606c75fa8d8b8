"""The cost-at-scale benchmark runs end to end in --smoke mode and writes its documented report.

Only the structure and the byte counts are checked: timings are the
benchmark's business, never a test's.
"""

import json
import math

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def scale(load_benchmark):
  return load_benchmark("cost.scale")


@pytest.fixture(scope="module")
def scale_report(load_benchmark):
  return load_benchmark("cost.scale_report")


# Two families (od and ud, with and without noise) and every family, both under slow: the quick suite
# keeps within its time; the usage check below stays quick.
@pytest.mark.parametrize(
  "families",
  [
    pytest.param(("circle", "box"), id="two", marks=pytest.mark.slow),
    pytest.param(None, id="all", marks=pytest.mark.slow),
  ],
)
def test_smoke_run_writes_the_documented_report(scale, scale_report, tmp_path, families):
  pytest.importorskip("matplotlib")
  returned = scale.main(
    ["--smoke", "--quiet", "--out", str(tmp_path), *(["--families", *families] if families else [])]
  )
  families = families or scale.FAMILIES

  with open(tmp_path / "scale.json") as f:
    report = json.load(f)
  assert (tmp_path / "scale.png").stat().st_size > 0
  assert set(scale_report.TOP_KEYS) <= set(report)
  assert report["results"] == json.loads(json.dumps(returned["results"]))
  assert {"command", "argv", "date", "machine", "versions"} <= set(report["meta"])
  assert report["config"]["smoke"] is True

  results = {r["name"]: r for r in report["results"]}
  assert set(scale.BASELINES) <= set(results)
  # Every constraint family is measured with noise, and od and ud both appear.
  noisy = [r for r in report["results"] if r["temperature"] > 0]
  assert {r["family"] for r in noisy} == set(families)
  assert {r["dynamics"] for r in noisy} == set(scale.DYNAMICS)
  for record in report["results"]:
    assert set(scale_report.RESULT_KEYS) <= set(record)
    for size in ("small", "large"):
      for key in scale_report.BATCH_KEYS:
        assert math.isfinite(record[size][key]) and record[size][key] >= 0, (record["name"], size, key)

  # State bytes follow from the methods: SGD-m keeps one momentum per parameter, Adam two.
  params = report["params_bytes"]
  assert results["sgd_m"]["state_bytes"] == params
  assert params < results["adam"]["state_bytes"] - params <= params + 64
  # An overdamped transform keeps no momentum: its state is the constraints' slacks and a key.
  assert results["od_circle_noisy"]["state_bytes"] < params

  names = {t["name"] for t in report["targets"]}
  assert len(names) == len(report["targets"])
  assert all(t["met"] in (True, False) and math.isfinite(t["value"]) for t in report["targets"])
  assert sum("compile" in name for name in names) == len(noisy)


def test_bad_batch_is_a_usage_error(scale, capsys):
  with pytest.raises(SystemExit) as exit_info:
    scale.parse_args(["--large", "8by128"])
  assert exit_info.value.code == 2
  assert "--large must be BATCHxLENGTH" in capsys.readouterr().err


def _scale_part(path, rows, sgd_compile_cpu_s, complete=True, depth=12):
  """A scale.json as a run that measured ``rows`` (name, family, dynamics, temperature, compile CPU s) writes it."""

  def record(name, family, dynamics, temperature, compile_cpu_s):
    batch = {"compile_s": 1.0, "compile_cpu_s": compile_cpu_s, "temp_bytes": 10**6, "method_ms": 2.0}
    batch.update(baseline_ms=2.0, ratio=1.0)
    return dict(name=name, family=family, dynamics=dynamics, temperature=temperature, state_bytes=10**6, small=batch)

  results = [record("sgd_m", None, None, 0.0, sgd_compile_cpu_s), record("adam", None, None, 0.0, 1.0)]
  results += [record(*row) for row in rows]
  for r in results:
    r["large"] = dict(r["small"])
  meta = {"command": f"scale.py {path}", "argv": [], "date": "d", "machine": {"backend": "gpu"}, "wall_time_s": 1.0}
  config = {"model": {"depth": depth}, "families": sorted({r[1] for r in rows}), "complete": complete}
  path.write_text(json.dumps({"meta": meta, "config": config, "params_bytes": 10**6, "results": results}))
  return str(path)


def test_merge_joins_runs_that_split_the_families_each_against_its_own_sgd_m(scale, tmp_path):
  pytest.importorskip("matplotlib")
  a = _scale_part(tmp_path / "a.json", [("od_circle_noisy", "circle", "od", 1e-6, 6.0)], sgd_compile_cpu_s=2.0)
  b = _scale_part(
    tmp_path / "b.json",
    [("ud_sphere", "sphere", "ud", 0.0, 9.0), ("od_sphere_noisy", "sphere", "od", 1e-6, 9.0)],
    sgd_compile_cpu_s=3.0,
    complete=False,
  )
  merged = scale.main(["--merge", a, b, "--out", str(tmp_path / "merged")])

  with open(tmp_path / "merged" / "scale.json") as f:
    assert json.load(f) == json.loads(json.dumps(merged))
  assert [r["name"] for r in merged["results"]] == ["sgd_m", "adam", "od_circle_noisy", "od_sphere_noisy", "ud_sphere"]
  assert merged["results"][0]["small"]["compile_cpu_s"] == 2.0  # the first run's optax rows
  compile_targets = {t["name"].split()[0]: t["value"] for t in merged["targets"] if "compile" in t["name"]}
  assert compile_targets == {"od_circle_noisy": 3.0, "od_sphere_noisy": 3.0}  # 6 / 2 and 9 / 3
  assert merged["config"]["families"] == ["circle", "sphere"] and merged["config"]["complete"] is False
  assert [run["command"] for run in merged["merged_from"]] == [f"scale.py {a}", f"scale.py {b}"]
  assert merged["meta"]["machine"] == {"backend": "gpu"} and merged["meta"]["wall_time_s"] == 2.0

  with pytest.raises(SystemExit, match="repeats od_circle_noisy"):
    scale.main(["--merge", a, a, "--out", str(tmp_path / "twice")])
  other = _scale_part(tmp_path / "c.json", [("ud_box", "box", "ud", 0.0, 1.0)], sgd_compile_cpu_s=1.0, depth=24)
  with pytest.raises(SystemExit, match="ran another protocol"):
    scale.main(["--merge", a, other, "--out", str(tmp_path / "other")])


def test_update_memory_counts_the_kernels_that_compile_time_follows(load_benchmark, tmp_path):
  update_memory = load_benchmark("cost.update_memory")
  update_memory.main(
    ["--smoke", "--setting", "leaves", "--families", "circle", "orthogonal", "--dynamics", "od", "--out", str(tmp_path)]
  )

  with open(tmp_path / "update_memory.json") as f:
    results = {r["name"]: r for r in json.load(f)["results"]}
  assert set(update_memory.RESULT_KEYS) <= set(results["od_orthogonal"])
  # SGD-m's update is one loop-free pass per leaf; the orthogonal projection iterates per leaf.
  assert results["sgd_m"]["while_loops"] == 0
  assert results["od_orthogonal"]["while_loops"] >= 2  # one per leaf at least (2 leaves)
  assert 0 < results["sgd_m"]["fusions"] < results["od_circle"]["fusions"] < results["od_orthogonal"]["fusions"]


@pytest.mark.slow
def test_compile_cache_smoke_run_loads_each_step_in_the_second_process(load_benchmark, tmp_path):
  bench = load_benchmark("cost.compile_cache")
  returned = bench.main(["--smoke", "--families", "circle", "--dynamics", "od", "--out", str(tmp_path)])

  with open(tmp_path / "compile_cache.json") as f:
    report = json.load(f)
  assert report["results"] == json.loads(json.dumps(returned["results"]))
  assert {"command", "argv", "date", "machine", "versions"} <= set(report["meta"])
  assert [r["name"] for r in report["results"]] == ["sgd_m", "adam", "od_circle_noisy"]
  for record in report["results"]:
    assert record["miss"]["cache_events"] == ["/jax/compilation_cache/cache_misses"], record["name"]
    assert record["hit"]["cache_events"] == ["/jax/compilation_cache/cache_hits"], record["name"]
    assert record["miss"]["seed"] != record["hit"]["seed"]
    assert record["miss"]["compile_cpu_s"] > 0 and record["hit"]["compile_cpu_s"] > 0
