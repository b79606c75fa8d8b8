r"""cola_jax.sampling's effective sample size and potential scale reduction: known answers, blackjax's layout, and
the formulas written here against blackjax.diagnostics' on the same fixed-key data (without blackjax installed,
the functions fall back to the former: the tests hide blackjax to reach them).

Known answers: M independent chains of N iid normal draws have ESS about M N and R-hat about 1; an AR(1) chain of
coefficient phi has integrated autocorrelation time (1 + phi) / (1 - phi); chains about different means have
R-hat well above 1.1.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cola_jax import sampling

pytest.importorskip("blackjax")


@pytest.fixture
def without_blackjax(monkeypatch):
  """``import blackjax`` raises ImportError, as where it is not installed."""
  monkeypatch.setitem(sys.modules, "blackjax", None)
  monkeypatch.setitem(sys.modules, "blackjax.diagnostics", None)


def ar1(key, phi, num_chains, num_samples, shift=0.0):
  """Stationary AR(1) chains x' = phi x + sqrt(1 - phi^2) R (unit variance), chain c about shift * c."""
  first, noise = jax.random.normal(key, (2, num_chains, num_samples))
  step = lambda x, r: (phi * x + jnp.sqrt(1 - phi**2) * r,) * 2
  _, xs = jax.lax.scan(step, first[:, 0], noise.T)
  return xs.T + shift * jnp.arange(num_chains)[:, None]


DATA = {  # fixed-key data: iid, correlated, many observables in trailing axes, chains stuck apart
  "iid": jax.random.normal(jax.random.key(0), (4, 1000)),
  "ar1": ar1(jax.random.key(1), 0.9, 4, 2000),
  "odd_length": ar1(jax.random.key(2), 0.5, 3, 501),
  "one_chain": ar1(jax.random.key(3), 0.7, 1, 1000),
  "shifted": ar1(jax.random.key(4), 0.5, 4, 500, shift=0.5),
  "trailing": jnp.moveaxis(ar1(jax.random.key(5), 0.3, 6, 400 * 3).reshape(6, 400, 3), 1, 1),
}


@pytest.mark.parametrize(
  "name",
  [
    n if n == "iid" else pytest.param(n, marks=pytest.mark.extended if n == "shifted" else pytest.mark.slow)
    for n in sorted(DATA)
  ],
)
def test_the_formulas_written_here_are_blackjax_diagnostics(name, monkeypatch):
  x = DATA[name]
  ess_blackjax = sampling.effective_sample_size(x)
  rhat_blackjax = sampling.potential_scale_reduction(x) if x.shape[0] > 1 else None
  monkeypatch.setitem(sys.modules, "blackjax", None)
  # Chains stuck apart: no autocorrelation pair turns negative, and blackjax's last term then reads the last pair
  # (an index past the end, clamped); here that term is 0. Their ESS of a few units differ in the third digit.
  rtol = 1e-2 if name == "shifted" else 1e-4
  np.testing.assert_allclose(sampling.effective_sample_size(x), ess_blackjax, rtol=rtol)
  if rhat_blackjax is not None:
    np.testing.assert_allclose(sampling.potential_scale_reduction(x), rhat_blackjax, rtol=1e-6)


@pytest.mark.extended  # quick: test_the_formulas_written_here_are_blackjax_diagnostics (its blackjax numbers)
def test_blackjax_is_what_is_called_when_installed():
  from blackjax import diagnostics

  x = DATA["ar1"]
  assert float(sampling.effective_sample_size(x)) == float(diagnostics.effective_sample_size(x, 0, 1))
  assert float(sampling.potential_scale_reduction(x)) == float(diagnostics.potential_scale_reduction(x, 0, 1))


@pytest.mark.usefixtures("without_blackjax")
def test_iid_chains_have_ess_about_their_size_and_rhat_about_one():
  x = DATA["iid"]
  assert float(sampling.effective_sample_size(x)) == pytest.approx(4000, rel=0.1)
  assert abs(float(sampling.potential_scale_reduction(x)) - 1) < 0.01


@pytest.mark.usefixtures("without_blackjax")
@pytest.mark.parametrize("phi", [0.5, 0.9])
def test_ar1_chains_have_the_ess_of_their_autocorrelation_time(phi):
  x = ar1(jax.random.key(6), phi, 8, 4000)
  expected = 8 * 4000 * (1 - phi) / (1 + phi)
  assert float(sampling.effective_sample_size(x)) == pytest.approx(expected, rel=0.1)


@pytest.mark.usefixtures("without_blackjax")
def test_chains_about_different_means_have_rhat_above_one_point_one():
  assert float(sampling.potential_scale_reduction(DATA["shifted"])) > 1.1
  assert abs(float(sampling.potential_scale_reduction(ar1(jax.random.key(4), 0.5, 4, 500))) - 1) < 0.02


@pytest.mark.usefixtures("without_blackjax")
def test_the_layout_is_blackjax_chain_axis_then_sample_axis_and_pytrees_get_one_per_leaf():
  x = DATA["trailing"]  # (chains, samples, 3 observables)
  ess = sampling.effective_sample_size(x)
  assert ess.shape == (3,)
  np.testing.assert_allclose(
    sampling.effective_sample_size(jnp.swapaxes(x, 0, 1), chain_axis=1, sample_axis=0), ess, rtol=1e-6
  )
  for k in range(3):
    np.testing.assert_allclose(ess[k], sampling.effective_sample_size(x[..., k]), rtol=1e-6)
  tree = sampling.potential_scale_reduction({"a": x, "b": DATA["shifted"]})
  assert tree["a"].shape == (3,) and float(tree["b"]) > 1.1


@pytest.mark.usefixtures("without_blackjax")
def test_a_stuck_chain_has_ess_zero_and_a_nan_draw_gives_nan():
  stuck = jnp.ones((2, 100))
  assert float(sampling.effective_sample_size(stuck)) == 0.0
  x = DATA["iid"].at[1, 7].set(jnp.nan)
  assert bool(jnp.isnan(sampling.effective_sample_size(x)))


@pytest.mark.parametrize("hidden", [False, True])
def test_too_few_chains_or_samples_are_named(hidden, monkeypatch):
  if hidden:
    monkeypatch.setitem(sys.modules, "blackjax", None)
  with pytest.raises(ValueError, match=r"potential_scale_reduction: needs at least 2 chains \(axis 0\)"):
    sampling.potential_scale_reduction(jnp.zeros((1, 10)))
  with pytest.raises(ValueError, match=r"effective_sample_size: needs at least 2 samples per chain \(axis 1\)"):
    sampling.effective_sample_size(jnp.zeros((3, 1)))
  with pytest.raises(ValueError, match="effective_sample_size: samples must have a chain axis and a sample axis"):
    sampling.effective_sample_size(jnp.zeros(10))
