"""Manifold Muon: the steepest tangent direction under the spectral norm, and the transformation built on it."""

import re

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import optimize

import cola_jax as cola
from cola_jax.stiefel_direction import steepest_tangent_direction


def _stiefel(rng, n, p):
  return np.linalg.qr(rng.normal(size=(n, p)))[0].astype(np.float32)


def _tangent_basis(w):
  """An orthonormal basis (Frobenius) of the tangent space {A : W^T A + A^T W = 0} at ``w``."""
  n, p = w.shape
  ambient = np.eye(n * p).reshape(n * p, n, p)
  normal_part = np.einsum(
    "ij,bjk->bik", w, 0.5 * (np.einsum("ji,bjk->bik", w, ambient) + np.einsum("bji,jk->bik", ambient, w))
  )
  tangent = (ambient - normal_part).reshape(n * p, n * p)
  u, s, _ = np.linalg.svd(tangent.T)
  return u[:, s > 0.5].T.reshape(-1, n, p)  # the projection's singular values are 1 (tangent) and 0


def _brute_force_value(w, g, starts):
  """``max <G, A> / |A|_2`` over the tangent space, by Nelder-Mead from ``starts`` random directions."""
  basis = _tangent_basis(np.float64(w))
  g = np.float64(g)

  def negative(theta):
    a = np.tensordot(theta, basis, 1)
    return -np.sum(g * a) / np.linalg.norm(a, 2)

  rng = np.random.default_rng(0)
  best = min(
    (
      optimize.minimize(
        negative,
        rng.normal(size=len(basis)),
        method="Nelder-Mead",
        options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000},
      )
      for _ in range(starts)
    ),
    key=lambda result: result.fun,
  )
  a = np.tensordot(best.x, basis, 1)
  return -best.fun, a / np.linalg.norm(a, 2)


# (4, 2), the largest tangent space searched by Nelder-Mead, is slow; (2, 2) keeps a square case (the closed form)
# quick; the others are extended (a tall direction's certificate: the gap test).
@pytest.mark.parametrize(
  "shape",
  [
    pytest.param((3, 2), marks=pytest.mark.extended),
    pytest.param((4, 2), marks=pytest.mark.slow),
    (2, 2),
    *(pytest.param(s, marks=pytest.mark.extended) for s in ((3, 3), (3, 1))),
  ],
  ids=str,
)
def test_direction_is_the_brute_force_maximiser(shape):
  rng = np.random.default_rng(sum(shape))
  w, g = _stiefel(rng, *shape), rng.normal(size=shape).astype(np.float32)
  a, info = steepest_tangent_direction(jnp.asarray(w), jnp.asarray(g), gap_tolerance=1e-5, max_iterations=3000)
  a = np.asarray(a, np.float64)
  assert bool(info.converged)
  value, brute = _brute_force_value(w, g, starts=8)
  assert np.sum(g * a) == pytest.approx(value, rel=2e-5)
  assert 0 <= float(info.gap) <= 1e-5  # the certificate: within this fraction of the best value
  np.testing.assert_allclose(a, brute, atol=2e-3)  # the maximiser is unique for generic G


@pytest.mark.extended  # quick: test_the_gap_bounds_the_suboptimality_and_meets_the_gap_tolerance (this spectrum)
@pytest.mark.parametrize(
  "n, p", [pytest.param(40, 8, marks=pytest.mark.slow), (30, 20), pytest.param(12, 4, marks=pytest.mark.slow)]
)
def test_direction_is_unit_spectral_norm_and_tangent(n, p):
  rng = np.random.default_rng(n)
  w = _stiefel(rng, n, p)
  # A spectrum decaying over three decades: the rank-deficient limit where the dual ascent stalls.
  u, v = _stiefel(rng, n, p), _stiefel(rng, p, p)
  g = (u * 0.8 ** np.arange(p)) @ v.T
  a, info = steepest_tangent_direction(jnp.asarray(w), jnp.asarray(g, jnp.float32))
  a = np.asarray(a, np.float64)
  assert bool(info.converged) and 0 < int(info.iterations) <= 300
  assert np.abs(w.T @ a + a.T @ w).max() < 1e-5
  assert np.linalg.norm(a, 2) <= 1 + 1e-5


