r"""The catalog constraints :class:`~cola_jax.Box`, :class:`~cola_jax.NonNegative`, :class:`~cola_jax.UnitNorm`.

Geometry against float64 references, residuals after 10k noisy steps with real
gradients, equivalences (``Box(-r, r)`` is ``Circle(r)`` bit for bit; a
shifted box is the shifted circle; ``UnitNorm`` is the dense
``Implicit(equality=|w_j|^2 / r^2 - 1)``), and the invariant measures with
fixed keys:

* ``Box(l, u)``, zero gradient: the arcsine law between the bounds,
  ``(w - c) / r = sin(phi)`` with ``phi`` uniform, exact for every ``h`` (the
  circle's rotation invariance). ``E x^2 = 1/2`` for the arcsine law, ``1/3``
  for the uniform one.
* ``UnitNorm``, zero gradient: each unit ``w_j / r`` uniform on ``S^{n-1}``,
  one coordinate ``(x + 1) / 2 ~ Beta((n-1)/2, (n-1)/2)``, ``E x^2 = 1/n``,
  ``E x^4 = 3 / (n (n + 2))``; exact for every ``h`` (rotation invariance).
* ``NonNegative`` with ``V = k (w - c)^2 / 2``: the density
  ``exp(-V/tau) sqrt(1 + 4w) / sqrt(w)`` derived in ``non_negative.py`` (the
  arc length of the parabola ``w = s^2``, both branches of ``s``). Its CDF is
  computed in ``s``, where the integrand is smooth. The step-size bias is
  O(h); the step sizes keep it below the KS noise (measured: KS distance
  0.008 at od ``h = 0.01``, 0.005 at ud ``h = 0.05``, n = 2e4; the wrong laws
  are at 0.06-0.09).

Each statistical test also rejects wrong answers on its own samples (the
uniform law between the bounds, the law one dimension up, the density without
the arc-length factor ``sqrt(1 + 4w)``, ``exp(-V/tau)`` on ``w >= 0``).
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
from _cases import quick_or_extended, quick_or_slow
from scipy import stats

import cola_jax as cola
from cola_jax import langevin

ACCEPT = 1e-3
REJECT = 1e-6
Z_ACCEPT = 4.5
Z_REJECT = 10.0


def _transform(method, h, constraints, tau=0.0, key=None, gamma=1.0):
  kwargs = dict(temperature=tau, key=key) if tau else {}
  if method == "od":
    return cola.cola_od(h, constraints=constraints, **kwargs)
  splitting = "BAOAB" if method == "baoab" else "OBA"
  return cola.cola_ud(h, friction=gamma, constraints=constraints, splitting=splitting, **kwargs)


def _run(tx, params, steps, grad_fn):
  """(params, state) after ``steps`` updates with gradients ``grad_fn(params)``, one jit."""

  def body(carry, _):
    p, s = carry
    updates, s = tx.update(grad_fn(p), s, p)
    return (optax.apply_updates(p, updates), s), None

  return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, length=steps)[0])(params)


# --------------------------------------------------------------------------------------
# Construction and bad input


def test_box_hyperparameters_are_checked():
  with pytest.raises(ValueError, match="lower must be below upper"):
    cola.Box(1.0, 0.5)
  with pytest.raises(ValueError, match="lower must be below upper"):
    cola.Box(0.5, 0.5)
  with pytest.raises(ValueError, match="lower must be finite"):
    cola.Box(-math.inf, 1.0)
  with pytest.raises(ValueError, match="upper must be finite"):
    cola.Box(0.0, math.nan)
  with pytest.raises(ValueError, match="upper - lower must be finite"):
    cola.Box(-1e308, 1e308)
  with pytest.raises(ValueError, match="lower must be a scalar.*per-entry bounds are not supported"):
    cola.Box(jnp.zeros(3), 1.0)
  with pytest.raises(TypeError, match="upper must be a number"):
    cola.Box(0.0, "1")
  assert cola.Box(0, 1) == cola.Box(0.0, 1.0) and hash(cola.Box(0, 1)) == hash(cola.Box(0.0, 1.0))


def test_unit_norm_hyperparameters_and_axes_are_checked():
  for bad in (0.0, -1.0, math.inf, math.nan):
    with pytest.raises(ValueError, match="UnitNorm: radius must be positive and finite"):
      cola.UnitNorm(bad)
  with pytest.raises(TypeError, match="UnitNorm: axis must be None, an int or a tuple"):
    cola.UnitNorm(axis=1.5)
  with pytest.raises(ValueError, match="UnitNorm: axis .* repeats"):
    cola.UnitNorm(axis=(0, 0))
  assert cola.UnitNorm(axis=[0, 1]) == cola.UnitNorm(axis=(0, 1))
  params = {"layer": {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}}
  with pytest.raises(
    ValueError,
    match=r"UnitNorm constraint on the leaf at \['layer'\]\['w'\].*"
    r"axis 2 is out of range",
  ):
    cola.cola_od(0.1, constraints={"layer": {"w": cola.UnitNorm(axis=2), "b": None}}).init(params)
  # A bias under the default axis: units of one entry, |b_i| = r leaves only +-r.
  with pytest.raises(ValueError, match=r"leaf at \['layer'\]\['b'\].*1 entry.*axis=0 for a vector"):
    cola.cola_ud(0.1, friction=1.0, constraints=cola.UnitNorm()).init(params)
  cola.cola_ud(0.1, friction=1.0, constraints={"layer": {"w": cola.UnitNorm(), "b": cola.UnitNorm(axis=0)}}).init(
    params
  )


@pytest.mark.extended  # quick: test_hyperspherical.py's steps on UnitNorm(axis="all") spheres
def test_unit_norm_axis_all_is_the_frobenius_sphere():
  """``axis="all"``: the whole leaf is one unit, ``|W|_F = r``, through noisy steps with a force."""
  c = cola.UnitNorm(2.0, axis="all")
  assert c.axis == "all" and c == cola.UnitNorm(2.0, axis="all") and hash(c) == hash(cola.UnitNorm(2.0, axis="all"))
  with pytest.raises(ValueError, match=r"UnitNorm: axis must be None, an int or a tuple of ints, or 'all', got 'rows'"):
    cola.UnitNorm(axis="rows")
  with pytest.raises(ValueError, match=r"leaf at \['b'\].*1 entry"):  # a one-entry leaf has no sphere to move on
    cola.cola_od(0.1, constraints={"w": None, "b": c}).init({"w": jnp.ones(3), "b": jnp.ones(1)})
  w = jax.random.normal(jax.random.key(4), (3, 4))
  near = c.nearest(w)
  np.testing.assert_allclose(near, 2.0 * w / jnp.linalg.norm(w), rtol=2e-6)
  np.testing.assert_allclose(near, cola.UnitNorm(2.0, axis=(0, 1)).nearest(w), rtol=1e-6)
  assert c.init(w).axes == (0, 1)
  tx = cola.cola_ud(0.1, friction=1.0, constraints={"w": c}, temperature=0.05, key=jax.random.key(5))
  params = {"w": w}
  state = tx.init(params)
  step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update({"w": p["w"] - 1.0}, s, p)))
  for _ in range(50):
    params, state = step(params, state)
  assert float(jnp.linalg.norm(params["w"])) == pytest.approx(2.0, rel=1e-5)  # the (3, 4) matrix at norm 2
  assert float(cola.constraint_residuals(params, state)["w"]) < 1e-5
  assert float(jnp.max(jnp.abs(params["w"] - near))) > 0.1  # it moved on the sphere


def test_nearest_points():
  w = jnp.array([-1.0, -0.2, 0.0, 0.3, 0.9, 2.0])
  # Entries more than 1 % of the half-width r = 0.3 inside stay (to rounding); the others start 0.01 r inside.
  expected = np.clip(np.asarray(w), -0.1 + 0.003, 0.5 - 0.003)
  np.testing.assert_allclose(cola.Box(-0.1, 0.5).nearest(w), expected, atol=3e-8)
  # NonNegative: a weight at or below 0 starts where the parabola's tangent is as steep as the circle's at 0.99 r.
  lifted = np.where(np.asarray(w) <= 0, (math.sqrt(1 - 0.99**2) / 0.99 / 2) ** 2, np.asarray(w))
  np.testing.assert_allclose(cola.NonNegative().nearest(w), lifted, rtol=1e-6)
  state = cola.NonNegative().init(w)
  np.testing.assert_allclose(state.slack, np.sqrt(lifted), rtol=1e-6)
  slack = np.asarray(state.slack, np.float64)  # 2 s / sqrt(1 + 4 s^2) = sqrt(1 - 0.99^2) at the lifted start
  np.testing.assert_allclose(2 * slack[:3] / np.sqrt(1 + 4 * slack[:3] ** 2), math.sqrt(1 - 0.99**2), rtol=1e-6)
  kernel = jnp.array([[3.0, 0.0, -1.0], [4.0, 0.0, 1e-30]])  # a zero column, a tiny one
  near = np.asarray(cola.UnitNorm(2.0).nearest(kernel), np.float64)
  np.testing.assert_allclose(near[:, 0], [1.2, 1.6], rtol=1e-6)
  np.testing.assert_allclose(near[:, 1], [math.sqrt(2.0)] * 2, rtol=1e-6)  # r (1, 1) / sqrt(2)
  np.testing.assert_allclose(np.linalg.norm(near, axis=0), 2.0, rtol=1e-6)
  assert cola.UnitNorm(2.0).init(kernel).axes == (0,)


# --------------------------------------------------------------------------------------
# NonNegative: the geometry against float64


def _nearest_on_parabola64(a, b):
  """The nearest point ``(s^2, s)`` to ``(a, b)``, float64: the largest root of the cubic."""
  s = np.empty_like(a)
  for i, (ai, bi) in enumerate(zip(a, b)):
    roots = np.roots([2.0, 0.0, 1.0 - 2.0 * ai, -abs(bi)])
    t = max(r.real for r in roots if abs(r.imag) <= 1e-9 * max(1.0, abs(r.real)))
    s[i] = math.copysign(t, bi)
  return s


@pytest.mark.parametrize("scale", [1e-3, *(pytest.param(s, marks=pytest.mark.extended) for s in (0.1, 1.0, 30.0)), 1e6])
def test_non_negative_projection_is_the_nearest_point(scale):
  """Five Newton iterations reach float32 rounding for steps of every size."""
  rng = np.random.default_rng(int(math.log10(scale)) + 10)
  n = 2_000
  s0 = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 2, n))).astype(np.float32)
  step = (rng.standard_normal((2, n)) * scale).astype(np.float32)
  c = cola.NonNegative()
  anchor = c.point(jnp.asarray(s0 * s0), c.init(jnp.asarray(s0 * s0))._replace(slack=jnp.asarray(s0)))
  w1, s1 = c.project(anchor, (jnp.asarray(step[0]), jnp.asarray(step[1])))
  a = np.asarray(anchor[0], np.float64) + step[0]  # the moved point, as float32 sums
  b = np.asarray(anchor[1], np.float64) + step[1]
  a, b = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
  exact = _nearest_on_parabola64(a, b)
  error = np.abs(np.asarray(s1, np.float64) - exact) / np.maximum(np.abs(exact), 1.0)
  assert np.max(error) <= 5e-7, np.max(error)  # ~4 float32 ulps of max(|s|, 1)
  np.testing.assert_array_equal(w1, s1 * s1)  # on the parabola by construction
  assert np.all(np.asarray(w1) >= 0)
  # The nearest point: the residual (a, b) - q is normal to the parabola, along (1, -2s).
  s = np.asarray(s1, np.float64)
  tangential = (a - s * s) * 2 * s + (b - s)
  assert np.max(np.abs(tangential) / np.maximum(np.abs(s), 1) ** 3) <= 1e-5 * max(scale, 1)


def _parabola_point(s):
  c = cola.NonNegative()
  s = jnp.asarray(s, jnp.float32)
  return c, c.point(s * s, c.init(s * s)._replace(slack=s))


def _arc_length64(s):
  return 0.5 * s * np.sqrt(1 + 4 * s * s) + 0.25 * np.arcsinh(2 * s)


def _geodesic64(s0, v, h):
  """The exact free flight on the parabola: arc length h v along (2s, 1), by bisection."""
  target = _arc_length64(s0) + h * v
  lo, hi = np.full_like(s0, -1e3), np.full_like(s0, 1e3)
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    below = _arc_length64(mid) < target
    lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
  return 0.5 * (lo + hi)


def test_non_negative_rattle_step():
  """The closed-form multiplier solves RATTLE's equations (float64, to rounding)."""
  s0 = np.array([-1.3, -0.4, -0.05, 0.0, 0.02, 0.3, 0.8, 2.5])
  v = np.array([0.4, -1.0, 0.7, 0.5, -0.3, -0.9, 1.2, -2.0])
  h = 0.1
  c = cola.NonNegative()
  with jax.enable_x64(True):
    point = (jnp.asarray(s0**2), jnp.asarray(s0))
    (w1, s1), v1 = langevin.a_step(c, point, jnp.asarray(v), h)
    (_, back), v_back = langevin.a_step(c, (w1, s1), -v1, h)
  s1, v1 = np.asarray(s1), np.asarray(v1)
  np.testing.assert_array_equal(w1, s1 * s1)
  # SHAKE: q1 - q0 - h p0 is along the normal (1, -2 s0) at the start.
  n0 = np.sqrt(1 + 4 * s0**2)
  d = np.stack([s1**2 - s0**2, s1 - s0]) - h * np.stack([2 * s0 * v / n0, v / n0])
  np.testing.assert_allclose(d[1], -2 * s0 * d[0], atol=1e-14)
  assert np.max(np.abs(d)) > 1e-4  # the multiplier is not zero
  # RATTLE's momentum: the tangential part of (q1 - q0) / h at q1.
  n1 = np.sqrt(1 + 4 * s1**2)
  np.testing.assert_allclose(v1, (2 * s1 * (s1**2 - s0**2) + (s1 - s0)) / (h * n1), rtol=1e-12)
  # Time reversible.
  np.testing.assert_allclose(back, s0, atol=1e-14)
  np.testing.assert_allclose(-np.asarray(v_back), v, rtol=1e-12)


