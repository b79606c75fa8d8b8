r"""The general constraint :class:`~cola_jax.Implicit`: SHAKE, RATTLE, failures.

Agreement with the closed forms. The circle is
``Implicit(inequality=theta^2 - r^2)`` (the same slack formulation), the sphere
``Implicit(inequality=|w_j|^2 - r^2)`` per unit, orthogonality
``Implicit(equality=triu(Q^T Q - I))``. The cotangent projection is the
orthogonal projection onto the tangent space in every formulation, so they
agree to rounding. The SHAKE projection corrects along ``G(q_n)^T``: for
orthogonality that is ``Q_n Lambda``, the direction of the paper's quasi-Newton
iteration, so it has the same solution as :class:`~cola_jax.Orthogonal`; the
circle's overdamped projection is radial instead, so there the test solves
``|q_bar + mu q_n| = r`` exactly. RATTLE is second order: against the exact
rotation its one-step error shrinks by 8 when ``h`` halves.

A constraint the closed forms do not cover: every unit's incoming weights sum
to zero and the kernel has a fixed Frobenius norm ``c``. On the MLP of
``conftest.py`` the residual stays below the tolerance over 1000 noisy steps
with real gradients. Invariant measures, with ``jax.vmap`` over keys (one chain
per key, the last state of each: i.i.d. samples):

* zero-sum vectors ``x in R^d`` with ``V = |x - a|^2 / 2``: the law
  ``exp(-V / tau)`` on the hyperplane is Gaussian with mean ``P a`` and
  covariance ``tau P``, ``P = I - 1 1^T / d``. Euler-Maruyama inflates it
  exactly to ``tau P / (1 - h / 2)`` (od); BAOAB's positions are exact for a
  harmonic potential (Leimkuhler and Matthews 2013), and on a linear manifold
  SHAKE and RATTLE are exact, so ``tau P`` for every ``h < 2`` (ud).
* zero column sums and norm ``c`` for a ``(rows, cols)`` leaf, no force: a
  sphere of radius ``c`` in the subspace of dimension ``D = (rows - 1) cols``.
  The dynamics commute with its rotations (isotropic noise; ``g`` is invariant),
  so the law is uniform for every ``h``. An entry is ``<u, x>`` with
  ``|P u|^2 = 1 - 1/rows``; for ``x`` uniform on ``S^{D-1}`` (radius ``c``) and
  a unit ``u`` in the subspace, ``E <u,x>^2 = c^2 / D``,
  ``E <u,x>^4 = 3 c^4 / (D (D + 2))`` and ``(<u,x>/c + 1) / 2`` is
  ``Beta((D - 1)/2, (D - 1)/2)``; entries of one column have
  ``E w_i w_k = -c^2 / (rows D)``, of different columns 0.
"""

import math
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended
from scipy import stats

import cola_jax as cola

ACCEPT = 1e-3
Z_ACCEPT = 4.5
Z_REJECT = 7.0


def circle_implicit(r, **kwargs):
  return cola.Implicit(inequality=lambda theta: theta**2 - r**2, **kwargs)


def sphere_implicit(r, **kwargs):
  return cola.Implicit(inequality=lambda w: jnp.sum(w**2, axis=0) - r**2, **kwargs)


def orthogonal_implicit(**kwargs):
  def defect(q):
    rows, cols = jnp.triu_indices(q.shape[1])
    return (q.T @ q - jnp.eye(q.shape[1]))[rows, cols]

  return cola.Implicit(equality=defect, **kwargs)


def start_point(constraint, param):
  return constraint.point(param, constraint.init(param))


def flat(*arrays):
  return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


def random_orthonormal(key, shape):
  return cola.Orthogonal().nearest(jax.random.normal(key, shape))


# --------------------------------------------------------------------------------------
# Construction and errors


def test_construction_errors():
  with pytest.raises(ValueError, match="equality=, inequality= or both"):
    cola.Implicit()
  with pytest.raises(TypeError, match="equality must be a function"):
    cola.Implicit(equality=3.0)
  with pytest.raises(TypeError, match="inequality must be a function"):
    cola.Implicit(inequality="x < 1")
  with pytest.raises(ValueError, match="tolerance must be positive"):
    cola.Implicit(equality=jnp.sum, tolerance=0.0)
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match="max_iterations must be a positive integer"):
      cola.Implicit(equality=jnp.sum, max_iterations=bad)
  norm = lambda w: jnp.sum(w**2) - 1
  assert cola.Implicit(equality=norm) == cola.Implicit(equality=norm)
  assert hash(cola.Implicit(equality=norm)) == hash(cola.Implicit(equality=norm))


