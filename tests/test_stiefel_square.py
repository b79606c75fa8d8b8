"""The loop-free square SHAKE and RATTLE steps: their defect identities, bounds and fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola
from cola_jax import langevin
from cola_jax.constraints import stiefel_projection, stiefel_square
from cola_jax.constraints.orthogonal import StiefelPoint, gram_defect

needs_x64 = pytest.mark.skipif(not hasattr(jax, "enable_x64"), reason="jax.enable_x64 (jax >= 0.8)")
EXACT, TERM = 1e30, 0.0  # budgets: never add a correction, always add it
# Each form of the step: SHAKE without force, with T + G/2, with the series
# term too; RATTLE without and with the term.
SHAKES = ({"budget": EXACT, "min_terms": -1}, {"budget": EXACT, "min_terms": 0}, {"budget": TERM})
RATTLES = ({"budget": EXACT}, {"budget": TERM})


def anchor(seed, s, defect_scale, dtype=np.float64):
  """An orthogonal (s, s) matrix perturbed by ``defect_scale`` (its G is about that size)."""
  rng = np.random.default_rng(seed)
  q = np.linalg.qr(rng.standard_normal((s, s)))[0]
  return (q + defect_scale * rng.standard_normal((s, s)) / np.sqrt(s)).astype(dtype)


def skew(m):
  return 0.5 * (m - m.T)


def sym(m):
  return 0.5 * (m + m.T)


def defect64(q):
  q = np.asarray(q, np.float64)
  return q.T @ q - np.eye(q.shape[1])


def test_shake_defect_identity_float64():
  """F = (P - P_hat) + P_hat^2/4 + [A,G]/2 - 3G^2/4 - (G P_hat + P_hat G)/4 - (GT + TG) + L G L - Y^T G (I+G)^-1 Y."""
  s = 9
  q_n = anchor(0, s, 1e-3)
  d = 0.05 * np.random.default_rng(1).standard_normal((s, s))
  g, eye = defect64(q_n), np.eye(s)
  y = q_n.T @ d
  a, t = skew(y), sym(y)
  p = a.T @ a
  for p_hat in (0 * p, p):
    lam = t + 0.5 * (g + p_hat)
    f = defect64(q_n + d - q_n @ lam)
    formula = (
      (p - p_hat)
      + p_hat @ p_hat / 4
      + (a @ g - g @ a) / 2
      - 0.75 * g @ g
      - (g @ p_hat + p_hat @ g) / 4
      - (g @ t + t @ g)
      + lam @ g @ lam
      - y.T @ g @ np.linalg.solve(eye + g, y)
    )
    np.testing.assert_allclose(f, formula, rtol=0, atol=1e-15)
    assert np.max(np.abs(f)) > 1e-6  # not a vacuous check


def test_rattle_defect_identity_float64():
  """F = (P - P_hat) + P_hat^2/4 - 3G^2/4 - (G P_hat + P_hat G)/4 + [G,A]/2 + Z^T G Z."""
  s = 9
  q_n = anchor(2, s, 1e-3)
  a = skew(0.05 * np.random.default_rng(3).standard_normal((s, s)))
  g, eye = defect64(q_n), np.eye(s)
  p = a.T @ a
  for p_hat in (0 * p, p):
    lam = 0.5 * (g + p_hat)
    z = a - lam
    f = defect64(q_n @ (eye + z))
    formula = (p - p_hat) + p_hat @ p_hat / 4 - 0.75 * g @ g - (g @ p_hat + p_hat @ g) / 4 + (g @ a - a @ g) / 2
    np.testing.assert_allclose(f, formula + z.T @ g @ z, rtol=0, atol=1e-15)
    # The force is along the start-of-step normal: Q - Q_n - Q_n A = -Q_n Lambda, Lambda symmetric.
    lam_back = -np.linalg.solve(q_n, q_n @ (eye + z) - q_n - q_n @ a)
    np.testing.assert_allclose(lam_back, lam_back.T, atol=1e-15)


@needs_x64
@pytest.mark.parametrize("s", [3, 12, 40])
@pytest.mark.parametrize("size", [1e-4, 1e-3, 1e-2, 1e-1])
def test_measured_defect_never_exceeds_the_bound_float64(s, size):
  """Random steps, anchors with defects from 0 to 1e-4, with and without the series term."""
  rng = np.random.default_rng(int(s * 1e5 * size))
  for trial in range(4):
    q_n = anchor(trial, s, [0.0, 1e-8, 1e-6, 1e-4][trial])
    d = size * rng.standard_normal((s, s)) / np.sqrt(s)
    with jax.enable_x64(True):
      q, step = jnp.asarray(q_n), jnp.asarray(d)
      defect = stiefel_square.anchor_defect(q)
      steps = [stiefel_square.shake(q, defect, step, **form) for form in SHAKES]
      steps += [stiefel_square.rattle(q, defect, step, 0.7, **form)[0] for form in RATTLES]
    for form, step in enumerate(steps):
      measured = np.max(np.abs(defect64(step.matrix)))
      assert measured <= float(step.bound) * (1 + 1e-9) + 1e-15, (trial, form, measured, float(step.bound))
    if trial < 2 and size <= 1e-3:  # not vacuous: far below the tolerance on the manifold
      assert float(steps[2].bound) < 1e-7 and float(steps[4].bound) < 1e-7


@pytest.mark.parametrize("s", [12, 100])
def test_float32_defect_stays_within_bound_plus_rounding(s):
  """In float32 the measured defect exceeds the bound by rounding alone (below half the tolerance)."""
  rng = np.random.default_rng(s)
  q_n = jnp.asarray(anchor(5, s, 0.0, np.float32))
  defect = stiefel_square.anchor_defect(q_n)
  for size in (1e-4, 1e-3, 1e-2):
    d = jnp.asarray(size * rng.standard_normal((s, s)) / np.sqrt(s), jnp.float32)
    steps = [stiefel_square.shake(q_n, defect, d, **form) for form in SHAKES]
    steps += [stiefel_square.rattle(q_n, defect, d, 0.5, **form)[0] for form in RATTLES]
    for step in steps:
      assert np.max(np.abs(defect64(step.matrix))) <= float(step.bound) + 5e-7


def test_series_term_is_added_exactly_when_the_bound_without_it_exceeds_the_budget():
  s = 20
  q_n = jnp.asarray(anchor(7, s, 0.0))
  defect = stiefel_square.anchor_defect(q_n)
  d = jnp.asarray(1e-2 * np.random.default_rng(8).standard_normal((s, s)), jnp.float32)
  without = stiefel_square.shake(q_n, defect, d, EXACT, min_terms=0)
  with_term = stiefel_square.shake(q_n, defect, d, TERM)
  assert float(with_term.bound) < float(without.bound)
  assert not np.array_equal(without.matrix, with_term.matrix)
  unprojected = stiefel_square.shake(q_n, defect, d, EXACT)
  np.testing.assert_array_equal(unprojected.matrix, q_n + d)  # Lambda = 0 when its bound is met
  for budget, expected in ((float(without.bound) * 1.01, without), (float(without.bound) * 0.99, with_term)):
    got = stiefel_square.shake(q_n, defect, d, budget, min_terms=0)
    np.testing.assert_array_equal(got.matrix, expected.matrix)
    assert float(got.bound) == pytest.approx(float(expected.bound), rel=1e-6)  # fused differently


@pytest.mark.parametrize("size", [1e-4, 3e-3, 3e-2, 0.3])
def test_fallback_is_taken_exactly_when_the_bound_fails(size):
  """Orthogonal.project: the closed form (0 iterations) iff its bound is at most tolerance / 2."""
  c = cola.Orthogonal(tolerance=1e-6)
  s = 30
  q = c.nearest(jax.random.normal(jax.random.key(0), (s, s)))
  step = size * jax.random.normal(jax.random.key(1), (s, s)) / np.sqrt(s)
  point = c.point(q, c.init(q))
  closed = stiefel_square.shake(point.matrix, point.defect, step, 0.5 * c.tolerance)
  new = jax.jit(c.project)(point, step)
  accepted = float(closed.bound) <= 0.5 * c.tolerance
  assert (int(new.info.iterations) == 0) == accepted, (float(closed.bound), int(new.info.iterations))
  assert bool(new.info.converged)
  assert float(jnp.max(jnp.abs(gram_defect(new.matrix)))) <= c.tolerance
  if accepted:
    np.testing.assert_array_equal(new.matrix, closed.matrix)
  else:
    moved = q + step
    q_solver, _, _ = stiefel_projection.quasi_newton_projection(q, moved, c.tolerance, c.max_iterations, norm="max")
    np.testing.assert_allclose(new.matrix, q_solver, atol=1e-6)


@pytest.mark.parametrize("size", [1e-4, 1e-3, 3e-3])  # with and without the series term
def test_closed_form_equals_the_iterative_solvers(size):
  """Accepted closed-form steps land where the paper's iteration does, to the tolerance."""
  s = 50
  c = cola.Orthogonal(tolerance=1e-6)
  q = c.nearest(jax.random.normal(jax.random.key(3), (s, s)))
  step = size * jax.random.normal(jax.random.key(4), (s, s)) / np.sqrt(s)
  new = c.project(c.point(q, c.init(q)), step)
  assert int(new.info.iterations) == 0
  for solve in (stiefel_projection.quasi_newton_projection, stiefel_projection.newton_multiplier_projection):
    reference, _, converged = solve(q, q + step, 5e-7, 100, norm="max")
    assert bool(converged)
    np.testing.assert_allclose(new.matrix, reference, rtol=0, atol=2e-6)
  # The force is along the anchor's normal: Q - Q_n - D = -Q_n Lambda with Lambda symmetric.
  lam = -np.asarray(q, np.float64).T @ np.asarray(new.matrix - q - step, np.float64)
  np.testing.assert_allclose(lam, lam.T, atol=1e-6)