def test_non_negative_rattle_keeps_float32_digits_for_huge_momenta():
  """A momentum of 1e29 moves the slack to 1e14 in float32 as in float64 (``p_s - 2 s mu`` cancelled to 5e20)."""
  s0 = np.array([-0.7, 0.05, 0.73, 2.0, 0.73, -1.3], np.float32)
  v = np.array([1e29, -1e29, 1e29, 1e20, 1e10, -1e25], np.float32)
  c = cola.NonNegative()
  (w32, s32), v32 = jax.jit(c.a_step)((jnp.asarray(s0 * s0), jnp.asarray(s0)), jnp.asarray(v), 0.1)
  with jax.enable_x64(True):
    s64 = s0.astype(np.float64)
    (w64, s64), v64 = c.a_step((jnp.asarray(s64 * s64), jnp.asarray(s64)), jnp.asarray(v, np.float64), 0.1)
  for got, want in ((w32, w64), (s32, s64), (v32, v64)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@pytest.mark.parametrize(
  "tx, start, grad, dtype, steps",
  [
    # 2.5e10 stepped to 5.8e7 lands on 0 in bfloat16 (its spacing there is 1.3e8).
    (cola.cola_ud(1e-4, friction=0.0, constraints=cola.NonNegative(), splitting="BAOAB"), -0.5, 1e19, "bfloat16", 2),
    # 1e8 stepped to 292 lands on 296 in float32 (spacing 8): 1.3e-2 of the new weight.
    pytest.param(
      cola.cola_od(1.0, constraints=cola.NonNegative()), 1e8, 1e8 - 1.5, "float32", 1, marks=pytest.mark.extended
    ),
  ],
  ids=["cola_ud-bfloat16", "cola_od-float32"],
)
def test_non_negative_slack_agrees_with_the_weight_apply_updates_rounded(tx, start, grad, dtype, steps):
  """``params + updates`` rounds relative to the old weight: the state's slack is the rounded weight's, on its
  branch, so the residual reads the slack's rounding, not the step's."""
  grads = jnp.asarray(grad, dtype)

  @jax.jit
  def run(params):
    state = tx.init(params)
    for _ in range(steps):
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  params, state = run(jnp.asarray(start, dtype))
  slack = state.constraint_states.slack
  assert float(params) >= 0
  np.testing.assert_allclose(float(slack) ** 2, float(params), rtol=1e-6, atol=0)
  assert float(cola.constraint_residuals(params, state)) <= 1e-6


@pytest.mark.extended  # quick: test_non_negative_rattle_step (RATTLE's equations solved to rounding)
def test_non_negative_rattle_is_second_order():
  """Against the exact free flight (arc length h v), the one-step error falls 8x per halving."""
  s0 = np.linspace(-1.5, 1.5, 13)
  v = np.linspace(1.0, -0.6, 13)
  errors = []
  for h in (0.08, 0.04, 0.02):
    with jax.enable_x64(True):
      c = cola.NonNegative()
      point = (jnp.asarray(s0**2), jnp.asarray(s0))
      (_, s1), _ = c.a_step(point, jnp.asarray(v), h)
    errors.append(np.max(np.abs(np.asarray(s1) - _geodesic64(s0, v, h))))
  print("\nRATTLE one-step errors at h = 0.08, 0.04, 0.02:", errors)
  assert 6.5 < errors[0] / errors[1] < 9.5 and 6.5 < errors[1] / errors[2] < 9.5


def test_non_negative_rattle_without_solution_is_rejected_and_reversed():
  # h s v < -n^3 / 8: heading for the vertex faster than the curve bends.
  s0 = np.array([1.0, 1.0], np.float32)
  v = np.array([-3.0, -1.0], np.float32)  # h s v = -3, -1 against -n^3/8 = -1.40
  c, point = _parabola_point(s0)
  (w1, s1), v1 = c.a_step(point, jnp.asarray(v), 1.0)
  assert float(s1[0]) == 1.0 and float(w1[0]) == 1.0 and float(v1[0]) == 3.0
  assert float(s1[1]) < 1.0 and float(v1[1]) < 0  # solvable: it moves on
  np.testing.assert_allclose(w1, s1 * s1)


@pytest.mark.extended  # quick: test_conformance.py's NonNegative case (its cotangent projection)
def test_non_negative_b_step_and_noise_are_tangential():
  s = np.array([-0.7, 0.05, 0.4], np.float32)  # (at s = 0 the point is lifted: NonNegative.START)
  c, point = _parabola_point(s)
  g = jnp.array([2.0, -1.0, 0.5])
  kicked = langevin.b_step(c, point, jnp.zeros(3), g, 0.3)
  # p = v (2s, 1) / n: the gradient (g, 0) projects to 2 s g / n.
  np.testing.assert_allclose(kicked, -0.3 * 2 * s * np.asarray(g) / np.sqrt(1 + 4 * s**2), rtol=1e-6)
  # The cotangent projection is orthogonal: idempotent on the unit tangent.
  t = (2 * s / np.sqrt(1 + 4 * s**2), 1 / np.sqrt(1 + 4 * s**2))
  np.testing.assert_allclose(c.cotangent(point, (jnp.asarray(t[0]), jnp.asarray(t[1]))), 1.0, rtol=1e-6)
  normal = (jnp.asarray(1 / np.sqrt(1 + 4 * s**2)), jnp.asarray(-2 * s / np.sqrt(1 + 4 * s**2)))
  # Zero in exact arithmetic: the normal's float32 rounding (u a component) and three roundings, terms at most 1.
  np.testing.assert_allclose(c.cotangent(point, normal), 0.0, atol=rounding.roundings(8))


# Extended; quick: test_non_negative_projection_is_the_nearest_point at scale 1e6, and test_reliability.py's NaN and
# inf planted in a NonNegative gradient.
@pytest.mark.extended
def test_non_negative_extreme_steps_stay_on_the_parabola_or_show_nan():
  c = cola.NonNegative()
  w = jnp.array([0.0, 0.5, 2.0, 1e6, 0.3, 0.3], jnp.float32)
  g = jnp.array([1e30, -1e30, 1e25, -1e20, jnp.inf, jnp.nan], jnp.float32)
  point = c.point(w, c.init(w))
  w1, s1 = langevin.overdamped_step(c, point, g, 0.1)
  finite = np.isfinite(np.asarray(g))
  assert np.all(np.isfinite(np.asarray(w1))[finite])
  assert np.all(np.asarray(w1)[finite] >= 0)
  np.testing.assert_array_equal(np.asarray(w1)[finite], np.asarray(s1 * s1)[finite])
  np.testing.assert_allclose(float(w1[1]), 0.1 * 1e30, rtol=1e-6)  # pushed up: w = a - 1/2
  assert float(w1[0]) < 1e-30  # pushed down: to the vertex
  assert np.all(np.isnan(np.asarray(w1)[~finite]))  # a non-finite gradient shows


# --------------------------------------------------------------------------------------
# UnitNorm: the geometry against float64


def test_unit_norm_a_step_is_the_great_circle():
  r, h = 0.7, 0.3
  c = cola.UnitNorm(r)
  w = c.nearest(jax.random.normal(jax.random.key(0), (4, 32)))
  scale = np.exp(np.linspace(np.log(1e-3), np.log(20.0), 32)).astype(np.float32)
  u = c.cotangent(w, jax.random.normal(jax.random.key(1), (4, 32)) * scale)
  u = u.at[:, 0].set(0.0)
  w1, u1 = langevin.a_step(c, w, u, h)
  w64, u64 = np.asarray(w, np.float64), np.asarray(u, np.float64)
  speed = np.linalg.norm(u64, axis=0)
  phi = h * speed / r
  safe = np.where(speed > 0, speed, 1.0)
  expected_w = np.cos(phi) * w64 + np.sin(phi) * r * u64 / safe
  expected_u = np.cos(phi) * u64 - np.sin(phi) * speed * w64 / r
  assert np.all(np.abs(np.asarray(w1) - expected_w) <= 1e-6 + 3e-7 * r * phi)
  assert np.all(np.abs(np.asarray(u1) - expected_u) <= (1e-6 + 3e-7 * phi) * np.maximum(speed, 1))
  # The start is renormalised (columns of 4); the flow rounds cos, sinc and the multiply-adds, and the momentum is
  # tangent to 4 u |w| |u|: not renormalised after the step.
  np.testing.assert_allclose(
    np.linalg.norm(np.asarray(w1, np.float64), axis=0), r, rtol=rounding.renormalised(4) + rounding.roundings(10)
  )
  np.testing.assert_allclose(np.sum(np.asarray(w1) * np.asarray(u1), axis=0), 0, atol=1e-6 * max(1, speed.max()))
  np.testing.assert_array_equal(w1[:, 0], w[:, 0])  # no momentum: no motion


def test_unit_norm_projections():
  r = 0.5
  c = cola.UnitNorm(r, axis=(0, 1))  # a conv kernel's filters
  w = c.nearest(jax.random.normal(jax.random.key(2), (3, 3, 2)))
  step = 0.1 * jax.random.normal(jax.random.key(3), w.shape)
  moved = np.asarray(w + step, np.float64)
  expected = r * moved / np.sqrt(np.sum(moved**2, axis=(0, 1), keepdims=True))
  np.testing.assert_allclose(c.project(w, step), expected, rtol=1e-6, atol=1e-7)
  v = np.asarray(jax.random.normal(jax.random.key(4), w.shape), np.float64)
  w64 = np.asarray(w, np.float64)
  dot = np.sum(w64 * v, axis=(0, 1), keepdims=True)
  np.testing.assert_allclose(c.cotangent(w, jnp.asarray(v, jnp.float32)), v - dot * w64 / r**2, atol=1e-6)


# --------------------------------------------------------------------------------------
# Equivalences


def _potential_grad(w):
  return 3.0 * (w - 0.2) + jnp.sin(5.0 * w)


@pytest.mark.parametrize(
  "method", [pytest.param(m, marks=() if m == "ud" else pytest.mark.extended) for m in ("od", "ud", "baoab")]
)
def test_symmetric_box_is_the_circle_bit_for_bit(method):
  r = 0.5
  w = jnp.linspace(-0.7, 0.6, 64)  # some start outside
  make = lambda c: _transform(method, 0.05 if method == "od" else 0.2, c, 1e-2, jax.random.key(3))
  p_circle, s_circle = _run(make(cola.Circle(r)), w, 100, _potential_grad)
  p_box, s_box = _run(make(cola.Box(-r, r)), w, 100, _potential_grad)
  assert float(jnp.max(jnp.abs(p_circle - w))) > 0.3  # it moved
  np.testing.assert_array_equal(p_box, p_circle)
  np.testing.assert_array_equal(s_box.constraint_states.slack, s_circle.constraint_states.slack)
  if method != "od":
    np.testing.assert_array_equal(s_box.momentum, s_circle.momentum)


@pytest.mark.parametrize("method", ["od", pytest.param("ud", marks=pytest.mark.extended)])
def test_shifted_box_is_the_shifted_circle(method):
  lower, upper = 0.3, 1.3
  center, r = 0.8, 0.5
  w = jnp.linspace(-0.7, 0.6, 64)
  make = lambda c: _transform(method, 0.05 if method == "od" else 0.2, c, 1e-2, jax.random.key(4))
  p_circle, _ = _run(make(cola.Circle(r)), w, 100, _potential_grad)
  p_box, state = _run(make(cola.Box(lower, upper)), w + center, 100, lambda p: _potential_grad(p - center))
  np.testing.assert_allclose(p_box - center, p_circle, atol=1e-6)
  assert float(jnp.min(p_box)) >= lower and float(jnp.max(p_box)) <= upper
  assert float(cola.constraint_residuals(p_box, state)) <= 1e-6


def _norm_implicit(r):
  return cola.Implicit(equality=lambda w: jnp.sum(w * w, axis=0) / r**2 - 1, tolerance=1e-6, max_iterations=50)


UNIT_START = jnp.array([[0.3, -0.2], [0.5, 0.4], [-0.1, 0.6]])
UNIT_TARGET = jnp.array([[1.0, -1.0], [0.0, 0.5], [0.5, 0.2]])


def _unit_grad(w):
  return w - UNIT_TARGET + 0.3 * jnp.sin(3 * w)


@pytest.mark.slow  # the od test below checks the same equivalence
def test_unit_norm_is_the_dense_implicit_constraint_ud():
  """Same noise draws, exact geodesic vs RATTLE: they differ by O(h^2) over a fixed time."""
  r = 0.8
  errors = []
  for h, steps in ((0.02, 100), (0.01, 200)):
    make = lambda c: _transform("ud", h, c, 1e-3, jax.random.key(5))
    p_unit, s_unit = _run(make(cola.UnitNorm(r)), UNIT_START, steps, _unit_grad)
    p_implicit, s_implicit = _run(make(_norm_implicit(r)), UNIT_START, steps, _unit_grad)
    assert bool(s_implicit.constraint_states.converged)
    assert float(jnp.max(jnp.abs(p_unit - cola.UnitNorm(r).nearest(UNIT_START)))) > 0.1
    errors.append(float(jnp.max(jnp.abs(p_unit - p_implicit))))
    assert float(cola.constraint_residuals(p_unit, s_unit)) <= 1e-6
  print("\nmax |UnitNorm - Implicit|, ud at h = 0.02, 0.01:", errors)
  assert errors[1] <= 1e-5
  assert 2.5 < errors[0] / errors[1] < 6  # second order


@pytest.mark.extended  # quick: test_unit_norm_projections (the radial projection)
def test_unit_norm_is_the_dense_implicit_constraint_od():
  """Radial vs SHAKE's oblique projection: O(|step|^2) per step, so O(h) over a fixed time."""
  r = 0.8
  errors = []
  for h, steps in ((0.004, 250), (0.002, 500)):
    p_unit, _ = _run(_transform("od", h, cola.UnitNorm(r)), UNIT_START, steps, _unit_grad)
    p_implicit, state = _run(_transform("od", h, _norm_implicit(r)), UNIT_START, steps, _unit_grad)
    assert bool(state.constraint_states.converged)
    errors.append(float(jnp.max(jnp.abs(p_unit - p_implicit))))
  print("\nmax |UnitNorm - Implicit|, od at h = 0.004, 0.002:", errors)
  assert errors[1] <= 5e-4
  assert 1.6 < errors[0] / errors[1] < 2.5  # first order: both are projections onto M


# --------------------------------------------------------------------------------------
# Residuals after many noisy steps with real gradients


CATALOG = {
  "layer0": {"w": cola.Box(-0.3, 0.5), "b": None},
  "layer1": {"w": cola.NonNegative(), "b": cola.Box(0.0, 0.1)},
  "layer2": {"w": cola.UnitNorm(0.8), "b": None},
}
STEPS = 10_000


@pytest.mark.parametrize("method, h", [pytest.param("od", 0.05, marks=pytest.mark.slow), ("ud", 0.1)])
def test_constraints_hold_after_many_noisy_steps(method, h, mlp_problem):
  params, loss = mlp_problem
  params = jax.tree.map(lambda p: 2 * p, params)  # some entries start outside the bounds
  tx = _transform(method, h, CATALOG, 1e-4, jax.random.key(0))

  def step(carry, i):
    p, s = carry
    updates, s = tx.update(jax.grad(loss)(p, i), s, p)
    return (optax.apply_updates(p, updates), s), loss(p, i)

  (new, state), losses = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(STEPS)))((params, tx.init(params)))
  assert np.all(np.isfinite(np.asarray(losses)))
  assert float(losses[-500:].mean()) < 0.7 * float(losses[:20].mean())  # it trains
  residuals = cola.constraint_residuals(new, state)
  print(
    f"\n{method}: loss {float(losses[:20].mean()):.3f} -> {float(losses[-500:].mean()):.3f}, "
    f"residuals {jax.tree.map(float, residuals)}"
  )
  assert max(float(r) for r in jax.tree.leaves(residuals)) <= 1e-5
  w0, w1, b1 = new["layer0"]["w"], new["layer1"]["w"], new["layer1"]["b"]
  assert float(w0.min()) >= -0.3 - 1e-7 and float(w0.max()) <= 0.5 + 1e-7
  assert float(w1.min()) >= 0.0  # exactly: w = s^2
  assert float(jnp.mean(w1 == 0)) < 0.5 and float(jnp.mean(w1 < 1e-3)) > 0  # some reach 0
  assert float(b1.min()) >= 0.0 and float(b1.max()) <= 0.1 + 1e-8
  norms = np.linalg.norm(np.asarray(new["layer2"]["w"], np.float64), axis=0)
  np.testing.assert_allclose(norms, 0.8, rtol=1e-6)
  if method != "od":  # UnitNorm's momentum is tangent
    u = np.asarray(state.momentum["layer2"]["w"], np.float64)
    w = np.asarray(new["layer2"]["w"], np.float64)
    assert np.max(np.abs(np.sum(u * w, axis=0))) <= 1e-5 * max(1.0, np.abs(u).max())