@pytest.mark.parametrize(
  "constraint, message",
  [
    (
      cola.Implicit(equality=lambda w: (w > 0).astype(jnp.int32)),
      r"\['layer'\]\['w'\].*equality\(x\) returns dtype int32",
    ),
    (
      cola.Implicit(inequality=lambda w: w @ jnp.ones(5)),
      r"\['layer'\]\['w'\].*inequality\(x\) fails on an array of that shape",
    ),
    (cola.Implicit(equality=lambda w: (w.sum(), w.mean())), r"\['layer'\]\['w'\].*must return one array"),
    (cola.Implicit(equality=lambda w: w.ravel()[:0]), r"\['layer'\]\['w'\].*no components"),
    (
      cola.Implicit(equality=lambda w: jnp.concatenate([w.ravel(), w.ravel()])),
      r"\['layer'\]\['w'\].*24 constraint components for 12 coordinates",
    ),
  ],
)
def test_bad_functions_name_the_leaf(constraint, message):
  params = {"layer": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}}
  for tx in (
    cola.cola_od(0.1, constraints={"layer": {"w": constraint, "b": None}}),
    cola.cola_ud(0.1, friction=1.0, constraints={"layer": {"w": constraint, "b": None}}),
  ):
    with pytest.raises(ValueError, match=message):
      tx.init(params)


# --------------------------------------------------------------------------------------
# Agreement with the closed forms


@jax.jit
def _cotangents(theta, w, q, v_circle, v_sphere, v_orthogonal):
  """(Implicit, closed form) cotangent projections, flat, for the three geometries."""
  r = 0.7
  out = {}
  implicit, circle = circle_implicit(r), cola.Circle(r)
  th, xi = circle.point(theta, circle.init(theta))
  coordinate = circle.cotangent((th, xi), (v_circle[:9], v_circle[9:]))
  out["circle"] = (
    implicit.cotangent(implicit.point(theta, implicit.init(theta)), v_circle),
    jnp.concatenate([coordinate * xi / r, -coordinate * th / r]),
  )
  implicit, sphere = sphere_implicit(r), cola.MaxNorm(r)
  point = sphere.point(w, sphere.init(w))
  u = sphere.cotangent(point, (v_sphere[:15].reshape(3, 5), v_sphere[15:].reshape(1, 5)))
  p_w, p_xi = sphere.momentum_vector(point, u)
  out["sphere"] = (
    implicit.cotangent(implicit.point(w, implicit.init(w)), v_sphere),
    jnp.concatenate([p_w.ravel(), p_xi.ravel()]),
  )
  implicit, orthogonal = orthogonal_implicit(), cola.Orthogonal()
  out["orthogonal"] = (
    implicit.cotangent(implicit.point(q, implicit.init(q)), v_orthogonal.ravel()),
    orthogonal.cotangent(orthogonal.point(q, orthogonal.init(q)), v_orthogonal).ravel(),
  )
  return out


@pytest.mark.extended  # the closed forms' agreement; test_projection_agrees_with_orthogonal stays quick
def test_cotangent_agrees_with_circle_sphere_and_orthogonal():
  keys = jax.random.split(jax.random.key(0), 6)
  out = _cotangents(
    jax.random.uniform(keys[0], (9,), minval=-0.7, maxval=0.7),
    0.25 * jax.random.normal(keys[1], (3, 5)),  # 5 units of 3 weights, inside the ball
    random_orthonormal(keys[2], (8, 3)),
    jax.random.normal(keys[3], (18,)),
    jax.random.normal(keys[4], (20,)),
    jax.random.normal(keys[5], (8, 3)),
  )
  errors = {name: float(jnp.max(jnp.abs(got - expected))) for name, (got, expected) in out.items()}
  print("\nmax |Pi_implicit v - Pi_closed v|:", errors)
  assert max(errors.values()) <= 2e-6


@jax.jit
def _orthogonal_projections(q_n, step):
  """Implicit (Newton, quasi-Newton) and Orthogonal projections of ``Q_n + D``."""
  out = []
  for implicit in (orthogonal_implicit(), orthogonal_implicit(quasi_newton=True)):
    out.append(implicit.project(implicit.point(q_n, implicit.init(q_n)), step.ravel()))
  orthogonal = cola.Orthogonal()
  return out, orthogonal.project(orthogonal.point(q_n, orthogonal.init(q_n)), step).matrix


def test_projection_agrees_with_orthogonal():
  q_n = random_orthonormal(jax.random.key(6), (8, 3))
  step = 0.05 * jax.random.normal(jax.random.key(7), (8, 3))
  projections, expected = _orthogonal_projections(q_n, step)
  for name, got in zip(("Newton", "quasi-Newton"), projections):
    error = float(jnp.max(jnp.abs(got.x - expected)))
    print(f"\n{name}: {int(got.iterations)} iterations, max |Q - Q_orthogonal| = {error:.2e}")
    assert bool(got.converged) and int(got.iterations) >= 2
    assert error <= 2e-6
    # SHAKE along G(Q_n)^T: Q = Q_n + D - Q_n Lambda with Lambda symmetric.
    q64, q_n64, step64 = (np.asarray(a, np.float64) for a in (got.x, q_n, step))
    lam = -q_n64.T @ (q64 - q_n64 - step64)
    np.testing.assert_allclose(q64, q_n64 + step64 - q_n64 @ lam, atol=2e-6)
    np.testing.assert_allclose(lam, lam.T, atol=2e-6)
    gram = q64.T @ q64 - np.eye(3)
    assert np.max(np.abs(gram)) <= 1.5e-6


