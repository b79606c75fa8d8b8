"""benchmarks/comparisons/lipschitz.py (issue 49): its --smoke run, the 1-Lipschitz certificate of an MLP trained in
the spectral-norm ball, the kernels it certifies Flax's SpectralNorm by, and the guide that quotes the committed run.

Tolerances. The certificate is a theorem: a ReLU MLP is ``L``-Lipschitz with ``L`` the product of its kernels' exact
spectral norms, so the Jacobians and pairs of the float32 weights, computed in float64 (``k`` operations of
``2**-53``), stay within ``L (1 + k u64)``. That ``L <= 1 + 1e-4`` is issue 49's criterion for the ball held to
float32 rounding at every step (each step's bound is tests/test_spectral.py's; the 1e-4 leaves room for the
``(rows + 2) u`` rounding of a 784-row Gram matrix in it).
"""

import json
import math
import pathlib

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.harness import data, records, report

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lipschitz(load_benchmark):
  return load_benchmark("comparisons.lipschitz")


@pytest.fixture(scope="module")
def mlp(load_benchmark):
  return load_benchmark("comparisons.lipschitz_model")


def _layers(params, n):
  return [
    (np.asarray(params[f"layer{i}"]["kernel"], np.float64), np.asarray(params[f"layer{i}"]["bias"], np.float64))
    for i in range(n)
  ]


def _forward64(layers, x, absolute=False):
  """The MLP in float64 (ReLU between layers); with ``absolute``, on ``|x|`` and ``|W|``, no biases: the scale of
  the float32 forward pass's rounding error."""
  x = np.abs(x) if absolute else x
  for i, (w, b) in enumerate(layers):
    if i:
      x = x if absolute else np.maximum(x, 0)
    x = x @ np.abs(w) if absolute else x @ w + b
  return x


def _jacobian64(layers, x):
  """``d f / d x`` (outputs, inputs) of the float64 MLP at the row ``x``."""
  jac, z = np.eye(len(x)), x
  for i, (w, b) in enumerate(layers):
    if i:
      active = (z > 0).astype(np.float64)
      jac, z = jac * active, np.maximum(z, 0)
    jac, z = jac @ w, z @ w + b
  return jac.T


def test_smoke_run_writes_the_comparison(lipschitz, tmp_path):
  pytest.importorskip("matplotlib")
  returned = lipschitz.main(["--smoke", "--quiet", "--out", str(tmp_path)])
  out = json.loads((tmp_path / "lipschitz.json").read_text())
  assert out == json.loads(json.dumps(returned))
  assert (tmp_path / "lipschitz.png").stat().st_size > 0
  assert {"command", "date", "machine", "versions", "wall_time_s"} <= set(out["meta"])
  assert {"processor", "cpu_model"} <= set(out["meta"]["machine"])
  assert out["status"] == "complete" and out["data"]["synthetic"] is True and out["seeds"] == [0, 1]
  assert list(out["results"]) == list(lipschitz.METHODS) and list(out["costs"]) == list(lipschitz.METHODS[1:])
  radii = [f"{r:g}" for r in out["config"]["radii"]]
  for name, r in out["results"].items():
    for seed in range(2):
      certified = [r["certified_accuracy"][e][seed] for e in radii]
      # the certified sets shrink as the radius grows, inside the correctly classified set
      assert r["test_accuracy"][seed] >= certified[0] and certified == sorted(certified, reverse=True), name
      assert r["lipschitz_bound"][seed] == pytest.approx(math.prod(r["layer_norms"][seed]), rel=1e-12)
      # the empirical constants are lower bounds of L; the float32 Jacobian and logits round by at most
      # (784 + widths) u of the product of the layers' Frobenius norms, at most sqrt(rank) times the spectral ones
      widths = [784, *out["config"]["widths"]]
      rank = math.prod(min(a, b) for a, b in zip(widths, widths[1:]))
      slack = 1 + rounding.roundings(sum(widths)) * math.sqrt(rank)
      for key in ("empirical_lipschitz_jacobian", "empirical_lipschitz_pairs"):
        assert r[key][seed] <= r["lipschitz_bound"][seed] * slack, (name, key)
  for name in ("constrained_adam", "cola_ud"):
    # every layer of the constrained methods in the ball (to the 1e-4 of issue 49: the derivation is below)
    assert max(out["results"][name]["max_layer_norm"]) <= 1 + 1e-4
  for ratios in (c["ratios"] for c in out["costs"].values()):
    assert set(ratios) == {"step", "compile_wall", "compile_cpu"}
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())