# --------------------------------------------------------------------------------------
# Learning rate zero, low precision, project_params


def test_zero_learning_rate_moves_nothing():
  params = cola.project_params(
    {
      "box": jnp.linspace(-0.5, 1.2, 9),
      "nn": jnp.linspace(-0.2, 3.0, 9),
      "un": jax.random.normal(jax.random.key(0), (4, 3)),
    },
    {"box": cola.Box(0.0, 1.0), "nn": cola.NonNegative(), "un": cola.UnitNorm(0.7)},
  )
  constraints = {"box": cola.Box(0.0, 1.0), "nn": cola.NonNegative(), "un": cola.UnitNorm(0.7)}
  zero = optax.constant_schedule(0.0)
  for tx in (
    cola.cola_od(zero, constraints=constraints, temperature=0.1, key=jax.random.key(0)),
    cola.cola_ud(zero, friction=1.0, constraints=constraints, temperature=0.1, key=jax.random.key(0)),
  ):
    new, _ = _run(tx, params, 3, lambda p: jax.tree.map(jnp.ones_like, p))
    np.testing.assert_array_equal(new["nn"], params["nn"])
    for name in ("box", "un"):  # each of three steps renormalises (columns of 4) or rounds the slack's sin and cos
      np.testing.assert_allclose(new[name], params[name], rtol=3 * rounding.renormalised(4), atol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.extended)])
