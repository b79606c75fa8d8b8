r"""The samplers of ``cola.sampling`` reach closed-form laws, with fixed keys, on final positions of many chains.

Each law is that of the tempered posterior on the manifold, ``exp(-V / T) d sigma_M`` with ``V = -log p``:
the entries of a vector under an entrywise constraint (Circle, Box, NonNegative) are independent chains; a
matrix or a sphere is run as many chains by ``jax.vmap`` over keys. Only final states are used, so the samples
are i.i.d. and the Kolmogorov-Smirnov test applies. The quick suite runs one case per kind of check; the long
statistical runs are under ``slow``.
"""

import blackjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, stats

import cola_jax as cola

ACCEPT = 1e-3  # a p-value above it passes


def _final(sampler, start, steps, step_size, temperature=1.0, *, chains=None, seed=0):
  """The final positions of a chain (or of ``chains`` chains, vmapped over keys), one key per step by fold_in."""

  def run(key):
    def body(state, i):
      return sampler.step(jax.random.fold_in(key, i), state, None, step_size, temperature), None

    state, _ = jax.lax.scan(body, sampler.init(start), jnp.arange(steps))
    return state.position

  key = jax.random.key(seed)
  if chains is None:
    return np.asarray(jax.jit(run)(key))
  return np.asarray(jax.jit(jax.vmap(run))(jax.random.split(key, chains)))


def _ks(samples, cdf):
  return stats.kstest(np.ravel(samples), cdf).pvalue


def _gaussian(mean, variance):
  return lambda q, batch: jax.tree.map(lambda x: -(x - mean) / variance, q)


def _zero_force(q, batch):
  return jax.tree.map(jnp.zeros_like, q)