def test_circle_projection_solves_shake_exactly():
  """The circle's SHAKE equation ``|q_bar + mu q_n| = r`` in closed form, float64."""
  r = 0.5
  implicit = circle_implicit(r)
  theta = jax.random.uniform(jax.random.key(8), (64,), minval=-r, maxval=r)
  step = 0.05 * jax.random.normal(jax.random.key(9), (128,))
  point, got = jax.jit(
    lambda theta, step: (lambda point: (point, implicit.project(point, step)))(start_point(implicit, theta))
  )(theta, step)
  q_n = flat(point.x, point.slack).reshape(2, 64)
  q_bar = q_n + np.asarray(step, np.float64).reshape(2, 64)
  b = np.sum(q_bar * q_n, axis=0)
  mu = (-b + np.sqrt(b * b - r * r * (np.sum(q_bar * q_bar, axis=0) - r * r))) / (r * r)
  expected = q_bar + mu * q_n
  error = np.max(np.abs(flat(got.x, got.slack).reshape(2, 64) - expected))
  print(f"\nmax |q - q_shake| = {error:.2e}")
  assert error <= 2e-6
  # Not the radial projection of the closed form: they differ at O(|D|^2).
  radial = r * q_bar / np.linalg.norm(q_bar, axis=0)
  assert np.max(np.abs(radial - expected)) > 10 * error


@pytest.fixture
def x64():
  if not hasattr(jax, "enable_x64"):  # the context manager is new in jax 0.8 (the test extra's floor)
    pytest.skip("needs jax.enable_x64 (jax >= 0.8)")
  with jax.enable_x64(True):
    yield


def test_rattle_is_second_order_against_the_exact_rotation(x64):
  r = 1.0
  implicit, circle = circle_implicit(r, tolerance=1e-13), cola.Circle(r)

  @jax.jit
  def both(theta, v, h):
    """RATTLE and the exact rotation from (theta, xi), both as flat (q, p) in R^2n."""
    point = start_point(implicit, theta)
    th, xi = point.x, point.slack
    new, p_new = implicit.a_step(point, jnp.concatenate([v * xi / r, -v * th / r]), h)
    (th1, xi1), v1 = circle.a_step((th, xi), v, h)
    exact = (jnp.concatenate([th1, xi1]), jnp.concatenate([v1 * xi1 / r, -v1 * th1 / r]))
    return (jnp.concatenate([new.x, new.slack]), p_new), exact, new.converged

  theta = jnp.linspace(-0.9, 0.9, 8, dtype=jnp.float64)
  v = jnp.linspace(-1.5, 1.3, 8, dtype=jnp.float64)  # coordinates along (xi, -theta) / r
  errors = []
  for h in (0.2, 0.1, 0.05, 0.025):
    rattle, exact, converged = both(theta, v, h)
    assert bool(converged)
    errors.append([float(jnp.max(jnp.abs(a - b))) for a, b in zip(rattle, exact)])
  ratios = [(a[0] / b[0], a[1] / b[1]) for a, b in zip(errors, errors[1:])]
  print("\nRATTLE vs exact rotation, (position, momentum) errors:", errors, "ratios:", ratios)
  for ratio in ratios:
    assert 7.0 < ratio[0] < 9.0 and 7.0 < ratio[1] < 9.0


@pytest.mark.extended  # the closed forms' agreement; test_projection_agrees_with_orthogonal stays quick
def test_rattle_agrees_with_orthogonal():
  implicit, orthogonal = orthogonal_implicit(), cola.Orthogonal()

  @jax.jit
  def both(q, v):
    point = orthogonal.point(q, orthogonal.init(q))
    momentum = orthogonal.cotangent(point, v)
    new, p = implicit.a_step(start_point(implicit, q), momentum.ravel(), 0.1)
    expected, expected_p = orthogonal.a_step(point, momentum, 0.1)
    return new.x, p.reshape(q.shape), expected.matrix, expected_p

  q_new, p, expected_q, expected_p = both(
    random_orthonormal(jax.random.key(10), (8, 3)), jax.random.normal(jax.random.key(11), (8, 3))
  )
  np.testing.assert_allclose(q_new, expected_q, atol=2e-6)
  np.testing.assert_allclose(p, expected_p, atol=2e-5)


@pytest.mark.extended  # quick: test_projection_agrees_with_orthogonal
def test_off_manifold_start_matches_the_closed_forms():
  r = 0.5
  theta = jnp.linspace(-0.8, 0.7, 7)
  # The nearest points of the bound (Circle and MaxNorm start 1 % inside it instead, where they can move;
  # an Implicit inequality starts on it).
  np.testing.assert_allclose(circle_implicit(r).nearest(theta), jnp.clip(theta, -r, r), atol=1e-6)
  w = jax.random.normal(jax.random.key(12), (3, 5))
  norms = jnp.linalg.norm(w, axis=0)
  np.testing.assert_allclose(sphere_implicit(r).nearest(w), w * jnp.minimum(1, r / norms), atol=1e-6)
  q = 0.3 * jax.random.normal(jax.random.key(13), (8, 3))  # Q (I + Lambda) holds the polar factor
  np.testing.assert_allclose(orthogonal_implicit().nearest(q), cola.Orthogonal().nearest(q), atol=2e-6)