def test_low_precision_parameters_keep_their_dtype_and_the_constraint(dtype, mlp_problem):
  params, loss = mlp_problem
  low = jax.tree.map(lambda p: p.astype(dtype), params)
  tx = _transform("ud" if dtype == jnp.bfloat16 else "od", 0.05, CATALOG, 1e-5, jax.random.key(1))
  new, state = _run(tx, low, 50, lambda p: jax.grad(loss)(jax.tree.map(lambda x: x.astype(jnp.float32), p), 0))
  assert all(x.dtype == dtype for x in jax.tree.leaves(new))
  residual = max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(new, state)))
  assert residual <= 8 * float(jnp.finfo(dtype).eps), residual
  assert float(new["layer1"]["w"].min()) >= 0


def test_project_params_puts_each_leaf_on_its_manifold(mlp_problem):
  params = jax.tree.map(lambda p: 3 * p, mlp_problem[0])
  projected = cola.project_params(params, CATALOG)
  assert float(projected["layer0"]["w"].min()) >= np.float32(-0.3)
  assert float(projected["layer0"]["w"].max()) <= np.float32(0.5)
  assert float(projected["layer1"]["w"].min()) >= 0.0
  np.testing.assert_allclose(np.linalg.norm(projected["layer2"]["w"], axis=0), 0.8, rtol=1e-6)
  np.testing.assert_array_equal(projected["layer0"]["b"], params["layer0"]["b"])