@pytest.mark.parametrize("temperature", [2.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_unconstrained_overdamped_is_blackjax_sgld_in_law_on_a_tempered_gaussian(temperature):
  """N(1, 0.25) tempered to N(1, 0.25 T): cola's overdamped sampler and blackjax's sgld side by side.

  Euler-Maruyama's bias at h = 0.005 raises the variance by h k / 2 = 1 %, below what 20,000 samples resolve.
  """
  grad_estimator, exact = _gaussian(1.0, 0.25), stats.norm(1.0, np.sqrt(0.25 * temperature)).cdf
  cola_samples = _final(cola.sampling.overdamped(grad_estimator), jnp.zeros(20_000), 600, 0.005, temperature)
  sgld = blackjax.sgld(grad_estimator)

  def blackjax_run(key):
    body = lambda x, i: (sgld.step(jax.random.fold_in(key, i), x, None, 0.005, temperature), None)
    return jax.lax.scan(body, jnp.zeros(20_000), jnp.arange(600))[0]

  blackjax_samples = np.asarray(jax.jit(blackjax_run)(jax.random.key(1)))
  assert _ks(cola_samples, exact) > ACCEPT and _ks(blackjax_samples, exact) > ACCEPT
  assert stats.ks_2samp(cola_samples, blackjax_samples).pvalue > ACCEPT
  assert _ks(cola_samples, stats.norm(1.0, np.sqrt(0.25)).cdf) < ACCEPT  # the untempered law is rejected


def test_underdamped_tempered_gaussian_and_its_zero_temperature_limit():
  """T = 0.5 gives N(1, 0.125); temperature exactly 0 draws no noise: the chain descends to the mode."""
  sampler = cola.sampling.underdamped(_gaussian(1.0, 0.25), friction=2.0)
  samples = _final(sampler, jnp.zeros(20_000), 800, 0.02, 0.5)
  assert _ks(samples, stats.norm(1.0, np.sqrt(0.125)).cdf) > ACCEPT
  np.testing.assert_allclose(_final(sampler, jnp.zeros(3), 800, 0.02, 0), 1.0, atol=1e-5)


def _arcsine(lower, upper):
  return lambda x: 0.5 + np.arcsin(np.clip((2 * x - lower - upper) / (upper - lower), -1, 1)) / np.pi


@pytest.mark.parametrize(
  "name, constraint, lower, upper, sampler",
  [
    ("circle_ud", cola.Circle(0.5), -0.5, 0.5, "underdamped"),
    pytest.param("circle_od", cola.Circle(0.5), -0.5, 0.5, "overdamped", marks=pytest.mark.slow),
    pytest.param("box_ud", cola.Box(-0.5, 1.5), -0.5, 1.5, "underdamped", marks=pytest.mark.slow),
  ],
)
def test_a_circle_without_force_samples_the_arcsine_law(name, constraint, lower, upper, sampler):
  """The lifted manifold's law: (theta, xi) uniform on the circle, so theta is arcsine on [lower, upper]."""
  if sampler == "underdamped":
    alg = cola.sampling.underdamped(_zero_force, friction=1.0, constraints=constraint)
    samples = _final(alg, jnp.full(20_000, 0.5 * (lower + upper)), 300, 0.2)
  else:
    alg = cola.sampling.overdamped(_zero_force, constraints=constraint)
    samples = _final(alg, jnp.full(20_000, 0.5 * (lower + upper)), 600, 0.01)
  assert np.all((samples >= lower) & (samples <= upper))
  assert _ks(samples, _arcsine(lower, upper)) > ACCEPT
  assert _ks(samples, stats.uniform(lower, upper - lower).cdf) < ACCEPT  # a uniform law is rejected


def _sphere_start(n):
  return jnp.zeros(n).at[0].set(1.0)


@pytest.mark.extended  # quick: test_a_circle_without_force_samples_the_arcsine_law (underdamped, on a manifold)
def test_underdamped_without_force_samples_the_uniform_law_on_the_sphere():
  """On S^2 each coordinate of a uniform point is uniform on [-1, 1] (Archimedes)."""
  alg = cola.sampling.underdamped(_zero_force, friction=1.0, constraints=cola.UnitNorm(axis="all"))
  samples = _final(alg, _sphere_start(3), 200, 0.2, chains=4000)
  np.testing.assert_allclose(np.linalg.norm(samples, axis=1), 1.0, rtol=1e-5)
  assert _ks(samples[:, 0], stats.uniform(-1, 2).cdf) > ACCEPT
  assert _ks(samples[:, 0], stats.norm(0, 1 / np.sqrt(3)).cdf) < ACCEPT


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["overdamped", "underdamped"])
def test_von_mises_fisher_on_the_sphere(sampler):
  """log p = kappa mu . x on S^2: t = mu . x has density proportional to exp(kappa t) on [-1, 1]."""
  kappa, mu = 2.0, jnp.array([0.0, 0.6, 0.8])
  grad_estimator = lambda q, batch: kappa * mu
  if sampler == "underdamped":
    alg = cola.sampling.underdamped(grad_estimator, friction=1.0, constraints=cola.UnitNorm(axis="all"))
    samples = _final(alg, _sphere_start(3), 600, 0.05, chains=4000)
  else:
    alg = cola.sampling.overdamped(grad_estimator, constraints=cola.UnitNorm(axis="all"))
    samples = _final(alg, _sphere_start(3), 1500, 0.002, chains=4000)
  t = samples @ np.asarray(mu)
  cdf = lambda x: (np.exp(kappa * x) - np.exp(-kappa)) / (np.exp(kappa) - np.exp(-kappa))
  assert _ks(t, cdf) > ACCEPT
  assert _ks(t, stats.uniform(-1, 2).cdf) < ACCEPT


def _first_coordinate_of_uniform_on_sphere_cdf(n):
  """CDF of x_1 for x uniform on S^(n-1): density proportional to (1 - t^2)^((n - 3) / 2)."""
  grid = np.linspace(-1, 1, 20_001)
  density = (1 - grid**2) ** ((n - 3) / 2)
  cumulative = integrate.cumulative_trapezoid(density, grid, initial=0)
  return lambda x: np.interp(x, grid, cumulative / cumulative[-1])


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["overdamped", "underdamped"])
def test_orthogonal_without_force_samples_the_haar_measure(sampler):
  """Haar on St(4, 2): a column is uniform on S^3, so Q_11 has density proportional to (1 - t^2)^(1/2)."""
  start = jnp.eye(4, 2)
  if sampler == "underdamped":
    alg = cola.sampling.underdamped(_zero_force, friction=1.0, constraints=cola.Orthogonal())
    samples = _final(alg, start, 300, 0.2, chains=4000)
  else:
    alg = cola.sampling.overdamped(_zero_force, constraints=cola.Orthogonal())
    samples = _final(alg, start, 600, 0.01, chains=4000)
  gram = np.einsum("bij,bik->bjk", samples, samples)
  np.testing.assert_allclose(gram, np.broadcast_to(np.eye(2), gram.shape), atol=1e-5)
  cdf = _first_coordinate_of_uniform_on_sphere_cdf(4)
  assert _ks(samples[:, 0, 0], cdf) > ACCEPT and _ks(samples[:, 3, 1], cdf) > ACCEPT
  assert _ks(samples[:, 0, 0], stats.uniform(-1, 2).cdf) < ACCEPT


@pytest.mark.slow
def test_non_negative_with_a_linear_potential_samples_its_law_on_the_parabola():
  """log p = -lam w on w = s^2: the law is exp(-lam s^2) d sigma, whose w-marginal has density
  exp(-lam w) sqrt(1 + 4 w) / sqrt(w) (the parabola's arc length), not the exponential law."""
  lam = 2.0
  alg = cola.sampling.underdamped(lambda q, b: jnp.full_like(q, -lam), friction=1.0, constraints=cola.NonNegative())
  samples = _final(alg, jnp.full(20_000, 0.5), 800, 0.05)
  assert np.all(samples >= 0)
  s = np.linspace(0, 6, 60_001)
  cumulative = integrate.cumulative_trapezoid(np.exp(-lam * s**2) * np.sqrt(1 + 4 * s**2), s, initial=0)
  cdf = lambda w: np.interp(np.sqrt(np.maximum(w, 0)), s, cumulative / cumulative[-1])
  assert _ks(samples, cdf) > ACCEPT
  assert _ks(samples, stats.expon(scale=1 / lam).cdf) < ACCEPT


