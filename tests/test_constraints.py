"""The geometry of each constraint: projections, A steps, and the paper's errata."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _constraints import CASES, VARIANTS

import cola_jax as cola
from cola_jax import langevin
from cola_jax.constraints.orthogonal import from_tall_view, gram_defect, tall_view

# Circle.


def circle_point(theta, r):
  c = cola.Circle(r)
  return c, c.point(theta, c.init(theta))


def test_circle_a_step_is_the_exact_rotation():
  r, h = 0.1, 0.3
  theta = jnp.array([0.08, -0.03, 0.0, 0.1, -0.1])
  c, point = circle_point(theta, r)
  v = jnp.array([0.01, -0.2, 3.0, 0.5, -40.0])
  (new_theta, new_xi), new_v = langevin.a_step(c, point, v, h)
  angle0 = np.arctan2(np.asarray(point[1], np.float64), np.asarray(point[0], np.float64))
  # Moving along t = (xi, -theta)/r at speed v turns the angle by -h v / r.
  expected = angle0 - h * np.asarray(v, np.float64) / r
  np.testing.assert_allclose(new_theta, r * np.cos(expected), atol=2e-7)
  np.testing.assert_allclose(new_xi, r * np.sin(expected), atol=2e-7)
  np.testing.assert_array_equal(new_v, v)


@pytest.mark.extended  # quick: test_circle_a_step_is_the_exact_rotation
def test_circle_a_step_speed_matches_the_momentum():
  r, h = 0.1, 1e-3
  c, point = circle_point(jnp.array([0.06]), r)
  v = jnp.array([0.02])
  (theta1, xi1), _ = langevin.a_step(c, point, v, h)
  velocity = np.array([theta1[0] - point[0][0], xi1[0] - point[1][0]]) / h
  tangent = np.array([point[1][0], -point[0][0]]) / r
  np.testing.assert_allclose(velocity, float(v[0]) * tangent, rtol=1e-3)


def test_circle_cotangent_projection_is_the_papers_projection():
  r = 0.5
  theta = jnp.array([0.3, -0.4, 0.0])
  c, (t, xi) = circle_point(theta, r)
  pc, pxi = jnp.array([1.0, 2.0, -3.0]), jnp.array([0.5, -1.0, 2.0])
  v = c.cotangent((t, xi), (pc, pxi))
  # Paper, Appendix B: p^c - theta/r^2 (theta p^c + xi p^xi), likewise for xi.
  dot = t * pc + xi * pxi
  np.testing.assert_allclose(v * xi / r, pc - t / r**2 * dot, atol=1e-6)
  np.testing.assert_allclose(-v * t / r, pxi - xi / r**2 * dot, atol=1e-6)


def test_circle_overdamped_projection_keeps_the_quadrant():
  # docs/errata.md, erratum 2: cos(arctan(xi/theta)) >= 0 would flip negative weights.
  r = 0.1
  theta = jnp.array([-0.09, -0.05, 0.05])
  c, point = circle_point(theta, r)
  theta_new, state = c.unpack(langevin.overdamped_step(c, point, jnp.array([0.05, 0.0, 0.0]), 0.1), theta)
  new = theta_new, state.slack
  assert float(new[0][0]) < 0 and float(new[0][1]) < 0
  np.testing.assert_allclose(new[0] ** 2 + new[1] ** 2, r**2, rtol=1e-6)
  # Radial projection: the new point is the normalised moved point.
  moved = np.array([float(point[0][0]) - 0.1 * 0.05, float(point[1][0])])
  np.testing.assert_allclose([new[0][0], new[1][0]], r * moved / np.linalg.norm(moved), rtol=1e-6)


def test_circle_underdamped_slack_momentum_is_damped_not_copied():
  # docs/errata.md, erratum 1: the paper writes the slack momentum's O step from p^c.
  # The stored tangential momentum v carries both (p^c, p^xi) = v (xi, -theta)/r,
  # and the O step must scale both by exp(-gamma h): v -> exp(-gamma h) v.
  c, point = circle_point(jnp.array([0.03]), 0.1)
  v = jnp.array([0.7])
  damped = langevin.o_step(c, point, v, 0.5)
  np.testing.assert_allclose(damped, 0.35)


def test_circle_b_step_kicks_by_the_projected_gradient():
  r, h = 0.1, 0.3
  c, (t, xi) = circle_point(jnp.array([0.06]), r)
  g = jnp.array([2.0])
  v = langevin.b_step(c, (t, xi), jnp.zeros(1), g, h)
  # Paper: p^c -= h (1 - theta^2/r^2) g, p^xi += h theta xi / r^2 g.
  np.testing.assert_allclose(v * xi / r, -h * (1 - t**2 / r**2) * g, rtol=1e-6)
  np.testing.assert_allclose(-v * t / r, h * t * xi / r**2 * g, rtol=1e-6)


# Orthogonal.


def random_stiefel(key, shape):
  q, _ = jnp.linalg.qr(jax.random.normal(key, shape))
  return q


@pytest.mark.parametrize(
  "shape", [(5, 3), *(pytest.param(s, marks=pytest.mark.extended) for s in ((3, 5), (4, 4), (3, 3, 2, 4)))]
)
def test_tall_view_round_trips_and_orients(shape):
  w = jax.random.normal(jax.random.key(0), shape)
  q = tall_view(w)
  assert q.shape[0] >= q.shape[1]
  np.testing.assert_array_equal(from_tall_view(q, w), w)
  rows = int(np.prod(shape[:-1]))
  assert q.shape == ((rows, shape[-1]) if rows >= shape[-1] else (shape[-1], rows))


def test_orthogonal_cotangent_projection_is_an_orthogonal_projection():
  c = cola.Orthogonal()
  q = random_stiefel(jax.random.key(0), (7, 3))
  point = c.point(q, c.init(q))
  a, b = jax.random.normal(jax.random.key(1), (2, 7, 3))
  pa = c.cotangent(point, a)
  np.testing.assert_allclose(pa.T @ q + q.T @ pa, 0, atol=1e-6)
  np.testing.assert_allclose(c.cotangent(point, pa), pa, atol=1e-6)
  # Self-adjoint in the Frobenius inner product.
  np.testing.assert_allclose(jnp.sum(pa * b), jnp.sum(a * c.cotangent(point, b)), rtol=1e-5)


@pytest.mark.extended  # quick: test_implicit.py::test_projection_agrees_with_orthogonal (Q_n + D - Q_n Lambda)
def test_quasi_newton_projection_keeps_the_papers_force_direction():
  c = cola.Orthogonal(tolerance=1e-6)
  q = random_stiefel(jax.random.key(0), (30, 10))
  anchor = c.point(q, c.init(q))
  step = 0.02 * jax.random.normal(jax.random.key(1), q.shape)
  new = c.project(anchor, step)
  assert bool(new.info.converged) and int(new.info.iterations) >= 2
  assert float(jnp.max(jnp.abs(gram_defect(new.matrix)))) <= 1e-6
  # Q_{n+1} = Q_n + step - Q_n Lambda with Lambda symmetric.
  lam = -q.T @ (new.matrix - q - step)
  np.testing.assert_allclose(lam, lam.T, atol=1e-6)
  np.testing.assert_allclose(new.matrix, q + step - q @ lam, atol=1e-6)


@pytest.mark.extended  # quick: test_reliability.py's tangential steps (flagged steps land on the manifold)
def test_projection_that_cannot_converge_is_flagged_and_still_lands():
  c = cola.Orthogonal(tolerance=1e-6, max_iterations=2)
  q = random_stiefel(jax.random.key(0), (40, 20))
  anchor = c.point(q, c.init(q))
  step = jax.random.normal(jax.random.key(1), q.shape)
  # 0.05: a root exists, two iterations do not reach it; 1.0: |skew(Q^T D)|_2 ~ 6, no root, no iteration.
  for scale, iterations in ((0.05, 2), (1.0, 0)):
    new = c.project(anchor, scale * step)
    assert not bool(new.info.converged) and int(new.info.iterations) == iterations
    assert float(jnp.max(jnp.abs(gram_defect(new.matrix)))) <= 1e-5


def test_rattle_a_step_is_cotangent_and_time_reversible():
  c = cola.Orthogonal(tolerance=1e-7, max_iterations=50)
  q = random_stiefel(jax.random.key(0), (8, 3))
  point = c.point(q, c.init(q))
  p = c.cotangent(point, jax.random.normal(jax.random.key(1), q.shape))
  h = 0.1
  new, p1 = langevin.a_step(c, point, p, h)
  np.testing.assert_allclose(p1.T @ new.matrix + new.matrix.T @ p1, 0, atol=1e-5)
  back, p0 = langevin.a_step(c, new, -p1, h)
  np.testing.assert_allclose(back.matrix, q, atol=1e-5)
  np.testing.assert_allclose(-p0, p, atol=1e-4)
  assert float(jnp.linalg.norm(new.matrix - q)) > 0.05  # it did move


# Slow; quick: tests/test_reliability.py's sweep takes the default solver to the paper's point (extended: the
# others, and tests/test_axes.py's square_root batched against separate leaves).
@pytest.mark.slow
@pytest.mark.parametrize("projection", ["newton", "square_root"])
def test_faster_projections_follow_the_papers_trajectory(projection):
  """Same multiplier equation, so the same dynamics: o-CoLA-ud over 30 noisy steps."""
  shapes = {"tall": (20, 6), "square": (12, 12), "wide": (5, 9), "conv": (3, 3, 2, 8)}
  keys = jax.random.split(jax.random.key(0), len(shapes))
  params = cola.project_params(
    {name: jax.random.normal(k, s) for (name, s), k in zip(shapes.items(), keys)}, cola.Orthogonal()
  )
  targets = jax.tree.map(lambda p: 0.3 * jnp.ones_like(p), params)

  def run(tx):
    def step(carry, _):
      p, state = carry
      grads = jax.tree.map(lambda w, t: w - t, p, targets)
      updates, state = tx.update(grads, state, p)
      return (optax.apply_updates(p, updates), state), None

    (p, state), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=30)
    return p, state

  def make(projection):
    return cola.o_cola_ud(
      0.2,
      friction=1.0,
      temperature=1e-3,
      key=jax.random.key(1),
      projection=projection,
      tolerance=1e-6,
      max_iterations=40,
    )

  reference, _ = jax.jit(lambda: run(make("quasi_newton")))()
  got, state = jax.jit(lambda: run(make(projection)))()
  for name in shapes:
    np.testing.assert_allclose(got[name], reference[name], atol=2e-5, err_msg=name)
    assert float(jnp.max(jnp.abs(got[name] - params[name]))) > 0.05, name  # it did move
  residuals = cola.constraint_residuals(got, state)
  assert max(float(r) for r in jax.tree.leaves(residuals)) <= 1e-5
  assert all(bool(info.converged) for info in state.constraint_states.values())


def test_unknown_projection_is_an_error():
  with pytest.raises(ValueError, match="projection must be one of"):
    cola.Orthogonal(projection="svd")


# The registry's constraints that project noise and force together: the Stiefel manifold extended (quick:
# test_invariant_measure.py's Haar moments with CoLA-ud, its noise projected with the force), the others slow.
@pytest.mark.parametrize(
  "constraint, shape",
  [
    pytest.param(c, shape, id=name, marks=pytest.mark.extended if name == "orthogonal" else pytest.mark.slow)
    for name, c, shape in CASES + VARIANTS
    if c.project_noise_with_force
  ],
)
def test_noise_and_force_projected_together_give_o_then_b(constraint, shape):
  """One cotangent projection of noise and force is O followed by B: ``Pi(q)`` is linear."""
  assert constraint.project_noise_with_force
  param = constraint.nearest(jax.random.normal(jax.random.key(0), shape))
  point = constraint.point(param, constraint.init(param))
  grad = jax.random.normal(jax.random.key(1), shape)
  ambient = constraint.ambient_gradient(point, grad)
  momentum = constraint.cotangent(point, jax.tree.map(lambda g: jnp.sin(3 * g), ambient))
  h, decay, scale, key = 0.05, 0.8, 0.3, jax.random.key(2)

  joint = jax.jit(lambda *args: langevin.oba_step(constraint, *args))
  noise = langevin.draw_noise(constraint, key, point, "OBA")
  moved, moved_momentum = joint(point, momentum, grad, h, decay, scale, noise)

  @jax.jit
  def o_then_b_then_a(point, momentum, grad, h, decay, scale, noise):
    momentum = langevin.o_step(constraint, point, momentum, decay, scale, noise)
    return langevin.a_step(constraint, point, langevin.b_step(constraint, point, momentum, grad, h), h)

  expected_point, expected_momentum = o_then_b_then_a(point, momentum, grad, h, decay, scale, noise)
  np.testing.assert_allclose(moved_momentum, expected_momentum, rtol=1e-4, atol=1e-5)
  for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(expected_point)):
    if jnp.issubdtype(got.dtype, jnp.floating):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