# --------------------------------------------------------------------------------------
# Invariant measures


def _z(values, exact):
  return (values.mean() - exact) / (values.std(ddof=1) / math.sqrt(values.size))


def _ks(samples, cdf, label):
  result = stats.kstest(samples, cdf)
  print(f"  KS {label}: D = {result.statistic:.5f}, p = {result.pvalue:.3g}, n = {samples.size}")
  return result


def _arcsine_cdf(x):
  return 0.5 + np.arcsin(np.clip(x, -1.0, 1.0)) / np.pi


def _uniform_cdf(x):
  return np.clip((x + 1.0) / 2.0, 0.0, 1.0)


def _samples(method, constraint, params, steps, h, tau, seed, grad_fn=jnp.zeros_like):
  tx = _transform(method, h, constraint, tau, jax.random.key(seed))
  new, state = _run(tx, params, steps, grad_fn)
  return np.asarray(new, np.float64), state


# Box(l, u), zero gradient, r = 0.5, tau = 0.25: the circle's angle diffuses at
# tau / r^2 = 1 per unit time; od t = 10, ud t = 20 (gamma = 1), as for the
# circle in test_invariant_measure.py. Exact for every h.
BOX_FREE = {
  "quick": dict(n=20_000, od=(0.01, 1_000), ud=(0.05, 400)),
  "slow": dict(n=1_000_000, od=(0.01, 2_000), ud=(0.05, 800)),
}