def _potential_grad(w):
  return 3.0 * (w - 0.2) + jnp.sin(5.0 * w)


def _run(tx, params, steps):
  def body(carry, _):
    p, s = carry
    updates, s = tx.update(jax.tree.map(_potential_grad, p), s, p)
    return (optax.apply_updates(p, updates), s), None

  return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, length=steps)[0])(params)


# Three closed forms beside their Implicit equivalents (the functions above), named as the registry names them.
CLOSED_FORMS = {"circle": cola.Circle(0.5), "max_norm": cola.MaxNorm(0.5), "orthogonal": cola.Orthogonal()}
IMPLICIT_FORMS = {
  "circle": circle_implicit(0.5),
  "max_norm": sphere_implicit(0.5),
  "orthogonal": orthogonal_implicit(),
}
START = {
  # Inside the bound: from beyond it (or at it) Circle starts 1 % inside and the Implicit inequality on the bound,
  # where it cannot move (test_off_manifold_start_matches_the_closed_forms checks those starts).
  "circle": jnp.linspace(-0.48, 0.45, 7),
  # Inside the ball: a slack that starts at exactly 0 (Implicit) or at a
  # rounding error (MaxNorm) stays on the unstable equator, or leaves it, without noise.
  "max_norm": jnp.linspace(-0.4, 0.35, 12).reshape(3, 4),
  "orthogonal": 0.5 * jax.random.normal(jax.random.key(14), (6, 3)),  # not orthonormal
}


# (method, h, steps, atol): the same time span. Orthogonality has the same SHAKE
# projection and RATTLE step in both; for the circle and sphere SHAKE's oblique
# projection differs from the radial one at O(h^2) per step, RATTLE from the
# exact rotation at O(h^3) per step.
@pytest.mark.slow  # quick: the agreements of one projection and one RATTLE step above
@pytest.mark.parametrize("method, h, steps, atol", [("od", 0.01, 200, 5e-6), ("ud", 0.02, 100, 1e-4)])
def test_trajectories_agree_with_the_closed_forms(method, h, steps, atol):
  if method == "od":
    make = lambda c: cola.cola_od(h, constraints=c)
  else:
    make = lambda c: cola.cola_ud(h, friction=1.0, constraints=c)
  p_closed, _ = _run(make(CLOSED_FORMS), START, steps)
  p_implicit, state = _run(make(IMPLICIT_FORMS), START, steps)
  residuals = cola.constraint_residuals(p_implicit, state)
  for name, constraint in CLOSED_FORMS.items():
    moved = float(jnp.max(jnp.abs(p_closed[name] - constraint.nearest(START[name]))))
    error = float(jnp.max(jnp.abs(p_implicit[name] - p_closed[name])))
    print(f"\n{name} {method}: moved {moved:.2f}, max |w_implicit - w_closed| = {error:.2e}")
    assert moved > 0.05
    assert error <= atol
    assert bool(state.constraint_states[name].converged)
    assert float(residuals[name]) <= 2e-6


# --------------------------------------------------------------------------------------
# A constraint the closed forms do not cover: zero-mean units with a fixed norm


NORM = 2.0


def zero_mean_fixed_norm(c, **kwargs):
  """Incoming weights of each unit (column of the matrix view) sum to 0; ``|W|_F = c``."""

  def equality(w):
    matrix = w.reshape(-1, w.shape[-1])
    return jnp.append(jnp.sum(matrix, axis=0), jnp.sum(matrix**2) / c**2 - 1)

  return cola.Implicit(equality=equality, **kwargs)


ZERO_MEAN = zero_mean_fixed_norm(NORM)
# The MLP 5-16-16-3 of conftest.py: a wide (5, 16) and a tall (16, 3) weight
# constrained, the middle layer and the biases free.
LAYERS = ("layer0", "layer2")
ZERO_MEAN_CONSTRAINTS = {"layer0": {"w": ZERO_MEAN, "b": None}, "layer1": None, "layer2": {"w": ZERO_MEAN, "b": None}}
LONG_METHODS = {
  "od": cola.cola_od(0.05, constraints=ZERO_MEAN_CONSTRAINTS, temperature=1e-4, key=jax.random.key(0)),
  "ud": cola.cola_ud(0.3, friction=1.0, constraints=ZERO_MEAN_CONSTRAINTS, temperature=1e-4, key=jax.random.key(0)),
}


