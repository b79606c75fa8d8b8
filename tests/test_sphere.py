r"""The max-norm constraint :class:`~cola_jax.MaxNorm`: ``|w_j|^2 + xi_j^2 = r^2`` per unit.

Geometry (frame, projections, the exact geodesic A step against float64
numpy), equivalence with :class:`~cola_jax.Circle` when every unit has one
weight, residuals after many noisy steps with real gradients, and the
invariant measure: with zero gradient and ``tau > 0`` each ``(w_j, xi_j) / r``
is uniform on ``S^n`` (``n`` weights per unit, the sphere in ``R^{n+1}``).

For ``x`` uniform on ``S^n`` (``x = g / |g|``, ``g`` standard normal in
``R^{n+1}``): ``E x_i^2 = 1/(n+1)``, ``E x_i^4 = 3/((n+1)(n+3))``,
``E x_i^2 x_k^2 = 1/((n+1)(n+3))`` (``i != k``), and one coordinate has the
density ``(1 - t^2)^{(n-2)/2}`` on ``[-1, 1]`` (the slice at ``t`` is an
``S^{n-1}`` of radius ``sqrt(1 - t^2)``, area ``~ (1 - t^2)^{(n-1)/2}``, times
the arc length ``dt / sqrt(1 - t^2)``): ``(t + 1)/2 ~ Beta(n/2, n/2)``, the
arcsine law for ``n = 1`` and the uniform one for ``n = 2`` (Archimedes).
``test_uniform_sphere_formulas`` checks them on exact samples.

The dynamics are rotation equivariant without a force (isotropic noise, radial
projection, exact great-circle flow), so the uniform law is exact for every
``h``; only mixing matters. With ``r = 0.5`` and ``tau = 0.25`` the od chain
is Brownian motion with generator ``tau Laplacian``, whose slowest mode decays
at ``tau n / r^2 = n`` per unit time; t = 10 (od) leaves ``exp(-10)``. ud:
``gamma = 1``, t = 20, as for the circle in ``test_invariant_measure.py``.
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
from scipy import integrate, stats

import cola_jax as cola
from cola_jax import langevin

ACCEPT = 1e-3
REJECT = 1e-6
Z_ACCEPT = 4.5
Z_REJECT = 10.0


def sphere_point(w, r, axis=None):
  c = cola.MaxNorm(r, axis=axis)
  return c, c.point(w, c.init(w))


def unit_dot(a, b, axes):
  return np.sum(a * b, axis=axes, keepdims=True)


# --------------------------------------------------------------------------------------
# Construction and errors


def test_radius_must_be_positive():
  for bad in (0.0, -1.0):
    with pytest.raises(ValueError, match="radius must be positive"):
      cola.MaxNorm(bad)


def test_axis_out_of_range_names_the_leaf():
  params = {"layer": {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}}
  tx = cola.cola_od(0.1, constraints={"layer": {"w": cola.MaxNorm(1.0, axis=2), "b": None}})
  with pytest.raises(ValueError, match=r"\['layer'\]\['w'\].*axis 2 is out of range"):
    tx.init(params)
  tx = cola.cola_ud(0.1, friction=1.0, constraints=cola.MaxNorm(1.0, axis=(0, -3)))
  with pytest.raises(ValueError, match=r"\['layer'\]\['b'\].*out of range"):
    tx.init(params)
  tx = cola.cola_od(0.1, constraints={"layer": {"w": cola.MaxNorm(1.0, axis=(0, -2)), "b": None}})
  with pytest.raises(ValueError, match=r"\['layer'\]\['w'\].*same axis twice"):
    tx.init(params)


def test_axis_must_be_integers_without_repeats():
  with pytest.raises(ValueError, match="repeats"):
    cola.MaxNorm(1.0, axis=(0, 0))
  with pytest.raises(TypeError, match="axis"):
    cola.MaxNorm(1.0, axis=1.5)
  with pytest.raises(TypeError, match="axis"):
    cola.MaxNorm(1.0, axis=True)
  assert cola.MaxNorm(1.0, axis=[0, 1]) == cola.MaxNorm(1.0, axis=(0, 1))  # hashable
  assert hash(cola.MaxNorm(1.0, axis=[0, 1])) == hash(cola.MaxNorm(1.0, axis=(0, 1)))


# axis="all": the whole leaf is one unit, |W|_F <= r.


@pytest.mark.extended  # quick: MaxNorm(axis="all") in test_catalog.py's start beyond the bound
def test_axis_all_is_one_unit_the_whole_leaf():
  c = cola.MaxNorm(2.0, axis="all")
  assert c.axis == "all" and c == cola.MaxNorm(2.0, axis="all") and hash(c) == hash(cola.MaxNorm(2.0, axis="all"))
  for bad in ("rows", "ALL", ""):
    with pytest.raises(ValueError, match=r"MaxNorm: axis must be None, an int or a tuple of ints, or 'all'"):
      cola.MaxNorm(1.0, axis=bad)
  with pytest.raises(TypeError, match="MaxNorm: axis"):
    cola.MaxNorm(1.0, axis=("all",))
  for shape in ((3, 4), (2, 2, 1, 3), (5,)):
    w = 3.0 * jax.random.normal(jax.random.key(1), shape)
    assert c.init(w).slack.shape == (1,) * len(shape)
    every = cola.MaxNorm(2.0, axis=tuple(range(len(shape))))
    np.testing.assert_allclose(c.nearest(w), every.nearest(w), rtol=1e-6)
    assert float(jnp.linalg.norm(c.nearest(w))) == pytest.approx(0.99 * 2.0, rel=1e-6)  # 1 % inside: free to move


@pytest.mark.extended  # quick: test_axes.py's per-unit ball against MaxNorm; axis="all" in test_catalog.py's start
@pytest.mark.parametrize("method", ["od", pytest.param("ud", marks=pytest.mark.slow)])  # the ball is the method's
def test_axis_all_holds_the_frobenius_ball_with_residuals(method):
  """A matrix of norm 0.5 stays where it is, one of norm 3 is scaled to norm 0.99; noisy steps keep ``|W|_F <= 1``."""
  c = cola.MaxNorm(1.0, axis="all")
  w = jax.random.normal(jax.random.key(2), (3, 4))
  w = w / jnp.linalg.norm(w)
  zero = {"w": jnp.zeros_like(w)}
  for norm, expected in ((0.5, 0.5), (3.0, 0.99)):
    tx = cola.cola_od(0.1, constraints={"w": c}) if method == "od" else cola.cola_ud(0.1, friction=1.0, constraints=c)
    params = {"w": norm * w}
    state = tx.init(params)
    updates, state = tx.update(zero, state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(params["w"], expected * w, rtol=2e-6, atol=1e-7)
    assert float(cola.constraint_residuals(params, state)["w"]) < 1e-6
  noisy = {"od": cola.cola_od, "ud": lambda h, **k: cola.cola_ud(h, friction=1.0, **k)}[method]
  tx = noisy(0.1, constraints=c, temperature=0.05, key=jax.random.key(3))
  params = {"w": 3.0 * w}
  state = tx.init(params)
  step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update({"w": -p["w"]}, s, p)))
  for _ in range(50):
    params, state = step(params, state)
  assert float(jnp.linalg.norm(params["w"])) <= 1.0
  assert float(cola.constraint_residuals(params, state)["w"]) < 1e-5
  assert float(jnp.linalg.norm(params["w"] - 3.0 * w)) > 0.1  # it moved


@pytest.mark.parametrize(
  "shape, axis, slack_shape",
  [
    ((4, 3), None, (1, 3)),  # Dense kernel: one unit per output column
    pytest.param((3, 3, 2, 4), None, (1, 1, 1, 4), marks=pytest.mark.slow),  # conv kernel: a unit per filter
    pytest.param((3, 3, 2, 4), (0, 1), (1, 1, 2, 4), marks=pytest.mark.slow),  # (the axes as for (4, 3))
    pytest.param((4, 3), 1, (4, 1), marks=pytest.mark.slow),
    pytest.param((4, 3), -1, (4, 1), marks=pytest.mark.extended),
    pytest.param((5,), None, (5,), marks=pytest.mark.extended),  # a vector: every entry its own unit (the circle)
    pytest.param((5,), 0, (1,), marks=pytest.mark.extended),
  ],
)
def test_init_puts_units_in_the_ball_with_one_slack_each(shape, axis, slack_shape):
  r = 1.0
  w = jax.random.normal(jax.random.key(0), shape)
  c = cola.MaxNorm(r, axis=axis)
  c.validate(w, "w")
  state = c.init(w)
  assert state.slack.shape == slack_shape
  axes = tuple(i for i, s in enumerate(slack_shape) if s == 1 and shape[i] != 1)
  norm = np.sqrt(unit_dot(np.asarray(w), np.asarray(w), axes))
  # Units inside 0.99 r keep their weights and get xi = sqrt(r^2 - |w|^2); the others
  # start at |w| = 0.99 r in their own direction, where the slack lets them move.
  near = c.nearest(w)
  expected = np.where(norm > 0.99 * r, np.asarray(w) / norm * 0.99 * r, np.asarray(w))
  np.testing.assert_allclose(near, expected, rtol=1e-6, atol=1e-7)
  inside = np.minimum(norm, r)
  least = inside * np.sqrt(1 - 0.99**2) / 0.99
  np.testing.assert_allclose(state.slack, np.sqrt(np.maximum(r**2 - inside**2, least**2)), atol=2e-3)
  assert float(c.init(near).residual(near)) <= 1e-6
  assert np.all(np.sqrt(unit_dot(np.asarray(near, np.float64), np.asarray(near, np.float64), axes)) <= np.float32(r))


# --------------------------------------------------------------------------------------
# Geometry


def _points_on_both_hemispheres(key, n, units, r):
  """Points of S^n (radius r): random, near both poles, on the equator."""
  g = np.asarray(jax.random.normal(key, (n + 1, units)), np.float64)
  g[:, 0] = 0.0
  g[-1, 0] = 1.0  # the pole w = 0, xi = r
  g[:, 1] = 1e-4
  g[-1, 1] = -1.0  # near the antipodal pole
  g[-1, 2] = 0.0  # the equator, xi = 0
  q = r * g / np.linalg.norm(g, axis=0)
  return jnp.asarray(q[:-1], jnp.float32), jnp.asarray(q[-1:], jnp.float32)


def test_frame_is_an_isometry_onto_the_cotangent_space():
  r, n, units = 0.7, 4, 64
  c = cola.MaxNorm(r)
  point = _points_on_both_hemispheres(jax.random.key(0), n, units, r)
  w, xi = (np.asarray(a, np.float64) for a in point)
  u = jax.random.normal(jax.random.key(1), (n, units))
  p_w, p_xi = (np.asarray(a, np.float64) for a in c.momentum_vector(point, u))
  # Tangent, and |p| = |u|.
  np.testing.assert_allclose(unit_dot(w, p_w, 0) + xi * p_xi, 0, atol=1e-6)
  np.testing.assert_allclose(unit_dot(p_w, p_w, 0) + p_xi**2, unit_dot(np.asarray(u), np.asarray(u), 0), rtol=1e-5)
  # Coordinates of the decoded vector give back u.
  np.testing.assert_allclose(c.cotangent(point, (jnp.asarray(p_w), jnp.asarray(p_xi))), u, atol=2e-6)
  # At the pole the frame is the identity on the w space.
  np.testing.assert_allclose(p_w[:, 0], np.asarray(u)[:, 0], atol=1e-7)
  assert abs(p_xi[0, 0]) < 1e-7


def test_cotangent_is_the_orthogonal_projection():
  r, n, units = 0.7, 3, 64
  c = cola.MaxNorm(r)
  point = _points_on_both_hemispheres(jax.random.key(2), n, units, r)
  w, xi = (np.asarray(a, np.float64) for a in point)
  v = jax.random.normal(jax.random.key(3), (n + 1, units))
  v_w, v_xi = v[:-1], v[-1:]
  coords = c.cotangent(point, (v_w, v_xi))
  p_w, p_xi = (np.asarray(a, np.float64) for a in c.momentum_vector(point, coords))
  # Pi v = v - (v . q) q / r^2 per unit.
  dot = unit_dot(np.asarray(v_w, np.float64), w, 0) + np.asarray(v_xi, np.float64) * xi
  np.testing.assert_allclose(p_w, np.asarray(v_w) - dot * w / r**2, atol=2e-6)
  np.testing.assert_allclose(p_xi, np.asarray(v_xi) - dot * xi / r**2, atol=2e-6)
  # The gradient enters as (g, 0): the B step kicks by its projection.
  g = jax.random.normal(jax.random.key(4), (n, units))
  kicked = langevin.b_step(c, point, jnp.zeros_like(g), g, 0.3)
  expected = c.cotangent(point, (g, jnp.zeros_like(xi)))
  np.testing.assert_allclose(kicked, -0.3 * expected, rtol=1e-6, atol=1e-7)


def _geodesic64(q, p, h, r):
  """The great-circle flow in float64, per unit (columns), q = (w; xi) stacked."""
  speed = np.linalg.norm(p, axis=0, keepdims=True)
  phi = speed * h / r
  safe = np.where(speed > 0, speed, 1.0)
  q1 = np.cos(phi) * q + np.where(speed > 0, np.sin(phi) * r * p / safe, h * p)
  p1 = np.cos(phi) * p - np.sin(phi) * speed * q / r
  return q1, p1


def test_a_step_is_the_exact_geodesic_flow():
  r, n, units, h = 0.5, 3, 64, 0.3
  c = cola.MaxNorm(r)
  point = _points_on_both_hemispheres(jax.random.key(5), n, units, r)
  scale = np.exp(np.linspace(np.log(1e-4), np.log(30.0), units)).astype(np.float32)
  u = jax.random.normal(jax.random.key(6), (n, units)) * scale
  u = u.at[:, 3].set(0.0)  # no momentum: no motion
  (w1, xi1), u1 = langevin.a_step(c, point, u, h)
  q = np.concatenate([np.asarray(a, np.float64) for a in point])
  p = np.concatenate([np.asarray(a, np.float64) for a in c.momentum_vector(point, u)])
  q1, p1 = _geodesic64(q, p, h, r)
  got_q = np.concatenate([np.asarray(w1, np.float64), np.asarray(xi1, np.float64)])
  # float32 rounds the angle phi = h |p| / r (up to ~30 here) to a few 1e-7 phi.
  phi = h * np.linalg.norm(p, axis=0) / r
  assert np.all(np.abs(got_q - q1) <= 1e-6 + 3e-7 * r * phi)
  # As for UnitNorm's flow (test_catalog): a unit of 4 on its sphere, then cos, sinc and the multiply-adds.
  np.testing.assert_allclose(np.linalg.norm(got_q, axis=0), r, rtol=rounding.renormalised(4) + rounding.roundings(10))
  got_p = np.concatenate([np.asarray(a, np.float64) for a in c.momentum_vector((w1, xi1), u1)])
  speed = np.linalg.norm(p, axis=0)
  assert np.all(np.abs(got_p - p1) <= (1e-6 + 3e-7 * phi) * np.maximum(speed, 1))
  # The speed is conserved and the momentum is tangent at the new point.
  np.testing.assert_allclose(np.linalg.norm(u1, axis=0), np.linalg.norm(u, axis=0), rtol=1e-5)
  assert np.all(np.abs(np.sum(got_p * got_q, axis=0)) <= 1e-6 * np.maximum(speed, 1))
  np.testing.assert_array_equal(got_q[:, 3], q[:, 3].astype(np.float32))
  # Time reversible.
  back, u0 = langevin.a_step(c, (w1, xi1), -u1, h)
  small = scale < 3  # (for large angles float32 rounding of phi dominates)
  np.testing.assert_allclose(np.asarray(back[0])[:, small], np.asarray(point[0])[:, small], atol=2e-6)
  np.testing.assert_allclose(-np.asarray(u0)[:, small], np.asarray(u)[:, small], atol=1e-5)


@pytest.mark.extended  # quick: test_a_step_is_the_exact_geodesic_flow
def test_a_step_speed_matches_the_momentum():
  r, h = 0.5, 1e-3
  c, point = sphere_point(jnp.array([[0.1], [-0.2], [0.3]]), r)
  u = jnp.array([[0.02], [0.5], [-0.1]])
  (w1, xi1), _ = langevin.a_step(c, point, u, h)
  (w0, xi0), _ = langevin.a_step(c, point, -u, h)  # backwards in time
  velocity = np.concatenate([np.asarray(w1 - w0), np.asarray(xi1 - xi0)]) / (2 * h)
  p = np.concatenate([np.asarray(a) for a in c.momentum_vector(point, u)])
  np.testing.assert_allclose(velocity, p, atol=5e-5)


def test_overdamped_projection_is_radial():
  r = 0.5
  c, point = sphere_point(jnp.array([[0.1, -0.3], [-0.2, 0.35], [0.3, 0.1]]), r)
  g = jnp.array([[1.0, 0.0], [0.5, -2.0], [0.0, 1.0]])
  new = langevin.overdamped_step(c, point, g, 0.1)
  moved = np.concatenate([np.asarray(point[0] - 0.1 * g), np.asarray(point[1])])
  expected = r * moved / np.linalg.norm(moved, axis=0)
  np.testing.assert_allclose(np.concatenate([np.asarray(new[0]), np.asarray(new[1])]), expected, rtol=1e-6)


# --------------------------------------------------------------------------------------
# Equivalence with the circle when every unit has one weight


def _potential_grad(w):
  return 3.0 * (w - 0.2) + jnp.sin(5.0 * w)


def _run(tx, params, steps):
  def body(carry, _):
    p, s = carry
    updates, s = tx.update(_potential_grad(p), s, p)
    return (optax.apply_updates(p, updates), s), None

  return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, length=steps)[0])(params)


EQUIVALENCE = [
  ("od", 0.0),
  ("ud", 0.0),
  ("ud", 1e-2),  # the ud noise is one normal per weight for both: same draws
]


UNIT_LAYOUTS = {"row-axis0": ((1, 7), 0), "vector": ((7,), None)}


@pytest.mark.parametrize(
  "layout, method, tau",
  quick_or_extended(  # quick: one layout, od; extended: the other layout, ud with noise
    [(layout, method, tau) for layout in UNIT_LAYOUTS for method, tau in EQUIVALENCE],
    {("row-axis0", "od", 0.0)},
    ids=lambda layout, method, tau: f"{layout}-{method}-{tau}",
    extended={("vector", "ud", 1e-2)},
  ),
)
def test_one_weight_per_unit_is_the_circle(layout, method, tau):
  shape, axis = UNIT_LAYOUTS[layout]
  r = 0.5
  w = jnp.linspace(-0.7, 0.6, 7).reshape(shape)  # one weight starts outside
  key = jax.random.key(3) if tau else None
  kwargs = dict(temperature=tau, key=key)
  if method == "od":
    make = lambda c: cola.cola_od(0.05, constraints=c, **kwargs)
  else:
    make = lambda c: cola.cola_ud(0.2, friction=1.0, constraints=c, **kwargs)
  p_circle, s_circle = _run(make(cola.Circle(r)), w, 300)
  p_sphere, s_sphere = _run(make(cola.MaxNorm(r, axis=axis)), w, 300)
  assert float(jnp.max(jnp.abs(p_circle - w))) > 0.1  # it moved
  np.testing.assert_allclose(p_sphere, p_circle, atol=2e-5)
  np.testing.assert_allclose(
    s_sphere.constraint_states.slack.reshape(shape), s_circle.constraint_states.slack, atol=2e-5
  )
  if method == "ud":  # the momenta have the same coordinates: v along (xi, -theta)/r
    np.testing.assert_allclose(s_sphere.momentum, s_circle.momentum, atol=1e-4)


# --------------------------------------------------------------------------------------
# Residuals after many noisy steps with real gradients


RADIUS = 1.0
STEPS = 2_000
KERNELS = ("conv", "tall", "wide", "square", "out")
SPHERE_CONSTRAINTS = {k: {"kernel": cola.MaxNorm(RADIUS), "bias": None} for k in KERNELS}
LONG_METHODS = {
  "od": cola.cola_od(0.05, constraints=SPHERE_CONSTRAINTS, temperature=1e-4, key=jax.random.key(0)),
  "ud": cola.cola_ud(0.3, friction=1.0, constraints=SPHERE_CONSTRAINTS, temperature=1e-4, key=jax.random.key(0)),
}


@pytest.mark.slow  # the catalog's long run stays quick
@pytest.mark.parametrize("method", sorted(LONG_METHODS))
def test_constraints_hold_after_many_noisy_steps(method, cnn_problem):
  params, loss = cnn_problem
  tx = LONG_METHODS[method]

  def step(carry, i):
    p, s = carry
    updates, s = tx.update(jax.grad(loss)(p, i), s, p)
    return (optax.apply_updates(p, updates), s), loss(p, i)

  initial_norms = {
    k: np.linalg.norm(np.asarray(params[k]["kernel"]).reshape(-1, params[k]["kernel"].shape[-1]), axis=0)
    for k in KERNELS
  }
  assert max(n.max() for n in initial_norms.values()) > RADIUS  # the bound is active
  (params, state), losses = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(STEPS)))((params, tx.init(params)))
  assert np.all(np.isfinite(np.asarray(losses)))
  assert float(losses[-200:].mean()) < float(losses[:50].mean())  # it trains

  on_boundary = 0
  for layer in KERNELS:
    w = params[layer]["kernel"]
    aux = state.constraint_states[layer]["kernel"]
    assert isinstance(aux, cola.MaxNormState)
    w64 = np.asarray(w, np.float64).reshape(-1, w.shape[-1])
    xi64 = np.asarray(aux.slack, np.float64).reshape(-1)
    norms = np.linalg.norm(w64, axis=0)
    assert np.all(norms <= np.float32(RADIUS)), (layer, norms.max())
    defect = np.max(np.abs(norms**2 + xi64**2 - RADIUS**2)) / RADIUS**2
    assert defect <= 1e-5, (layer, defect)
    on_boundary += int(np.sum(np.abs(xi64) < 0.3))
    if method == "ud":
      c = SPHERE_CONSTRAINTS[layer]["kernel"]
      u = state.momentum[layer]["kernel"]
      assert u.shape == w.shape
      p_w, p_xi = c.momentum_vector((w, aux.slack), u)
      tangency = float(
        jnp.max(jnp.abs(jnp.sum(w * p_w, axis=tuple(range(w.ndim - 1))) + p_xi.reshape(-1) * aux.slack.reshape(-1)))
      )
      assert tangency <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(u)))), (layer, tangency)
  assert on_boundary > 0  # some units near the bound |w_j| = r
  residuals = cola.constraint_residuals(params, state)
  assert max(float(r) for r in jax.tree.leaves(residuals)) <= 1e-5
  assert residuals["conv"]["bias"] is None


def test_project_params_and_residuals(cnn_problem):
  params = jax.tree.map(lambda a: 3 * a, cnn_problem[0])
  projected = cola.project_params(params, SPHERE_CONSTRAINTS)
  for layer in KERNELS:
    w = np.asarray(projected[layer]["kernel"], np.float64)
    assert np.linalg.norm(w.reshape(-1, w.shape[-1]), axis=0).max() <= RADIUS
  np.testing.assert_array_equal(projected["conv"]["bias"], params["conv"]["bias"])


# --------------------------------------------------------------------------------------
# Invariant measure: uniform on S^n without a force


def _marginal_cdf(n):
  """CDF of one coordinate of the uniform law on S^n (in R^{n+1})."""
  return lambda t: stats.beta.cdf((np.clip(t, -1, 1) + 1) / 2, n / 2, n / 2)


def _uniform_cdf(t):
  return np.clip((t + 1) / 2, 0, 1)


def _sphere_moments(x, n):
  """name -> (values, exact) for the coordinates x (n + 1, N) of points of S^n."""
  d = n + 1
  out = {}
  for i in range(d):
    out[f"x{i}"] = (x[i], 0.0)
    out[f"x{i}^2"] = (x[i] ** 2, 1 / d)
    out[f"x{i}^4"] = (x[i] ** 4, 3 / (d * (d + 2)))
  if d >= 2:
    out["x0^2 x_last^2"] = (x[0] ** 2 * x[-1] ** 2, 1 / (d * (d + 2)))
    out["x0 x_last"] = (x[0] * x[-1], 0.0)
  return out


def _z_scores(statistics):
  """z = (mean - exact) / s.e. for i.i.d. samples (each row a statistic)."""
  return {
    name: (values.mean() - exact) / (values.std(ddof=1) / math.sqrt(values.size))
    for name, (values, exact) in statistics.items()
  }


@pytest.mark.parametrize(
  "n", [pytest.param(n, marks=pytest.mark.extended if n == 3 else pytest.mark.slow) for n in (1, 2, 3, 6)]
)
def test_uniform_sphere_formulas(n):  # extended: S^3, the sphere the extended sampling test draws
  """The moments and the Beta(n/2, n/2) marginal hold for exact uniform samples."""
  g = np.random.default_rng(n).standard_normal((n + 1, 200_000))
  x = g / np.linalg.norm(g, axis=0)
  z = _z_scores(_sphere_moments(x, n))
  assert max(abs(v) for v in z.values()) < Z_ACCEPT, z
  for i in range(n + 1):
    assert stats.kstest(x[i], _marginal_cdf(n)).pvalue > ACCEPT
  # The Beta CDF is the integral of the density (1 - t^2)^{(n-2)/2}.
  if n >= 2:
    density = lambda t: (1 - t * t) ** ((n - 2) / 2)
    total = integrate.quad(density, -1, 1)[0]
    for t in (-0.7, -0.1, 0.3, 0.9):
      assert abs(integrate.quad(density, -1, t)[0] / total - _marginal_cdf(n)(t)) < 1e-8


# (leaf shape, axis): n = 1 (one weight per unit: the circle's arcsine law),
# n = 3 (a Dense-like column), n = 4 (a conv-like kernel, two reduced axes).
SHAPES = {1: ((1,), 0), 3: ((3,), None), 4: ((2, 2), None)}
SPHERE_FREE = {
  "quick": dict(r=0.5, tau=0.25, gamma=1.0, units=20_000, od=dict(h=0.01, steps=1_000), ud=dict(h=0.05, steps=400)),
  "slow": dict(r=0.5, tau=0.25, gamma=1.0, units=400_000, od=dict(h=0.01, steps=2_000), ud=dict(h=0.05, steps=800)),
}
# Extended: the Dense-like column at the small size with CoLA-ud (quick: a unit of one weight is the circle,
# whose law test_invariant_measure.py samples); slow: CoLA-od's, and every shape at the large size.
CASES = quick_or_extended(
  [(method, 3, "quick") for method in ("od", "ud")]
  + [(method, n, "slow") for n in sorted(SHAPES) for method in ("od", "ud")],
  (),
  ids=lambda method, n, size: f"{method}-{n}-{size}",
  extended={("ud", 3, "quick")},
)


def _free_samples(method, cfg, n, steps, seed):
  """(n + 1, units) coordinates (w_j, xi_j) / r after ``steps`` steps from w = 0."""
  unit_shape, axis = SHAPES[n]
  r = cfg["r"]
  constraint = cola.MaxNorm(r, axis=axis)
  key = jax.random.key(seed)
  if method == "od":
    tx = cola.cola_od(cfg["h"], constraints=constraint, temperature=cfg["tau"], key=key)
  else:
    tx = cola.cola_ud(cfg["h"], friction=cfg["gamma"], constraints=constraint, temperature=cfg["tau"], key=key)

  def body(carry, _):
    params, state = carry
    updates, state = tx.update(jnp.zeros_like(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  @jax.jit
  def run(params):
    (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return params, state.constraint_states.slack

  w, xi = run(jnp.zeros(unit_shape + (cfg["units"],), jnp.float32))
  assert w.dtype == jnp.float32
  w = np.asarray(w, np.float64).reshape(n, -1)
  xi = np.asarray(xi, np.float64).reshape(1, -1)
  x = np.concatenate([w, xi]) / r
  np.testing.assert_allclose(np.sum(x * x, axis=0), 1.0, rtol=1e-5)
  return x


def _config(size, method):
  cfg = {k: v for k, v in SPHERE_FREE[size].items() if k not in ("od", "ud")}
  cfg.update(SPHERE_FREE[size][method])
  return cfg


@pytest.mark.parametrize("method, n, size", CASES)
def test_without_force_samples_the_uniform_law_on_the_sphere(method, n, size):
  cfg = _config(size, method)
  x = _free_samples(method, cfg, n, cfg["steps"], seed=100 * n + 7)
  print(f"\nsphere S^{n}, zero gradient, {method} ({size}): {cfg}")
  z = _z_scores(_sphere_moments(x, n))
  worst = max(z, key=lambda k: abs(z[k]))
  print(f"  {len(z)} moments, max |z| = {abs(z[worst]):.2f} at {worst}")
  assert abs(z[worst]) < Z_ACCEPT
  for i in range(n + 1):
    result = stats.kstest(x[i], _marginal_cdf(n))
    print(f"  KS x{i} vs Beta({n}/2, {n}/2): D = {result.statistic:.5f}, p = {result.pvalue:.3g}")
    assert result.pvalue > ACCEPT
  assert x[-1].min() < -0.9  # the slack takes both signs: the whole sphere is visited

  # Power: the uniform law on [-1, 1] and the marginal of the sphere one
  # dimension up are rejected on the same samples...
  assert stats.kstest(x[0], _uniform_cdf).pvalue < REJECT
  assert stats.kstest(x[0], _marginal_cdf(n + 1)).pvalue < REJECT
  # ... and so is a chain stopped early (t = 0.2 od, 0.5 ud), still near the pole.
  early = _free_samples(method, cfg, n, 20 if method == "od" else 10, seed=100 * n + 7)
  z = _z_scores(_sphere_moments(early, n))
  assert max(abs(v) for v in z.values()) > Z_REJECT