# Extended: ud's quick version (quick: the symmetric and the shifted box are the circle, whose arcsine law
# test_invariant_measure.py samples); the others slow.
@pytest.mark.parametrize(
  "method, size",
  quick_or_extended(
    [(m, s) for m in ("od", "ud") for s in BOX_FREE], (), ids=lambda m, s: f"{m}-{s}", extended={("ud", "quick")}
  ),
)
def test_box_without_force_samples_the_arcsine_law_between_the_bounds(method, size):
  lower, upper = -0.2, 0.8
  center, r = 0.3, 0.5
  cfg = BOX_FREE[size]
  h, steps = cfg[method]
  w, state = _samples(method, cola.Box(lower, upper), jnp.full((cfg["n"],), 0.7, jnp.float32), steps, h, 0.25, seed=31)
  assert w.min() >= np.float32(lower) and w.max() <= np.float32(upper)
  x = (w - center) / r
  print(f"\nBox({lower}, {upper}), zero gradient, {method} ({size}):")
  assert _ks(x, _arcsine_cdf, "(w - c)/r vs arcsine").pvalue > ACCEPT
  xi = np.asarray(state.constraint_states.slack, np.float64) / r
  assert _ks(xi, _arcsine_cdf, "xi/r vs arcsine").pvalue > ACCEPT
  z2 = _z(x**2, 0.5)
  z_uniform = _z(x**2, 1 / 3)
  print(f"  E x^2: z = {z2:.2f} (arcsine, 1/2); z = {z_uniform:.1f} against the uniform law's 1/3")
  assert abs(z2) < Z_ACCEPT and abs(_z(x, 0.0)) < Z_ACCEPT
  # Power: the uniform law between the bounds is rejected on these samples.
  assert abs(z_uniform) > Z_REJECT
  assert _ks(x, _uniform_cdf, "(w - c)/r vs uniform (wrong)").pvalue < REJECT


