"""Smoke test of benchmarks/comparisons/gpt.py (a GPT of the project's own, issue 48): its --smoke run (c-CoLA-ud
against Adam; the other methods' steps are the same code path), and the leaves each method's rules take on
the full-size model."""

import json
import math
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import cola_jax as cola
from benchmarks.harness import report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gpt(load_benchmark):
  return load_benchmark("comparisons.gpt")


def test_smoke_run_writes_losses_costs_and_residuals(gpt, tmp_path):
  pytest.importorskip("matplotlib")
  returned = gpt.main(["--smoke", "--quiet", "--out", str(tmp_path), "--methods", "c_cola_ud"])
  data = json.loads((tmp_path / "gpt.json").read_text())
  assert data == json.loads(json.dumps(returned))
  assert (tmp_path / "gpt.png").stat().st_size > 0
  assert {"command", "date", "machine", "versions", "wall_time_s"} <= set(data["meta"])
  assert data["status"] == "complete" and data["data"]["synthetic"] is True
  assert list(data["results"]) == ["adam", "c_cola_ud"] and data["seeds"] == [0, 1]
  for r in data["results"].values():
    assert r["history"]["step"] == [0, gpt.SMOKE["steps"]]
    assert all(math.isfinite(v) for v in r["final_valid_loss"] + r["final_train_loss"])
  assert data["results"]["adam"]["residual"] is None
  assert max(data["results"]["c_cola_ud"]["residual"]) < 1e-5
  ratios = data["costs"]["c_cola_ud"]["ratios"]
  assert set(ratios) == {"step", "compile_wall", "compile_cpu", "memory"}
  assert all(math.isfinite(v) and v > 0 for v in ratios.values())


def test_the_rules_take_the_leaves_they_name(gpt):
  model = gpt.FunctionalGPT(vocab=10, length=8)  # the compared size: 4 blocks, width 128, 4 heads
  params = jax.jit(lambda key: model.init({"params": key}, None)["params"])(jax.random.key(0))
  leaves = {name: gpt.constrained_leaves(name, gpt.DEFAULTS, params) for name in gpt.METHODS}
  attention = [f"blocks/{i}/attention/{p}/kernel" for i in range(4) for p in ("key", "out", "query", "value")]
  mlp = [f"blocks/{i}/{p}/kernel" for i in range(4) for p in ("down", "up")]
  assert leaves["adam"] == []
  assert sorted(leaves["orthogonal"]) == sorted(attention)
  assert sorted(leaves["c_cola_ud"]) == sorted([*attention, *mlp, "head/kernel"])
  assert sorted(leaves["unit_norm"]) == sorted(
    [*attention, *mlp, "head/kernel", "embed/embedding", "position_embed/embedding"]
  )
  with warnings.catch_warnings(record=True):  # the default rule names what it takes
    warnings.simplefilter("always")
    default = cola.c_cola_ud(0.5, friction=1.0, radius=0.2)
    residuals = cola.constraint_residuals(params, default.init(params))
  assert jax.tree.map(lambda r: r is not None, residuals, is_leaf=lambda r: r is None) == gpt.kernels(params)

  heads = cola.project_params(params, cola.path_constraints(gpt.PER_HEAD))["blocks"][0]["attention"]
  eye = jnp.eye(32)
  for h in range(4):
    query, out = heads["query"]["kernel"][:, h], heads["out"]["kernel"][h]  # (128, 32) and (32, 128)
    assert float(jnp.abs(query.T @ query - eye).max()) < 1e-5
    assert float(jnp.abs(out @ out.T - eye).max()) < 1e-5


def test_the_choosing_page_quotes_the_committed_runs(gpt):
  """docs/choosing.md's transformer numbers are those of results/comparisons/gpt.json and gpt_sweep.json."""
  root = pathlib.Path(__file__).resolve().parents[1]
  page = (root / "docs" / "choosing.md").read_text().replace("\n", " ")
  run = json.loads((root / "results" / "comparisons" / "gpt.json").read_text())
  sweep = json.loads((root / "results" / "comparisons" / "gpt_sweep.json").read_text())
  assert run["config"]["hyperparameters"] == {**gpt.DEFAULTS} and sweep["chosen"] == {
    k: gpt.DEFAULTS[k] for k in ("adam_lr", "h", "friction")
  }
  quoted = [f"{v:.3f}" for v in sweep["final_valid_loss"].values()]
  quoted += [report.pm(r["final_valid_loss"]) for r in run["results"].values()]
  quoted += [f"{c['ratios'][k]:.2f}x" for c in run["costs"].values() for k in ("step", "compile_cpu", "memory")]
  quoted += [
    f"{max(max(r['residual']) for r in run['results'].values() if r['residual']):.1e}",
    f"{run['meta']['wall_time_s']:.0f} s",
  ]
  assert [q for q in quoted if q not in page] == []