@pytest.mark.parametrize("method", ["constrained_adam", "cola_ud"])
def test_a_trained_mlp_in_the_ball_is_1_lipschitz(lipschitz, mlp, method):
  """From kernels 10 times beyond the ball, with large steps: every Jacobian and every pair within 1 + tol."""
  widths = lipschitz.SMOKE["widths"]
  images = data.fashion_mnist(n_train=256, n_test=64, synthetic=True)
  x, y = jnp.asarray(images.x_train.reshape(256, -1)), jnp.asarray(images.y_train)
  variables = mlp.initial_variables(method, widths, 0, x[:1])
  params = jax.tree_util.tree_map_with_path(
    lambda path, a: 10 * a if path[-1].key == "kernel" else a, variables["params"]
  )
  tx = lipschitz.make_method(method, {"lr": 0.1, "h": 1.0, "friction": 1.0})
  step = jax.jit(mlp.training_step(mlp.model_of(method, widths), tx))
  stats, state = {}, tx.init(params)
  for i in range(30):
    batch = slice(32 * (i % 8), 32 * (i % 8 + 1))
    params, stats, state, _ = step(params, stats, state, x[batch], y[batch])

  layers = _layers(params, len(widths))
  lipschitz_bound = math.prod(np.linalg.svd(w, compute_uv=False)[0] for w, _ in layers)
  assert 0.9 < lipschitz_bound <= 1 + 1e-4  # pressed against the walls (the checks below are not vacuous), inside

  rng = np.random.default_rng(0)
  points = np.concatenate([images.x_test.reshape(64, -1), rng.uniform(-1, 2, (64, 784))]).astype(np.float64)
  bound = lipschitz_bound * (1 + (4 * sum(widths) + 784) * float(np.finfo(np.float64).eps) / 2)
  assert max(np.linalg.norm(_jacobian64(layers, p), ord=2) for p in points) <= bound
  for scale in (1.0, 1e-3):  # pairs far apart and close together
    a, b = points, points + scale * rng.standard_normal(points.shape)
    ratio = np.linalg.norm(_forward64(layers, a) - _forward64(layers, b), axis=1) / np.linalg.norm(a - b, axis=1)
    assert ratio.max() <= bound


def test_spectral_norm_is_certified_by_the_kernels_its_layers_use(lipschitz, mlp, load_benchmark):
  """Under Flax's SpectralNorm the sown kernels are what the layers use: the MLP built from them gives the model's
  output (to the float32 forward pass's rounding), and none is the parameter itself."""
  widths = lipschitz.SMOKE["widths"]
  images = data.fashion_mnist(n_train=64, n_test=64, synthetic=True)
  x, y = jnp.asarray(images.x_train), jnp.asarray(images.y_train)
  name = "flax_spectral_norm"
  model = mlp.model_of(name, widths)
  v = mlp.initial_variables(name, widths, 0, x[:1])
  tx = lipschitz.make_method(name, lipschitz.DEFAULTS)
  params, stats, _, _ = jax.jit(mlp.training_step(model, tx))(v["params"], v["batch_stats"], tx.init(v["params"]), x, y)
  variables = {"params": params, "batch_stats": stats}
  kernels = load_benchmark("comparisons.lipschitz_certificate").used_kernels(model, variables, x[:1])
  layers = [(k, np.asarray(params[f"layer{i}"]["bias"], np.float64)) for i, k in enumerate(kernels)]
  flat = np.asarray(x, np.float64).reshape(len(x), -1)
  scale = _forward64(layers, flat, absolute=True)
  error = np.abs(np.asarray(model.apply(variables, x), np.float64) - _forward64(layers, flat))
  assert np.all(error <= rounding.roundings(2 * (784 + sum(widths))) * scale + rounding.roundings(2) * np.abs(scale))
  for i, k in enumerate(kernels):
    w = np.asarray(params[f"layer{i}"]["kernel"], np.float64)
    ratio = k / w  # W / sigma_est: one factor for the whole kernel
    assert np.ptp(ratio) <= rounding.roundings(4) * np.abs(ratio).max() and abs(ratio.flat[0] - 1) > 1e-3


def test_the_guide_quotes_the_committed_run(lipschitz):
  """docs/guides/lipschitz.md's numbers are those of results/comparisons/lipschitz.json."""
  page = " ".join((ROOT / "docs" / "guides" / "lipschitz.md").read_text().split())  # one space between words
  run = json.loads((ROOT / "results" / "comparisons" / "lipschitz.json").read_text())
  assert run["status"] == "complete" and run["config"]["hyperparameters"] == lipschitz.DEFAULTS
  assert run["config"]["widths"] == list(lipschitz.WIDTHS) and len(run["seeds"]) == 5
  defaults = lipschitz.cli_parser().parse_args([])
  for key in ("epochs", "batch", "radii", "jacobian_points", "pairs"):  # the committed run is the default protocol
    assert run["config"][key] == getattr(defaults, key), key
  config = run["config"]
  quoted = [
    f"{config['epochs']} epochs of minibatches of {config['batch']}",
    f"first {config['jacobian_points']:,} test images",
    f"certified at {config['radii'][0]:.1f}",
    *(f"at {r:.1f}" for r in config["radii"][1:]),
  ]
  for r in run["results"].values():
    quoted.append(report.pm(r["test_accuracy"], 100, 1))
    quoted += [report.pm(v, 100, 1) for v in r["certified_accuracy"].values()]
    quoted += [report.pm(r[k]) for k in ("lipschitz_bound", "empirical_lipschitz_jacobian")]
  quoted += [f"{c['ratios'][k]:.2f}x" for c in run["costs"].values() for k in ("step", "compile_cpu")]
  results = run["results"]
  clean = {name: records.mean_std(r["test_accuracy"])[0] for name, r in results.items()}
  quoted += [f"{100 * (clean['adam'] - clean[name]):.1f} points" for name in ("constrained_adam", "cola_ud")]
  ball = max(max(results[name]["max_layer_norm"]) for name in ("constrained_adam", "cola_ud"))
  spectral_norm = results["flax_spectral_norm"]["empirical_lipschitz_jacobian"]
  quoted += [
    f"1 + {ball - 1:.1e}",
    f"{sum(j > 1 for j in spectral_norm)} of the 5 seeds (up to {max(spectral_norm):.3f})",
    f"{run['meta']['wall_time_s']:.0f} s",
    f"load average {run['meta']['machine']['loadavg_at_start'][0]:.0f}",
  ]
  assert [q for q in quoted if q not in page] == []