# UnitNorm, zero gradient, r = 0.5, tau = 0.25: on S^{n-1} the slowest mode
# decays at tau (n - 1) / r^2 = n - 1 per unit time; od t = 10, ud t = 20.
UNIT_FREE = {
  "quick": dict(units=10_000, od=(0.01, 1_000), ud=(0.05, 400)),
  "slow": dict(units=200_000, od=(0.01, 2_000), ud=(0.05, 800)),
}


def _beta_cdf(n):
  """CDF of one coordinate of the uniform law on S^{n-1} (in R^n)."""
  return lambda t: stats.beta.cdf((np.clip(t, -1, 1) + 1) / 2, (n - 1) / 2, (n - 1) / 2)


# Extended: od on circles (the quick suite samples the circle's law in test_invariant_measure.py); the rest slow.
UNIT_NORM_CASES = quick_or_extended(
  [(method, n, size) for method in ("od", "ud") for n in (2, 4) for size in ("quick", "slow")],
  (),
  ids=lambda method, n, size: f"{method}-{n}-{size}",
  extended={("od", 2, "quick")},
)


@pytest.mark.parametrize("method, n, size", UNIT_NORM_CASES)
def test_unit_norm_without_force_is_uniform_on_each_sphere(method, n, size):
  r = 0.5
  cfg = UNIT_FREE[size]
  h, steps = cfg[method]
  start = jnp.zeros((n, cfg["units"]), jnp.float32).at[0].set(r)  # every unit at one pole
  w, _ = _samples(method, cola.UnitNorm(r), start, steps, h, 0.25, seed=40 + n)
  x = w / r
  np.testing.assert_allclose(np.sum(x * x, axis=0), 1.0, rtol=1e-6)
  print(f"\nUnitNorm, S^{n - 1}, zero gradient, {method} ({size}):")
  z = {}
  for i in range(n):
    z[f"x{i}"] = _z(x[i], 0.0)
    z[f"x{i}^2"] = _z(x[i] ** 2, 1 / n)
    z[f"x{i}^4"] = _z(x[i] ** 4, 3 / (n * (n + 2)))
  z["x0 x1"] = _z(x[0] * x[1], 0.0)
  worst = max(z, key=lambda k: abs(z[k]))
  print(f"  {len(z)} moments, max |z| = {abs(z[worst]):.2f} at {worst}")
  assert abs(z[worst]) < Z_ACCEPT
  for i in range(n):
    assert _ks(x[i], _beta_cdf(n), f"x{i} vs Beta({n - 1}/2, {n - 1}/2)").pvalue > ACCEPT
  # Power: the law one dimension up (MaxNorm's slack sphere S^n) is rejected,
  # and so is a chain stopped early (t = 0.1 od, 0.25 ud), still near the pole.
  assert _ks(x[0], _beta_cdf(n + 1), "x0 vs the law on S^n (wrong)").pvalue < REJECT
  early, _ = _samples(method, cola.UnitNorm(r), start, 10 if method == "od" else 5, h, 0.25, seed=40 + n)
  assert abs(_z(early[0] / r, 0.0)) > Z_REJECT


def _non_negative_cdf(k, c, tau, arc_length=True, grid=400_001):
  """CDF of w for the density ``exp(-V/tau) sqrt(1 + 4w) / sqrt(w)``, ``V = k (w - c)^2 / 2``.

  In ``s = sqrt(w)`` the density is ``exp(-V(s^2)/tau) sqrt(1 + 4 s^2)``, smooth
  (trapezoid rule on a fine grid). ``arc_length=False`` drops the factor
  ``sqrt(1 + 4 s^2)``: the WRONG law of a slack ``s`` with the flat measure ``ds``.
  """
  s = np.linspace(0.0, c + 12 * math.sqrt(tau / k) + 2, grid)
  weight = np.exp(-0.5 * k * (s * s - c) ** 2 / tau)
  if arc_length:
    weight = weight * np.sqrt(1 + 4 * s * s)
  cdf = np.concatenate([[0.0], np.cumsum(0.5 * (weight[1:] + weight[:-1]) * np.diff(s))])
  return lambda w: np.interp(w, s * s, cdf / cdf[-1])