@pytest.mark.parametrize(
  "method",
  [pytest.param(m, marks=pytest.mark.extended if m == "od" else pytest.mark.slow) for m in sorted(LONG_METHODS)],
)
def test_constraint_holds_after_many_noisy_steps(method, mlp_problem):
  params, loss = mlp_problem
  tx = LONG_METHODS[method]

  def step(carry, i):
    p, s = carry
    updates, s = tx.update(jax.grad(loss)(p, i), s, p)
    residual = jnp.max(jnp.stack(jax.tree.leaves(cola.constraint_residuals(p, s))))
    converged = jnp.all(jnp.stack([s.constraint_states[k]["w"].converged for k in LAYERS]))
    return (optax.apply_updates(p, updates), s), (loss(p, i), residual, converged)

  (params, state), (losses, residuals, converged) = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(1000)))(
    (params, tx.init(params))
  )
  assert np.all(np.isfinite(np.asarray(losses)))
  assert float(losses[-100:].mean()) < float(losses[:20].mean())  # it trains
  assert bool(jnp.all(converged))
  # Step 0 reads the initial (off-manifold) parameters; every later one is on M.
  assert float(residuals[0]) > 0.1 and float(jnp.max(residuals[1:])) <= 2e-6
  worst = {}
  for layer in LAYERS:
    w = np.asarray(params[layer]["w"], np.float64)
    worst[layer] = max(np.max(np.abs(w.sum(axis=0))), abs(np.sum(w * w) / NORM**2 - 1))
    if method == "ud":  # the momentum is a cotangent vector: Pi p = p
      p = state.momentum[layer]["w"]
      assert p.shape == (w.size,)
      tangency = jax.jit(lambda w, aux, p: jnp.max(jnp.abs(ZERO_MEAN.cotangent(ZERO_MEAN.point(w, aux), p) - p)))(
        params[layer]["w"], state.constraint_states[layer]["w"], p
      )
      assert float(tangency) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(p)))), (layer, tangency)
  print(
    f"\n{method}: final max |g| per layer (float64) {worst}, "
    f"max residual over steps 1..999 {float(jnp.max(residuals[1:])):.2e}"
  )
  assert max(worst.values()) <= 2e-6
  assert cola.constraint_residuals(params, state)["layer0"]["b"] is None


def test_project_params():
  w = jax.random.normal(jax.random.key(15), (5, 3))
  projected = cola.project_params({"w": w, "b": jnp.ones(3)}, {"w": ZERO_MEAN, "b": None})
  w1 = np.asarray(projected["w"], np.float64)
  np.testing.assert_allclose(w1.sum(axis=0), 0, atol=1e-6)
  np.testing.assert_allclose(np.sum(w1 * w1), NORM**2, rtol=1e-6)
  # Newton along G(w)^T = (column sums, 2 w) from w: w1 = alpha w + 1 beta^T.
  centred = np.asarray(w) - np.asarray(w).mean(axis=0)
  np.testing.assert_allclose(w1, NORM * centred / np.linalg.norm(centred), atol=1e-6)


def _glorot_columns(fan_in, fan_out, count):
  bound = math.sqrt(6.0 / (fan_in + fan_out))
  return jax.random.uniform(jax.random.key(0), (fan_in, count), jnp.float32, -bound, bound)


def _zero_sum_norm(r):
  return lambda u: jnp.stack([jnp.sum(u), jnp.sum(u * u) / r**2 - 1])


@pytest.mark.extended  # quick: test_project_params (Newton onto zero sum and a fixed norm)
def test_newton_converges_far_below_the_start_in_float32():
  """Glorot columns of a 784-1000 layer (norm ~0.94) onto zero sum and norm r = 0.05, and SHAKE back towards them.

  From the columns themselves (an update's start), Newton along each iterate's
  normals ``(1, 2 q / r^2)`` stays in the span of ``1`` and the column: the
  projection is the centred column scaled to norm ``r``. SHAKE's step from
  there back to the columns has a large multiplier (``G^T lambda`` cancels
  95% of the step), whose float32 rounding is ~20 ulp of the result: when
  every iterate is rebuilt from ``q_n + step + G^T lambda``, that error is
  drawn afresh each time and Newton stalls at ``max |g| ~ 1e-6``. Corrected
  from the previous iterate, it reaches the tolerance.
  """
  r = 0.05
  columns = _glorot_columns(784, 1000, 64)
  whole_leaf = cola.Implicit(equality=_zero_sum_norm(r))
  per_unit = cola.Implicit(equality=_zero_sum_norm(r), axis=0)
  centred = np.asarray(columns, np.float64) - np.asarray(columns, np.float64).mean(axis=0)
  expected = r * centred / np.linalg.norm(centred, axis=0)
  points = jax.jit(jax.vmap(lambda x: whole_leaf.point(x, whole_leaf.init(x)), in_axes=1))(columns)
  assert bool(jnp.all(points.converged))
  # Newton stops at the rounding of g: the column's sum and squared norm, n = 784 terms summed in float32 in an
  # order that depends on the CPU (n u of the largest entry, as a renormalisation).
  bound = rounding.renormalised(784) * np.max(np.abs(expected))
  np.testing.assert_allclose(points.x.T, expected, rtol=0, atol=bound)
  projected = cola.project_params(columns, per_unit)
  np.testing.assert_allclose(projected, expected, rtol=0, atol=bound)
  anchor = per_unit.point(projected, per_unit.init(projected))
  back = jax.jit(per_unit.project)(anchor, (columns - projected).ravel())
  assert bool(jnp.all(back.converged)) and float(per_unit.init(back.x).residual(back.x)) <= per_unit.tolerance
  # A noisy step from there converges too (no rejection).
  tx = cola.cola_od(1e-3, constraints=per_unit, temperature=1e-6, key=jax.random.key(1))
  grads = 0.1 * jax.random.normal(jax.random.key(2), projected.shape)
  updates, state = jax.jit(tx.update)(grads, tx.init(projected), projected)
  assert bool(state.constraint_states.converged)
  assert float(jnp.max(jnp.abs(updates))) > 1e-5
  # The step met the tolerance at its own point; apply_updates then rounds each entry by up to 3 u |x_i|, which moves
  # the sum by 3 u sum|x| and the squared norm over r^2 by 6 u.
  moved = rounding.roundings(3) * max(float(jnp.max(jnp.sum(jnp.abs(projected), axis=0))), 2.0)
  assert float(state.constraint_states.residual(projected + updates)) <= per_unit.tolerance + moved


