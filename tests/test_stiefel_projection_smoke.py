"""The Stiefel projection benchmark: its --smoke report, and the methods' mathematics.

Timings are the benchmark's business; here only the report's structure and
properties of the projections at n = 64 in float32 are checked.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cola_jax.constraints import stiefel_projection as sp

pytestmark = pytest.mark.integration

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def bench(load_benchmark):
  return load_benchmark("cost.stiefel_projection")


@pytest.fixture(scope="module")
def problem(bench):
  """A 64 x 64 point and an o-CoLA-od step with h = 0.1 (rho ~ 0.1)."""
  kq, kd = jax.random.split(jax.random.key(3))
  q_n = bench.random_orthonormal(kq, 64, 64)
  return q_n, q_n + bench.make_step(kd, q_n, 0.1, 2.5e-4, 0.07)


@pytest.fixture(scope="module")
def projected(bench, problem):
  return {m: jax.jit(bench.method_fn(m, TOLERANCE, 100))(*problem) for m in bench.METHODS}


@pytest.mark.slow  # a timing run: the projections themselves are checked below
def test_smoke_run_writes_the_documented_report(bench, tmp_path):
  pytest.importorskip("matplotlib")
  returned = bench.main(["--smoke", "--out", str(tmp_path)])
  with open(tmp_path / "stiefel_projection.json") as f:
    report = json.load(f)
  assert (tmp_path / "stiefel_projection.png").stat().st_size > 0
  assert set(bench.TOP_KEYS) <= set(report)
  assert report["results"] == json.loads(json.dumps(returned["results"]))
  assert {"command", "argv", "date", "machine"} <= set(report["meta"])
  assert "jax" in report["meta"]["machine"] and report["config"]["smoke"] is True

  assert {r["method"] for r in report["results"]} == set(bench.METHODS)
  assert {r["kind"] for r in report["results"]} == {"em", "tangent", "normal"}
  for record in report["results"]:
    assert set(bench.RESULT_KEYS) <= set(record)
    assert math.isfinite(record["ms"]) and record["ms"] > 0
    assert record["converged"] and record["defect"] <= TOLERANCE
  for floor in report["floors"]:
    assert 0 < floor["floor"] < TOLERANCE
  for record in report["batching"]:  # vmapped projection equals the per-layer loop
    assert record["converged"] and record["ratio"] > 0
    assert record["max_difference"] <= 1e-6
  assert report["targets"] == []  # no 512 x 512 case in smoke mode

  # The ambient QR step differs from the paper's point at first order, the
  # nearest point at second order.
  orders = {r["method"]: r["order"] for r in report["results"] if r["kind"] == "em"}
  assert orders["qr_ambient"] == pytest.approx(1.0, abs=0.2)
  assert orders["polar"] > 1.7


def test_help_lists_the_options(bench, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.parse_args(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for option in ("--smoke", "--out", "--tolerance"):
    assert option in out


def test_every_method_meets_the_tolerance(projected):
  for name, (q, _, converged) in projected.items():
    assert bool(converged), name
    assert float(sp.defect(q)) <= TOLERANCE, name


def test_multiplier_methods_reach_the_paper_point(projected, problem):
  q_n, q_bar = problem
  reference = projected["quasi_newton"][0]
  step = float(jnp.linalg.norm(q_bar - q_n))
  for name in ("newton_multiplier", "square_root"):
    q = projected[name][0]
    assert float(jnp.linalg.norm(q - reference)) <= 2 * TOLERANCE, name
    # Same force direction: Q = Q_bar - Q_n Lambda with Lambda symmetric
    # (to the rounding of the float32 product).
    multiplier = np.asarray(q_n.T @ (q_bar - q), np.float64)
    skew = np.linalg.norm(multiplier - multiplier.T)
    assert skew <= 1e-3 * np.linalg.norm(multiplier), name
  # The other methods are different points, well above the tolerance.
  assert float(jnp.linalg.norm(projected["polar"][0] - reference)) > 1e-3 * step


def test_newton_multiplier_converges_quadratically(projected):
  _, iterations, converged = projected["newton_multiplier"]
  assert bool(converged) and int(iterations) <= 4


def test_polar_is_the_nearest_point(projected, problem):
  _, q_bar = problem
  distance = {m: float(jnp.linalg.norm(q - q_bar)) for m, (q, _, _) in projected.items()}
  for name, value in distance.items():
    assert distance["polar"] <= value * (1 + 1e-6), name