def _gibbs_on_half_line_cdf(k, c, tau):
  """The WRONG law ``exp(-V/tau)`` on ``w >= 0`` (flat measure in w)."""
  grid = np.linspace(0.0, c + 12 * math.sqrt(tau / k) + 2, 400_001)
  weight = np.exp(-0.5 * k * (grid - c) ** 2 / tau)
  cdf = np.concatenate([[0.0], np.cumsum(0.5 * (weight[1:] + weight[:-1]) * np.diff(grid))])
  return lambda w: np.interp(w, grid, cdf / cdf[-1])


# V = k (w - c)^2 / 2 with k = 4, c = 0.5, tau = 0.25: w ranges over [0, ~1.5],
# where sqrt(1 + 4w) varies from 1 to 2.6, and 1/sqrt(w) piles mass near 0. The
# w marginal relaxes within t ~ 5 from w = c; od t = 20, ud t = 30. Bias
# (measured, n = 2e4; KS noise ~0.006): od h = 0.01: D = 0.008, h = 0.004:
# 0.006; ud h = 0.05: 0.005, h = 0.02: 0.008. The wrong laws: D = 0.06-0.09.
NON_NEGATIVE_FORCE = {
  "quick": dict(n=10_000, od=(0.01, 2_000), ud=(0.05, 600)),
  "slow": dict(n=400_000, od=(0.0025, 8_000), ud=(0.0125, 2_400)),
}


# Quick: CoLA-ud's; CoLA-od's under slow with the long runs.
NON_NEGATIVE_CASES = quick_or_slow(
  [(method, size) for method in ("od", "ud") for size in ("quick", "slow")],
  {("ud", "quick")},
  ids=lambda method, size: f"{method}-{size}",
)


@pytest.mark.parametrize("method, size", NON_NEGATIVE_CASES)
def test_non_negative_with_quadratic_potential_samples_the_derived_density(method, size):
  k, c, tau = 4.0, 0.5, 0.25
  cfg = NON_NEGATIVE_FORCE[size]
  h, steps = cfg[method]
  w, state = _samples(
    method,
    cola.NonNegative(),
    jnp.full((cfg["n"],), c, jnp.float32),
    steps,
    h,
    tau,
    seed=53,
    grad_fn=lambda p: k * (p - c),
  )
  slack = np.asarray(state.constraint_states.slack, np.float64)
  print(f"\nNonNegative, V = k (w - c)^2 / 2, {method} ({size}): h = {h}, {steps} steps")
  assert w.min() >= 0.0
  # params + updates rounds w to ulps of its previous value: |w - s^2| is absolute below 1.
  assert np.max(np.abs(w - slack**2) / np.maximum(w, 1)) <= 1e-6
  assert _ks(w, _non_negative_cdf(k, c, tau), "w vs exp(-V/tau) sqrt(1+4w)/sqrt(w)").pvalue > ACCEPT
  # The chains pass through w = 0 onto the other branch of the slack.
  print(f"  fraction with s < 0: {np.mean(slack < 0):.3f}")
  assert np.mean(slack < 0) > 0.3
  # Power: the law without the arc-length factor, and exp(-V/tau) on w >= 0.
  assert _ks(w, _non_negative_cdf(k, c, tau, arc_length=False), "w without sqrt(1+4w) (wrong)").pvalue < REJECT
  assert _ks(w, _gibbs_on_half_line_cdf(k, c, tau), "exp(-V/tau) on w >= 0 (wrong)").pvalue < REJECT


@pytest.mark.parametrize(
  "make, constraint, start, inside, below",
  [
    (lambda: cola.c_cola_od(0.1, radius=0.1), cola.Circle(0.1), 0.3, 0.099, 0.095),
    pytest.param(
      lambda: cola.c_cola_ud(0.1, momentum=0.0, radius=0.1),
      cola.Circle(0.1),
      0.3,
      0.099,
      0.095,
      marks=pytest.mark.extended,
    ),
    (lambda: cola.cola_od(0.1, constraints=cola.MaxNorm(0.1, axis="all")), None, 0.3, 0.099, 0.095),
    pytest.param(
      lambda: cola.cola_od(0.1, constraints=cola.Box(-0.1, 0.1)),
      cola.Box(-0.1, 0.1),
      0.3,
      0.099,
      0.095,
      marks=pytest.mark.extended,
    ),
  ],
)
def test_a_weight_beyond_its_bound_leaves_it_as_fast_as_one_just_inside(make, constraint, start, inside, below):
  """At the bound the slack is 0 and the gradient has no tangent component: a weight put there would stay.

  Under the loss ``0.1 sum(w**2)``: a weight started at 3 r and one started at 0.99 r both start at 0.99 r.
  """

  tx = make()
  update = jax.jit(tx.update)  # compiled once, for both starts and every step

  def steps_to_fall(w0):
    params = jnp.array([[w0, 0.0]])  # a kernel: the presets constrain ndim >= 2
    state = tx.init(params)
    for step in range(1, 400):
      updates, state = update(0.2 * params, state, params)
      params = optax.apply_updates(params, updates)
      if jnp.abs(params[0, 0]) < below:
        return step
    return 400

  beyond, just_inside = steps_to_fall(start), steps_to_fall(inside)
  assert just_inside < 100 and beyond <= just_inside + 2  # (the first gradient, taken at 3 r, is larger)
  if constraint is not None:
    assert float(constraint.nearest(jnp.array([start]))[0]) == pytest.approx(0.99 * 0.1, rel=1e-6)
