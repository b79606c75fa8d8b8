"""Smoke test of benchmarks/paper/bayesian_fashion_mnist.py, the Bayesian Fashion-MNIST experiment (issue 58).

Runs without the Debian package ``dataset-fashion-mnist``: ``--smoke`` falls back to a synthetic
stand-in of the same shapes when the IDX files are missing.
"""

import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("blackjax")


@pytest.fixture(scope="module")
def bfm(load_benchmark):
  return load_benchmark("paper.bayesian_fashion_mnist")


@pytest.fixture(scope="module")
def smoke_run(bfm, tmp_path_factory):
  out = tmp_path_factory.mktemp("bayesian_fashion_mnist")
  returned = bfm.main(["--smoke", "--out", str(out), "--quiet"])
  return out, returned


def test_json_and_png(bfm, smoke_run):
  out, returned = smoke_run
  data = json.loads((out / "bayesian_fashion_mnist.json").read_text())
  assert data == json.loads(json.dumps(returned))
  for key in ("config", "data", "results", "summary", "timing", "command", "date", "machine", "versions"):
    assert key in data, key
  assert data["versions"]["blackjax"] and data["wall_time_s"] > 0
  n_seeds = bfm.SMOKE["seeds"]
  samplers = [f"{m}_T{t:g}" for m in bfm.SAMPLERS for t in bfm.TEMPERATURES]
  assert list(data["results"]) == ["sgdm", "cola_ud", *samplers]
  for row, entry in data["results"].items():
    for key in ("accuracy", "nll", "ece", "sample_accuracy", "sample_nll"):
      assert len(entry[key]) == n_seeds and all(isinstance(v, float) and math.isfinite(v) for v in entry[key]), row
    assert all(0 <= a <= 1 and 0 <= e <= 1 for a, e in zip(entry["accuracy"], entry["ece"]))
    assert data["summary"][row]["nll_mean"] == pytest.approx(np.mean(entry["nll"]))
    # A point estimate is one sample: its predictive is its own prediction.
    if row in ("sgdm", "cola_ud"):
      assert entry["accuracy"] == pytest.approx(entry["sample_accuracy"])
      assert entry["nll"] == pytest.approx(entry["sample_nll"], rel=1e-5)
    else:
      # Averaging probabilities cannot do worse in NLL than the samples' mean (Jensen).
      assert all(n <= s + 1e-5 for n, s in zip(entry["nll"], entry["sample_nll"])), row
  # Every chain spent the same budget, blackjax's sghmc counted by its integration steps.
  for name, plan in data["config"]["schedules"].items():
    assert plan["gradient_evaluations"] == bfm.SMOKE["budget"], name
  assert data["config"]["schedules"]["sghmc"]["steps"] == bfm.SMOKE["budget"] // bfm.SGHMC_STEPS
  # The optimizers learned something in 200 steps (chance is 10 %).
  assert np.mean(data["results"]["sgdm"]["accuracy"]) > 0.5
  assert (out / "bayesian_fashion_mnist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_by_hand(bfm):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(500, 10)) * 3
  y = rng.integers(0, 10, 500)
  log_p = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
  got = bfm.posterior.classification_metrics(log_p, jnp.asarray(y))
  p = np.exp(np.asarray(log_p, np.float64))
  conf, pred = p.max(1), p.argmax(1)
  ece = 0.0
  for b in range(15):
    inside = (conf > b / 15) & (conf <= (b + 1) / 15)
    if inside.any():
      ece += inside.mean() * abs((pred[inside] == y[inside]).mean() - conf[inside].mean())
  assert float(got["ece"]) == pytest.approx(ece, abs=1e-5)
  assert float(got["accuracy"]) == pytest.approx((pred == y).mean())
  assert float(got["nll"]) == pytest.approx(-np.log(p[np.arange(500), y]).mean(), rel=1e-5)


def test_schedule_counts_gradients(bfm):
  plan = bfm.posterior.schedule(4000, 10, 0.5, 20)
  assert plan == {"burn_in_steps": 200, "thin": 10, "samples": 20, "steps": 400, "gradient_evaluations": 4000}
  assert bfm.posterior.schedule(4000, 1, 0.0, 1)["thin"] == 4000
  with pytest.raises(ValueError, match="no step between 20 samples"):
    bfm.posterior.schedule(30, 1, 0.5, 20)


def test_gradient_is_the_log_posterior(bfm):
  # blackjax's estimator on a minibatch: N times the mean log-likelihood's gradient plus the N(0, 1) prior's.
  params = bfm.MODEL.init(jax.random.key(0), jnp.zeros((1, 28, 28)))["params"]
  x = jax.random.uniform(jax.random.key(1), (8, 28, 28))
  y = jnp.arange(8) % 10
  mean_loglik = lambda p: jnp.mean(jnp.take_along_axis(bfm.log_probs(p, x), y[:, None], 1))
  expected = jax.tree.map(lambda g, p: 1000 * g - p, jax.grad(mean_loglik)(params), params)
  got = bfm.grad_estimator(1000)(params, (x, y))
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-4)


def test_smoke_defaults_to_a_new_temporary_folder(bfm, capsys):
  assert bfm.parse_args(["--smoke"]).out is None
  with pytest.raises(SystemExit) as exit_info:
    bfm.parse_args(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert all(flag in out for flag in ("--seeds", "--budget", "--tune", "--smoke", "--out"))
  with pytest.raises(SystemExit):
    bfm.parse_args(["--methods", "adam"])


def test_the_page_quotes_the_committed_run(bfm):
  """docs/reproductions.md quotes results/paper/bayesian_fashion_mnist.json row by row, with its versions."""
  root = pathlib.Path(__file__).resolve().parents[1]
  run = json.loads((root / "results" / "paper" / "bayesian_fashion_mnist.json").read_text())
  page = (root / "docs" / "reproductions.md").read_text()
  assert run["config"]["seeds"] == [0, 1, 2, 3, 4] and not run["data"]["synthetic"]
  for row, label in run["labels"].items():
    quoted = re.search(rf"^\| {re.escape(label)} \| (.*) \|$", page, flags=re.MULTILINE)
    assert quoted, label
    s = run["summary"][row]
    expected = [
      f"{100 * s['accuracy_mean']:.2f} +- {100 * s['accuracy_std']:.2f}",
      f"{s['nll_mean']:.3f} +- {s['nll_std']:.3f}",
      f"{100 * s['ece_mean']:.2f} +- {100 * s['ece_std']:.2f}",
      f"{100 * s['sample_accuracy_mean']:.2f} +- {100 * s['sample_accuracy_std']:.2f}",
    ]
    assert quoted.group(1).split(" | ") == expected, label
  for package in ("jax", "optax", "flax", "blackjax", "numpy"):
    assert f"{package} {run['versions'][package]}" in page, package
