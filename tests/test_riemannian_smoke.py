"""The Riemannian optimizer benchmark: its --smoke report, with or without geoopt."""

import json

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.slow  # a benchmark run; the optimizer's mathematics is tested in test_constrained.py
def test_smoke_run_writes_the_documented_report(load_benchmark, tmp_path):
  pytest.importorskip("matplotlib")
  bench = load_benchmark("comparisons.riemannian")
  report = bench.main(["--smoke", "--out", str(tmp_path)])
  assert json.loads((tmp_path / "riemannian.json").read_text()) == json.loads(json.dumps(report))
  assert (tmp_path / "riemannian.png").stat().st_size > 0
  names = set(bench.jax_optimizers())
  if report["geoopt_skipped"] is None:
    names |= {"geoopt RiemannianAdam", "geoopt RiemannianSGD, momentum 0.9"}
    assert {"torch", "geoopt"} <= set(report["meta"]["versions"])
  for problem in report["problems"].values():
    assert set(problem["best"]) == names
    assert problem["best"]["cola constrained(adam)"]["on_manifold_at_every_step"]
  small = report["problems"]["top-3 of 12"]["best"]
  assert small["cola constrained(sgd, momentum 0.9)"]["iterations_to_target"] is not None
  assert small["naive chain: scale_by_adam -> cola_od"]["iterations_to_target"] is None  # Adam fed the normal part