@pytest.mark.parametrize(  # quick: one tolerance; the others extended
  "gap_tolerance", [1e-2, *(pytest.param(t, marks=pytest.mark.extended) for t in (1e-3, 1e-4))]
)
def test_the_gap_bounds_the_suboptimality_and_meets_the_gap_tolerance(gap_tolerance):
  """ADMM stops at the first certificate within ``gap_tolerance``; the direction is that far from the best, at most."""
  rng = np.random.default_rng(6)
  w = _stiefel(rng, 40, 8)
  g = (_stiefel(rng, 40, 8) * 0.8 ** np.arange(8)) @ _stiefel(rng, 8, 8).T
  w, g = jnp.asarray(w), jnp.asarray(g, jnp.float32)
  a, info = steepest_tangent_direction(w, g, gap_tolerance=gap_tolerance, max_iterations=3000)
  best, best_info = steepest_tangent_direction(w, g, gap_tolerance=1e-5, max_iterations=3000)
  assert bool(info.converged) and bool(best_info.converged) and 0 <= float(info.gap) <= gap_tolerance
  value, best_value = (np.sum(np.float64(g) * np.float64(x)) for x in (a, best))
  # Both certificates are float32 sums over the 40 x 8 entries (the bound's singular values, the inner product).
  assert (best_value - value) / best_value <= float(info.gap) + float(best_info.gap) + rounding.roundings(2 * 40 * 8)
  assert np.abs(np.asarray(w.T @ a + a.T @ w)).max() < 1e-5 and np.linalg.norm(np.asarray(a), 2) <= 1 + 1e-5
  if gap_tolerance > 1e-4:  # a looser tolerance stops earlier
    assert int(info.iterations) < int(best_info.iterations)


@pytest.mark.extended  # quick: test_zero_and_non_finite_gradients keeps the gradient's extremes (zero, inf)
def test_direction_depends_on_the_direction_of_the_gradient_only():
  rng = np.random.default_rng(3)
  w, g = jnp.asarray(_stiefel(rng, 9, 3)), jnp.asarray(rng.normal(size=(9, 3)), jnp.float32)
  a = steepest_tangent_direction(w, g)[0]
  for c in (1e-30, 1e30):
    np.testing.assert_allclose(steepest_tangent_direction(w, c * g)[0], a, atol=1e-6)


def test_zero_and_non_finite_gradients():
  w = jnp.eye(5, 2)
  a, info = steepest_tangent_direction(w, jnp.zeros((5, 2)))
  assert np.all(np.asarray(a) == 0) and bool(info.converged) and int(info.iterations) == 0
  a, info = steepest_tangent_direction(w, jnp.ones((5, 2)).at[0, 0].set(jnp.inf))
  assert np.all(np.isnan(np.asarray(a))) and not bool(info.converged)


def test_an_iteration_bound_too_small_is_flagged():
  rng = np.random.default_rng(4)
  w = _stiefel(rng, 40, 8)
  g = (_stiefel(rng, 40, 8) * 0.8 ** np.arange(8)) @ _stiefel(rng, 8, 8).T
  a, info = steepest_tangent_direction(jnp.asarray(w), jnp.asarray(g, jnp.float32), max_iterations=2)
  assert int(info.iterations) == 2 and not bool(info.converged)
  # The gap still bounds how far from the best value the direction is (weak duality).
  best, _ = steepest_tangent_direction(jnp.asarray(w), jnp.asarray(g, jnp.float32), max_iterations=3000)
  value, best_value = float(jnp.sum(g * a)), float(jnp.sum(g * best))
  assert float(info.gap) > 1e-3 and (best_value - value) / best_value <= float(info.gap)


def _polar(m):
  u, _, vt = np.linalg.svd(np.float64(m), full_matrices=False)
  return u @ vt


def test_without_momentum_a_step_is_the_reference_rule():
  """``W <- msign(W - eta A)``: the modular-manifolds reference's update, here with the exact polar factor."""
  rng = np.random.default_rng(5)
  w, g = _stiefel(rng, 7, 3), rng.normal(size=(7, 3)).astype(np.float32)
  tx = cola.manifold_muon(0.1, beta=0.0)
  updates, _ = tx.update(jnp.asarray(g), tx.init(jnp.asarray(w)), jnp.asarray(w))
  a = np.asarray(steepest_tangent_direction(jnp.asarray(w), jnp.asarray(g))[0])
  np.testing.assert_allclose(np.asarray(w + updates), _polar(w - 0.1 * a), atol=2e-6)