def test_the_catalog_min_max_norm_recipe_is_keras_to_float32_rounding():
  """The catalog's ``MinMaxNorm(0.2, 0.5)`` recipe on the array of Keras' own constraints test.

  Keras rescales each column to ``w * clip(|w|, lo, hi) / (1e-7 + |w|)``; its test array has column norms
  254-313, so every column lands on ``|w| = 0.5``, 500 times shorter. Newton from the far start scales each
  column by a factor of order one per iteration, so each entry keeps float32 rounding: at most 2 ulp per
  iteration (a product and a difference) over ``max_iterations``, and the norm within ``tolerance / 2`` of the
  bound (``|g| <= tolerance`` for ``g = |w|^2 / hi^2 - 1``). Corrections along the start's own normals
  instead cancel 99.8% of each column and left 2e-4 of it (1,700 ulp) in the result.
  """
  lo, hi = 0.2, 0.5
  recipe = cola.Implicit(inequality=lambda w: jnp.stack([lo**2 - w @ w, w @ w - hi**2]) / hi**2, axis=0)
  keras_test_array = np.random.RandomState(3537).random_sample((100, 100)) * 100.0 - 50.0
  keras_test_array[0, 0] = 0.0
  w = jnp.asarray(keras_test_array, jnp.float32)
  w64 = np.asarray(w, np.float64)
  norms = np.linalg.norm(w64, axis=0)
  keras = w64 * (np.clip(norms, lo, hi) / (1e-7 + norms))
  got = np.asarray(cola.project_params(w, recipe), np.float64)
  bound = recipe.tolerance / 2 + 2 * recipe.max_iterations * np.finfo(np.float32).eps
  np.testing.assert_array_less(np.abs(got - keras), bound * np.abs(keras) + np.finfo(np.float32).tiny)


# --------------------------------------------------------------------------------------
# Invariant measures


def _chains(tx, param, grad_fn, steps, n_chains, seed):
  """The last parameter of ``n_chains`` chains from ``param``, one key each."""

  def run(key):
    state = tx.init(param)._replace(key=key)

    def body(carry, _):
      p, s = carry
      updates, s = tx.update(grad_fn(p), s, p)
      return (optax.apply_updates(p, updates), s), None

    (p, s), _ = jax.lax.scan(body, (param, state), None, length=steps)
    return p, s.constraint_states.converged

  samples, converged = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(seed), n_chains))
  assert bool(jnp.all(converged))
  return np.asarray(samples, np.float64)


def _z(values, exact):
  return (values.mean() - exact) / (values.std(ddof=1) / math.sqrt(values.size))


GAUSSIAN = {
  "quick": dict(chains=4_000, od=dict(h=0.5, steps=40), ud=dict(h=0.5, steps=80)),
  "slow": dict(chains=100_000, od=dict(h=0.5, steps=80), ud=dict(h=0.5, steps=160)),
}