@pytest.mark.parametrize("splitting", ["OBA", "BAOAB"])
def test_square_rattle_follows_the_iterative_rattle(splitting):
  """o-CoLA-ud on a square kernel: the loop-free steps and the solver's RATTLE agree over 30 noisy steps."""
  s, h = 16, 0.1
  c = cola.Orthogonal(tolerance=1e-6)
  q0 = c.nearest(jax.random.normal(jax.random.key(5), (s, s)))
  target = 0.3 * jnp.ones((s, s))  # the force 0.03 (Q - target): steps within the closed form's range

  def run(constraint_step):
    def step(carry, key):
      q, info, p = carry
      point = c.point(q, info)
      point, p = constraint_step(point, p, 0.03 * (point.matrix - target), key)
      return (point.matrix, point.info, p), point.info.iterations

    carry = (q0, c.init(q0), jnp.zeros((s, s)))
    (q, _, p), iterations = jax.lax.scan(step, carry, jax.random.split(jax.random.key(6), 30))
    return q, p, jnp.sum(iterations)

  def fast(point, p, grad, key):
    if splitting == "OBA":
      return langevin.oba_step(c, point, p, grad, h, 0.8, 1e-3, key)
    return langevin.baoab_step(c, point, p, grad, h, h, 0.8, 1e-3, key)

  def iterative(point, p, grad, key):  # the explicit O, B and A steps with the solver's RATTLE
    def a(point, p, dt):
      return c._rattle(StiefelPoint(point.matrix, point.info), p, dt)

    if splitting == "OBA":
      p = langevin.o_step(c, point, p, 0.8, 1e-3, key)
      p = langevin.b_step(c, point, p, grad, h)
      return a(point, p, h)
    p = langevin.b_step(c, point, p, grad, h)
    point, p = a(point, p, h / 2)
    p = langevin.o_step(c, point, p, 0.8, 1e-3, key)
    return a(point, p, h / 2)

  q_fast, p_fast, iterations = jax.jit(lambda: run(fast))()
  q_ref, p_ref, _ = jax.jit(lambda: run(iterative))()
  assert int(iterations) == 0  # every step took the closed form
  np.testing.assert_allclose(q_fast, q_ref, atol=2e-5)
  np.testing.assert_allclose(p_fast, p_ref, atol=2e-5 * float(jnp.max(jnp.abs(p_ref))) + 1e-6)
  assert float(jnp.max(jnp.abs(p_fast.T @ q_fast + q_fast.T @ p_fast))) <= 1e-5 * float(jnp.max(jnp.abs(p_fast)))
  assert float(jnp.max(jnp.abs(q_fast - q0))) > 0.01  # it moved


def test_gram_minus_identity_sums_the_diagonal_accurately():
  """At 512 x 512 a product's diagonal carries ~1e-6 of rounding; the centred sum does not."""
  rng = np.random.default_rng(9)
  q = np.linalg.qr(rng.standard_normal((512, 512)))[0].astype(np.float32)
  exact = defect64(q)
  accurate = np.asarray(stiefel_projection.gram_minus_identity(jnp.asarray(q)), np.float64)
  assert np.max(np.abs(np.diag(accurate - exact))) <= 1e-7
  assert np.max(np.abs(accurate - exact)) <= 2e-7