# Quick: a tall leaf (a per-tap kernel extended); wide leaves are test_spectral's (Orthogonal(scale), manifold_muon).
@pytest.mark.parametrize(
  "shape, constraint",
  [
    ((6, 3), cola.Orthogonal()),
    pytest.param((3, 6), cola.Orthogonal(), marks=pytest.mark.slow),
    pytest.param((4, 4), cola.Orthogonal(), marks=pytest.mark.slow),
    pytest.param((3, 3, 4, 5), cola.Orthogonal(), marks=pytest.mark.slow),
    pytest.param((3, 3, 4, 5), cola.Orthogonal(row_axes=(2,), column_axes=(3,)), marks=pytest.mark.extended),
  ],
)
def test_leaves_stay_on_the_manifold(shape, constraint):
  params = {"w": jax.random.normal(jax.random.key(0), shape), "b": jnp.zeros(3)}
  constraints = {"w": constraint, "b": None}
  tx = cola.manifold_muon(0.2, constraints=constraints)
  params = cola.project_params(params, constraints)
  state = tx.init(params)
  loss = lambda p: jnp.sum(jnp.sin(p["w"] * 3.0)) + jnp.sum((p["b"] - 1) ** 2)
  step = jax.jit(tx.update)
  for _ in range(10):
    updates, state = step(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
  residuals = cola.constraint_residuals(params, state)
  assert residuals["w"] < 1e-5 and residuals["b"] is None
  assert bool(state.direction_info["w"].converged)


def test_free_leaves_take_sgd_with_the_same_momentum():
  """The docstring's claim: ``-eta d``, which is ``optax.sgd(eta * (1 - beta), momentum=beta, nesterov=...)``."""
  beta, eta = 0.9, 0.05
  grads = [jnp.array([1.0, -2.0]), jnp.array([0.5, 0.5]), jnp.array([-1.0, 3.0])]
  for nesterov in (False, True):
    tx = cola.manifold_muon(eta, constraints=lambda params: None, beta=beta, nesterov=nesterov)  # all free
    sgd = optax.sgd(eta * (1 - beta), momentum=beta, nesterov=nesterov)
    params = sgd_params = jnp.zeros(2)
    state, sgd_state = tx.init(params), sgd.init(params)
    m, expected = np.zeros(2), np.zeros(2)
    for g in grads:
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      updates, sgd_state = sgd.update(g, sgd_state, sgd_params)
      sgd_params = optax.apply_updates(sgd_params, updates)
      m = beta * m + (1 - beta) * np.asarray(g)
      expected -= eta * (beta * m + (1 - beta) * np.asarray(g) if nesterov else m)
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(params, sgd_params, rtol=1e-5, atol=1e-8)


@pytest.mark.extended  # quick: test_free_leaves_take_sgd_with_the_same_momentum, the step without momentum
def test_beta_is_optax_muon_s_and_without_nesterov_a_step_is_on_its_bias_corrected_average():
  """``m`` is ``optax.contrib.scale_by_muon``'s ``mu`` for the same ``beta``; without Nesterov the step is the one
  from muon's ``mu / (1 - beta^t)``, the same direction (the docstring's correspondence)."""
  rng = np.random.default_rng(3)
  beta, eta = 0.9, 0.1
  w = jnp.asarray(_stiefel(rng, 6, 3))
  tx = cola.manifold_muon(eta, constraints=cola.Orthogonal(), beta=beta, nesterov=False)
  muon = optax.contrib.scale_by_muon(beta=beta, nesterov=False)
  state, muon_state = tx.init(w), muon.init(w)
  for t in range(1, 4):
    g = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
    updates, state = tx.update(g, state, w)
    _, muon_state = muon.update(g, muon_state, w)
    np.testing.assert_allclose(state.momentum, muon_state.mu, rtol=1e-6, atol=1e-7)
    a = steepest_tangent_direction(w, muon_state.mu / (1 - beta**t))[0]
    np.testing.assert_allclose(np.asarray(w + updates), _polar(np.asarray(w - eta * a)), atol=2e-6)
    w = w + updates


@pytest.mark.extended  # quick: the steps against the reference rule
def test_schedule_jit_equals_eager_and_map_params():
  params = {"w": jnp.eye(5, 3)}
  tx = cola.manifold_muon(optax.linear_schedule(0.1, 0.0, 4))
  grads = {"w": jnp.arange(15.0).reshape(5, 3) / 10}
  state = tx.init(params)
  eager, _ = tx.update(grads, state, params)
  jitted, _ = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_allclose(eager["w"], jitted["w"], atol=1e-6)
  assert jnp.abs(eager["w"]).max() > 0
  specs = optax.tree.map_params(tx, lambda p: "param", state)
  assert specs.momentum == {"w": "param"}


def test_bad_input_is_named():
  with pytest.raises(ValueError, match=r"^manifold_muon: beta must be in \[0, 1\), got 1.0"):
    cola.manifold_muon(0.1, beta=1.0)
  with pytest.raises(ValueError, match="learning_rate"):
    cola.manifold_muon(-0.1)
  with pytest.raises(ValueError, match="max_iterations"):
    cola.manifold_muon(0.1, max_iterations=0)
  tx = cola.manifold_muon(0.1, constraints={"w": cola.UnitNorm(), "b": None})
  with pytest.raises(ValueError, match=r"leaf at \['w'\] has the constraint UnitNorm"):
    tx.init({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)})