# Quick: od's quick version; ud's extended, the long ones slow.
@pytest.mark.parametrize(
  "method, size",
  quick_or_extended(
    [(m, size) for size in GAUSSIAN for m in ("od", "ud")],
    {("od", "quick")},
    ids=lambda m, s: f"{m}-{s}",
    extended={("ud", "quick")},
  ),
)
def test_gaussian_on_the_zero_sum_hyperplane(method, size):
  d, tau = 5, 0.5
  a = jnp.array([1.0, -0.5, 2.0, 0.0, 0.3])
  cfg = GAUSSIAN[size][method]
  constraint = cola.Implicit(equality=jnp.sum)
  key = jax.random.key(0)
  if method == "od":
    tx = cola.cola_od(cfg["h"], constraints=constraint, temperature=tau, key=key)
    scale = tau / (1 - cfg["h"] / 2)  # Euler-Maruyama's exact variance for a unit well
  else:
    tx = cola.cola_ud(cfg["h"], friction=1.0, constraints=constraint, temperature=tau, key=key, splitting="BAOAB")
    scale = tau
  x = _chains(tx, jnp.zeros(d), lambda p: p - a, cfg["steps"], GAUSSIAN[size]["chains"], seed=1)
  np.testing.assert_allclose(x.sum(axis=1), 0, atol=1e-5)
  projector = np.eye(d) - 1 / d
  mean = projector @ np.asarray(a, np.float64)
  cov = scale * projector
  z = {}
  for i in range(d):
    z[f"x{i}"] = _z(x[:, i], mean[i])
    for j in range(i, d):
      z[f"x{i} x{j}"] = _z((x[:, i] - mean[i]) * (x[:, j] - mean[j]), cov[i, j])
  worst = max(z, key=lambda k: abs(z[k]))
  pvalues = [stats.kstest(x[:, i], stats.norm(mean[i], math.sqrt(cov[i, i])).cdf).pvalue for i in range(d)]
  print(
    f"\nzero-sum Gaussian, {method} ({size}): max |z| = {abs(z[worst]):.2f} at {worst}, min KS p = {min(pvalues):.3g}"
  )
  assert abs(z[worst]) < Z_ACCEPT
  assert min(pvalues) > ACCEPT
  # Power: the unconstrained mean a and variance scale (1 instead of 1 - 1/d)
  # are rejected, and so is the wrong discretisation: tau P for od (without
  # Euler-Maruyama's inflation), tau P / (1 - h/2) for ud.
  wrong_scale = tau if method == "od" else tau / (1 - cfg["h"] / 2)
  power = {
    "unconstrained mean": _z(x[:, 0], float(a[0])),
    "unconstrained variance": _z((x[:, 0] - mean[0]) ** 2, scale),
    "discretisation": _z((x[:, 0] - mean[0]) ** 2, wrong_scale * projector[0, 0]),
  }
  print(f"  wrong answers rejected at |z| = {power}")
  assert min(abs(v) for v in power.values()) > Z_REJECT


SPHERE = {
  "quick": dict(chains=2_000, od=dict(h=0.05, steps=100), ud=dict(h=0.25, steps=80)),
  "slow": dict(chains=40_000, od=dict(h=0.05, steps=200), ud=dict(h=0.25, steps=160)),
}


# Extended: ud's quick version (quick: the zero-sum Gaussian with od); od's and the long ones slow.
@pytest.mark.parametrize(
  "method, size",
  quick_or_extended(
    [(m, size) for m in ("od", "ud") for size in SPHERE], (), ids=lambda m, s: f"{m}-{s}", extended={("ud", "quick")}
  ),
)
def test_uniform_on_the_zero_mean_sphere(method, size):
  rows, cols, c, tau = 4, 3, 1.0, 0.25
  dim = (rows - 1) * cols  # the sphere S^{dim - 1}: slowest mode decays at tau (dim - 1) / c^2 = 2
  cfg = SPHERE[size][method]
  constraint = zero_mean_fixed_norm(c)
  key = jax.random.key(0)
  if method == "od":
    tx = cola.cola_od(cfg["h"], constraints=constraint, temperature=tau, key=key)
  else:
    tx = cola.cola_ud(cfg["h"], friction=1.0, constraints=constraint, temperature=tau, key=key)
  start_w = jnp.zeros((rows, cols)).at[0, 0].set(1.0).at[1, 0].set(-1.0)  # one point of M
  w = _chains(tx, start_w, jnp.zeros_like, cfg["steps"], SPHERE[size]["chains"], seed=2)
  np.testing.assert_allclose(np.sum(w * w, axis=(1, 2)), c * c, rtol=2e-6)
  np.testing.assert_allclose(w.sum(axis=1), 0, atol=2e-6)
  along = 1 - 1 / rows  # |P e_ij|^2
  z = {}
  for i in range(rows):
    for j in range(cols):
      z[f"w{i}{j}"] = _z(w[:, i, j], 0.0)
      z[f"w{i}{j}^2"] = _z(w[:, i, j] ** 2, c**2 * along / dim)
      z[f"w{i}{j}^4"] = _z(w[:, i, j] ** 4, 3 * c**4 * along**2 / (dim * (dim + 2)))
  z["w00 w10"] = _z(w[:, 0, 0] * w[:, 1, 0], -(c**2) / (rows * dim))
  z["w00 w01"] = _z(w[:, 0, 0] * w[:, 0, 1], 0.0)
  worst = max(z, key=lambda k: abs(z[k]))
  marginal = stats.beta((dim - 1) / 2, (dim - 1) / 2)
  t = (w / (c * math.sqrt(along)) + 1) / 2
  pvalues = [stats.kstest(t[:, i, j], marginal.cdf).pvalue for i in range(rows) for j in range(cols)]
  print(
    f"\nzero-mean sphere S^{dim - 1}, {method} ({size}): max |z| = {abs(z[worst]):.2f} at "
    f"{worst}, min KS p = {min(pvalues):.3g}"
  )
  assert abs(z[worst]) < Z_ACCEPT
  assert min(pvalues) > ACCEPT
  # Power: an entry taken as a coordinate of S^{dim - 1} (the projection
  # forgotten), and uncorrelated entries, are rejected.
  power = [_z(w[:, 2, 1] ** 2, c**2 / dim), _z(w[:, 0, 0] * w[:, 1, 0], 0.0)]
  print(f"  wrong answers rejected at |z| = {abs(power[0]):.1f}, {abs(power[1]):.1f}")
  assert min(abs(v) for v in power) > Z_REJECT