def _circle_chain():
  alg = cola.sampling.underdamped(_gaussian(0.0, 1.0), friction=1.0, constraints={"w": cola.Circle(0.5), "b": None})
  return alg, alg.init({"w": jnp.full(3, 0.2), "b": jnp.zeros(2)}), jax.random.split(jax.random.key(3), 2)


@pytest.mark.extended  # quick: test_sampling_collection.py's one_seed_one_chain and many_chains (jit, vmap, resume)
def test_a_chain_is_its_key_under_jit_and_vmap():
  """One seed, one chain: a jitted and a vmapped step agree; the state resumes a chain."""
  alg, state, keys = _circle_chain()
  step = jax.jit(alg.step)
  jitted = step(keys[1], step(keys[0], state, None, 0.1), None, 0.1)
  batched = jax.vmap(lambda k: alg.step(k, state, None, 0.1))(keys)
  np.testing.assert_allclose(
    batched.position["w"][1], step(keys[1], state, None, 0.1).position["w"], rtol=1e-6, atol=1e-7
  )
  assert int(jitted.count) == 2 and bool(jnp.all(jnp.abs(jitted.position["w"]) <= 0.5))


@pytest.mark.extended  # an eager step dispatches and compiles each of its operations on its own
def test_an_eager_step_is_the_jitted_step():
  alg, state, keys = _circle_chain()
  step = jax.jit(alg.step)
  start = step(keys[0], state, None, 0.1)
  eager = alg.step(keys[1], start, None, 0.1)
  np.testing.assert_allclose(eager.position["w"], step(keys[1], start, None, 0.1).position["w"], rtol=1e-6, atol=1e-7)


def test_init_puts_the_position_on_its_manifold():
  alg = cola.sampling.overdamped(_zero_force, constraints={"w": cola.Orthogonal(), "r": cola.Circle(1.0)})
  state = alg.init({"w": jnp.array([[2.0, 0.0], [0.0, 0.5], [0.0, 0.0]]), "r": jnp.array([3.0, -0.5])})
  np.testing.assert_allclose(state.position["w"], jnp.eye(3, 2), atol=1e-6)
  np.testing.assert_allclose(state.position["r"], [0.99, -0.5], rtol=1e-6)
  residuals = cola.constraint_residuals(state.position, state)
  assert float(residuals["w"]) < 1e-6 and float(residuals["r"]) < 1e-6


@pytest.mark.parametrize(
  "argument, value, error, message",
  [
    ("step_size", -0.1, ValueError, "step_size must be non-negative and finite"),
    ("step_size", float("nan"), ValueError, "step_size must be non-negative and finite"),
    ("temperature", float("inf"), ValueError, "temperature must be non-negative and finite"),
    ("temperature", lambda t: 1.0, TypeError, "temperature must be a number"),
  ],
)
def test_bad_step_arguments_are_named(argument, value, error, message):
  alg = cola.sampling.underdamped(_zero_force, friction=1.0)
  state = alg.init(jnp.zeros(2))
  kwargs = {"step_size": 0.1, "temperature": 1.0, argument: value}
  with pytest.raises(error, match=f"cola.sampling.underdamped: {message}"):
    alg.step(jax.random.key(0), state, None, **kwargs)


def test_bad_construction_and_trees_are_named():
  with pytest.raises(ValueError, match="cola.sampling.underdamped: friction must be non-negative"):
    cola.sampling.underdamped(_zero_force, friction=-1.0)
  with pytest.raises(TypeError, match="grad_estimator must be a function"):
    cola.sampling.overdamped(None)
  with pytest.raises(ValueError, match=r"\['w'\]"):  # Orthogonal on a vector: the leaf's path
    cola.sampling.overdamped(_zero_force, constraints={"w": cola.Orthogonal()}).init({"w": jnp.ones(3)})
  alg = cola.sampling.overdamped(lambda q, batch: q["w"])  # a gradient that is not shaped like the position
  state = alg.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="must return a gradient with the tree structure of the position"):
    alg.step(jax.random.key(0), state, None, 0.1)


def test_a_nan_gradient_shows_in_the_state():
  alg = cola.sampling.underdamped(lambda q, b: jnp.full_like(q, jnp.nan), friction=1.0, constraints=cola.Circle(1.0))
  state = jax.jit(alg.step)(jax.random.key(0), alg.init(jnp.zeros(2)), None, 0.1)
  assert bool(jnp.all(jnp.isnan(state.position)))