def _seeded_model():
  """A two-layer model: its parameters and optimizer state from a key, and its training step (``eta`` scheduled)."""
  constraints = {"w1": cola.Orthogonal(), "w2": cola.Orthogonal(), "b": None}
  tx = cola.manifold_muon(optax.linear_schedule(0.2, 0.05, 3), constraints=constraints)
  x = jax.random.normal(jax.random.key(1), (16, 12))
  y = jnp.arange(16) % 4

  def loss(p):
    return optax.softmax_cross_entropy_with_integer_labels(jax.nn.relu(x @ p["w1"]) @ p["w2"] + p["b"], y).mean()

  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  def init(key):
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (12, 8)), "w2": jax.random.normal(k2, (8, 4)), "b": jnp.zeros(4)}
    params = cola.project_params(params, constraints)
    return params, tx.init(params)

  return init, step


@pytest.mark.extended  # tests/test_lapack_under_vmap.py keeps a vmapped factorising step quick
def test_a_step_vmapped_over_seeds_is_each_seed_s_step():
  init, step = _seeded_model()
  keys = jax.random.split(jax.random.key(0), 3)
  batched = jax.vmap(init)(keys)
  vmapped = jax.jit(jax.vmap(step))
  for _ in range(3):
    batched = vmapped(*batched)
  single = jax.jit(step)
  for i, key in enumerate(keys):
    alone = init(key)
    for _ in range(3):
      alone = single(*alone)
    seed = jax.tree.map(lambda v: v[i], batched)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), seed, alone)
    assert int(seed[1].direction_info["w1"].iterations) == int(alone[1].direction_info["w1"].iterations) > 0


@pytest.mark.slow  # the guard itself: tests/test_lapack_under_vmap.py, in the quick suite
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="jaxlib's LAPACK kernels are the CPU backend's")
def test_a_vmapped_step_calls_lapack_one_matrix_at_a_time():
  """A batched LAPACK call (eigh, svd, qr) deadlocked XLA:CPU (jaxlib 0.10.2): it waits on the pool it runs in."""
  init, step = _seeded_model()
  batched = jax.vmap(init)(jax.random.split(jax.random.key(0), 2))
  hlo = jax.jit(jax.vmap(step)).lower(*batched).compile().as_text()
  calls = [line for line in hlo.splitlines() if 'custom_call_target="lapack_' in line]
  assert len(calls) >= 3  # QR, eigh and SVD, by jaxlib's names
  for call in calls:  # the result's first array: the matrix factored, (n, p) rather than (seeds, n, p)
    shape = re.search(r"\w+\[([\d,]*)\]", call.split(" = ", 1)[1]).group(1)
    assert shape.count(",") == 1, call


@pytest.mark.extended  # quick: test_validation.py's test_every_default_takes_the_weight_matrices_and_names_them
def test_the_default_steps_a_model_with_biases():
  """Not told which leaves, it takes the weight matrices (and says which): biases take SGD with momentum, where
  the default used to raise on any model with a bias."""
  params = {f"Dense_{i}": {"kernel": jnp.eye(4, 3 - i), "bias": jnp.zeros(3 - i)} for i in range(2)}
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.warns(UserWarning, match=r"it constrains these 2: Dense_0/kernel, Dense_1/kernel\."):
    tx = cola.manifold_muon(0.1, beta=0.0)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  for i in range(2):
    w = new[f"Dense_{i}"]["kernel"]
    np.testing.assert_allclose(w.T @ w, jnp.eye(3 - i), atol=1e-6)
    np.testing.assert_allclose(new[f"Dense_{i}"]["bias"], jnp.full(3 - i, -0.1), rtol=1e-6)