# --------------------------------------------------------------------------------------
# Projections that fail are rejected and flagged


UNIT_NORM = cola.Implicit(equality=lambda x: jnp.sum(x**2) - 1)


def test_projection_without_solution_is_rejected_and_flagged():
  x = jnp.array([0.6, 0.8, 0.0])
  # Along x, the unit sphere is out of reach of x + D with D = (0, 0, 3) perpendicular to x.
  grad = jnp.array([0.0, 0.0, -30.0])
  tx = cola.cola_od(0.1, constraints=UNIT_NORM)
  update = jax.jit(tx.update)
  state = tx.init(x)
  updates, state = update(grad, state, x)
  new = optax.apply_updates(x, updates)
  assert not bool(state.constraint_states.converged)
  assert int(state.constraint_states.iterations) <= UNIT_NORM.max_iterations
  np.testing.assert_array_equal(new, x)  # rejected: it stays at q_n
  assert float(cola.constraint_residuals(new, state)) <= 1e-6
  # A small step afterwards converges and clears the flag (it is per update).
  updates, state = update(0.1 * grad, state, new)
  assert bool(state.constraint_states.converged)
  assert float(jnp.max(jnp.abs(updates))) > 0


def test_too_few_iterations_are_flagged_and_rejected_in_the_a_step():
  x = jnp.array([0.6, 0.8, 0.0])
  grad = jnp.array([0.0, 0.0, -3.0])
  one = cola.Implicit(equality=UNIT_NORM.equality, max_iterations=1)
  for constraint, converges in ((one, False), (UNIT_NORM, True)):
    tx = cola.cola_ud(0.3, friction=1.0, constraints=constraint)
    updates, state = jax.jit(tx.update)(grad, tx.init(x), x)
    new = optax.apply_updates(x, updates)
    assert bool(state.constraint_states.converged) == converges
    assert np.all(np.isfinite(np.asarray(new))) and np.all(np.isfinite(state.momentum))
    assert float(cola.constraint_residuals(new, state)) <= 1e-6
    kicked = -0.3 * np.asarray(grad)  # O (from p = 0), then B: grad is tangent at x
    if converges:
      assert float(jnp.max(jnp.abs(new - x))) > 0.05
    else:  # rejected: stays at q_n with the momentum reversed
      np.testing.assert_array_equal(new, x)
      np.testing.assert_allclose(state.momentum, -kicked, rtol=1e-6)


def test_unreachable_manifold_is_an_error_or_a_flag():
  impossible = cola.Implicit(equality=lambda x: jnp.sum(x**2) + 1)  # no real zero
  with pytest.raises(ValueError, match="could not be projected onto the manifold"):
    impossible.nearest(jnp.ones(3))
  tx = cola.cola_od(0.1, constraints=impossible)
  x = jnp.ones(3)
  updates, state = jax.jit(tx.update)(jnp.zeros(3), tx.init(x), x)
  assert not bool(state.constraint_states.converged)
  np.testing.assert_array_equal(updates, 0)
  assert float(cola.constraint_residuals(x, state)) > 1  # reported, not hidden


@pytest.mark.extended  # quick: test_transforms.py vmaps over keys
def test_noise_under_vmap_over_keys_is_each_keys_own_draw_with_no_select_of_two_draws():
  # vmap turns a conditional with a batched predicate into a select that computes both branches. The draw is
  # written to memory by a reduction, not by a conditional: none in the program.
  constraint = cola.Implicit(equality=lambda u: jnp.stack([jnp.sum(u), jnp.sum(u * u) - 1]), axis=0)
  params = cola.project_params({"w": jax.random.normal(jax.random.key(0), (16, 8))}, constraint)
  make_tx = lambda key: cola.cola_ud(0.1, friction=1.0, constraints=constraint, temperature=1e-2, key=key)

  def update(key):
    tx = make_tx(key)
    return tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)[0]

  keys = jax.random.split(jax.random.key(1), 3)
  vmapped = jax.jit(jax.vmap(update)).lower(keys).compile()  # the program inspected is the one run
  assert " conditional(" not in vmapped.as_text()
  batched, alone = vmapped(keys), jax.jit(update)
  for i, key in enumerate(keys):  # each key's noise is the one it draws alone
    np.testing.assert_allclose(batched["w"][i], alone(key)["w"], rtol=1e-6, atol=1e-7)
