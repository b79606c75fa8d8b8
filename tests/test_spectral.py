"""The spectral-norm ball ``MaxSpectralNorm`` and the scaled Stiefel manifold ``Orthogonal(scale=s)``.

Tolerances. A step ends on the stacked manifold ``[W; S]^T [W; S] = r^2 I``
with ``max |U^T U - I| <= tolerance`` (``U = [W; S] / r``, the projection's
test, computed in float32 over ``n + s`` rows), or, where a step has no root
(large steps do not), at the polar factor ``U V^T`` from LAPACK's float32 SVD,
whose singular vectors are orthonormal to ``p(rows) eps`` with ``p`` a modest
polynomial (LAPACK Users' Guide, 4.9); ``2 rows eps`` bounds what it leaves
here (measured: 14.5 eps at 9 rows), above the ``2 sqrt(rows) eps`` of a
rounded orthonormal matrix
(:func:`~cola_jax.constraints.stiefel_retraction.rounding_floor`). Re-measured
in float64 the defect moves by the rounding of the float32 Gram matrix,
``(rows + 2) u`` (``u = eps / 2``: ``rows`` terms summed, one
product and the scaling by ``1 / r``). Then
``W^T W = r^2 (I - U_S^T U_S + E)`` bounds ``sigma_max(W)^2 <= r^2 (1 + |E|_2)``
with ``|E|_2 <= s |E|_max``: ``sigma_max / r - 1 <= s |E|_max / 2``.
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

import cola_jax as cola
from cola_jax.constraints.stiefel_retraction import rounding_floor

TOLERANCE = 1e-6  # Orthogonal's default, which MaxSpectralNorm's stacked manifold uses


def _defect_bound(rows: int) -> float:
  """``max |U^T U - I|`` in float64 of a step's result: the projection's test or the SVD polar factor's rounding."""
  svd = max(2 * rows * float(np.finfo(np.float32).eps), rounding_floor(rows))
  return max(TOLERANCE, svd) + (rows + 2) * rounding.unit_roundoff()


def _matrices(w, row_axes=None, column_axes=None):
  """The leaf's matrices ``(b, rows, columns)`` in float64, as the constraint views them (tall or wide)."""
  w = np.asarray(w, np.float64)
  if row_axes is None:
    return w.reshape(1, -1, w.shape[-1])
  batch = [a for a in range(w.ndim) if a not in (row_axes, column_axes)]
  moved = np.transpose(w, batch + [row_axes, column_axes])
  return moved.reshape(-1, *moved.shape[-2:])


def _sigma_max(w, **axes) -> float:
  return float(np.linalg.svd(_matrices(w, **axes), compute_uv=False).max())


def _svd_clip(w, limit, **axes):
  """Every singular value of each matrix clipped at ``limit`` (numpy, float64)."""
  m = _matrices(w, **axes)
  u, s, vt = np.linalg.svd(m, full_matrices=False)
  return (u * np.minimum(s, limit)[..., None, :]) @ vt


# --------------------------------------------------------------------------------------
# The start: nearest, project_params


@pytest.mark.parametrize(
  "shape, axes",
  [
    ((7, 3), {}),
    *(
      pytest.param(*case, marks=pytest.mark.extended)  # quick: the tall one
      for case in (((3, 7), {}), ((4, 4), {}), ((2, 3, 4, 5), {"row_axes": 2, "column_axes": 3}))
    ),
  ],
  ids=["tall", "wide", "square", "per_tap"],
)
def test_a_start_beyond_the_ball_is_the_svd_clip_at_the_start_radius(shape, axes):
  r = 0.7
  c = cola.MaxSpectralNorm(r, **axes)
  w = 3 * jax.random.normal(jax.random.key(0), shape)  # far beyond: sigma_max ~ 10 r
  assert _sigma_max(w, **axes) > 5 * r
  near = c.nearest(w)
  expected = _svd_clip(w, 0.99 * r, **axes)
  # The stacked polar factor's SVD is accurate to its condition number (here below 30) times eps; the issue's
  # 1e-4 relative holds with room.
  np.testing.assert_allclose(_matrices(near, **axes), expected, rtol=0, atol=1e-4 * r)
  np.testing.assert_array_equal(cola.project_params({"w": w}, {"w": c})["w"], near)
  assert _sigma_max(near, **axes) <= 0.99 * r * (1 + 1e-5)


@pytest.mark.extended  # quick: the ball at every step
def test_a_point_inside_is_untouched_bit_for_bit():
  c = cola.MaxSpectralNorm(2.0)
  w = jax.random.normal(jax.random.key(1), (6, 3))
  w = w * (1.9 / _sigma_max(w))  # sigma_max = 0.95 r: inside the start margin
  np.testing.assert_array_equal(c.nearest(w), w)
  np.testing.assert_array_equal(cola.project_params(w, c), w)
  # and its slack puts it on the stacked manifold: W^T W + S^T S = r^2 I
  state = c.init(w)
  assert float(state.residual(w)) <= _defect_bound(9)
  # the first step starts from it: at learning rate 0 nothing moves but rounding
  # the first step starts from it: at learning rate 0 the projection only absorbs the slack's rounding defect,
  # a move of r |E| at most
  tx = cola.cola_od(optax.constant_schedule(0.0), constraints=c)
  updates, _ = tx.update(jnp.ones_like(w), tx.init(w), w)
  assert float(jnp.max(jnp.abs(updates))) <= 2.0 * _defect_bound(9)


def test_within_the_margin_starts_at_the_start_radius():
  """As Circle and MaxNorm: a singular value in (0.99 r, r] starts at 0.99 r, the others stay."""
  r = 1.0
  u, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(5, 3)))
  w = (u * np.array([1.0, 0.995, 0.5])).astype(np.float32)
  near = np.asarray(cola.MaxSpectralNorm(r).nearest(w), np.float64)
  np.testing.assert_allclose(np.linalg.svd(near, compute_uv=False), [0.99, 0.99, 0.5], atol=1e-6)


# --------------------------------------------------------------------------------------
# The ball at every step, under every method


def _methods(c, key):
  h = 0.5  # large steps against a large gradient
  spec = {"w": c, "b": None}
  return {
    "cola_od": cola.cola_od(h, constraints=spec),
    "cola_od_noisy": cola.cola_od(h, constraints=spec, temperature=0.3, key=key),
    "cola_ud": cola.cola_ud(h, friction=1.0, constraints=spec),
    "cola_ud_noisy": cola.cola_ud(h, friction=1.0, constraints=spec, temperature=0.3, key=key),
    "c_cola_od_constraints": cola.c_cola_od(h, constraints=spec),
    "o_cola_ud_constraints": cola.o_cola_ud(h, friction=1.0, constraints=spec),
    "constrained_adam": cola.constrained(optax.adam(0.3), constraints=spec),
    "constrained_sgd_momentum": cola.constrained(optax.sgd(h, momentum=0.9), constraints=spec),
  }


METHODS = tuple(_methods(None, jax.random.key(0)))
CASES = quick_or_extended(
  [(m, shape) for m in METHODS for shape in ((6, 3), (3, 6), (2, 3, 4))],
  {("cola_od", (6, 3))},
  # The presets and constrained(sgd) wrap what cola_od and constrained(adam) run.
  extended={(m, (6, 3)) for m in ("cola_od_noisy", "o_cola_ud_constraints", "constrained_adam")}
  | {("cola_od_noisy", (2, 3, 4)), ("cola_ud_noisy", (3, 6))},
)


@pytest.mark.parametrize("method, shape", CASES)
def test_the_ball_holds_at_every_step(method, shape):
  r = 0.8
  axes = {"row_axes": 1, "column_axes": 2} if len(shape) == 3 else {}
  c = cola.MaxSpectralNorm(r, **axes)
  tx = _methods(c, jax.random.key(3))[method]
  rows = max(shape[-2:]) + min(shape[-2:])
  params = {"w": 10 * jax.random.normal(jax.random.key(0), shape), "b": jnp.zeros(shape[-1])}
  target = 5 * jax.random.normal(jax.random.key(1), shape)  # far outside: the walls are pushed against
  loss = lambda p: jnp.sum((p["w"] - target) ** 2) + jnp.sum(p["b"] ** 2)
  update = jax.jit(tx.update)
  state = tx.init(params)
  # sigma_max <= r (1 + s |E|_max / 2), |E|_max the defect of the stacked matrix (module docstring)
  limit = r * (1 + min(shape[-2:]) * _defect_bound(rows) / 2)
  for i in range(40):
    grads = jax.grad(loss)(params)
    grads = jax.tree.map(lambda g: g * (1 + 20 * (i % 7 == 0)), grads)  # now and then a kick 21 times larger
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert np.all(np.isfinite(np.asarray(params["w"])))
    assert _sigma_max(params["w"], **axes) <= limit, (i, _sigma_max(params["w"], **axes) / r - 1)
    assert float(cola.constraint_residuals(params, state)["w"]) <= _defect_bound(rows)
  # it pressed against the boundary (the target is outside): some singular value near r
  assert _sigma_max(params["w"], **axes) > 0.9 * r


def test_the_loss_reaches_the_svd_clip_of_the_target():
  """``min |W - T|^2`` over the ball is the SVD clip of ``T`` at ``r``; CoLA-od at temperature 0 gets there."""
  r = 1.0
  target = np.array([[2.0, 0.1], [-1.0, 0.2], [0.5, -0.3]], np.float32)  # singular values 2.30, 0.34
  c = cola.MaxSpectralNorm(r)
  tx = cola.cola_od(0.1, constraints=c)
  w = jnp.full((3, 2), 0.2)
  state = tx.init(w)
  step = jax.jit(lambda w, s: tx.update(2 * (w - target), s, w))
  for _ in range(3000):
    updates, state = step(w, state)
    w = optax.apply_updates(w, updates)
  # on the boundary the slack goes to zero like 1 / sqrt(t) (the circle's case): 3e-3 after 3000 steps
  np.testing.assert_allclose(np.asarray(w, np.float64), _svd_clip(target, r)[0], atol=3e-3)


@pytest.mark.extended  # tests/test_reliability.py's planted NaNs keep the quick suite's
def test_nan_shows_and_is_flagged():
  c = cola.MaxSpectralNorm(1.0)
  w = 0.1 * jnp.ones((4, 2))
  for tx in (cola.cola_od(0.1, constraints=c), cola.cola_ud(0.1, friction=1.0, constraints=c)):
    state = tx.init(w)
    updates, state = tx.update(jnp.full((4, 2), jnp.nan), state, w)
    assert np.all(np.isnan(np.asarray(optax.apply_updates(w, updates))))
    assert not bool(state.constraint_states.converged)


def test_a_parameter_changed_outside_the_optimizer_shows_in_the_residual():
  c = cola.MaxSpectralNorm(1.0)
  w = 0.3 * jnp.eye(4, 2)
  state = cola.cola_od(0.1, constraints=c).init(w)
  assert float(cola.constraint_residuals(w, state)) <= _defect_bound(6)
  assert float(cola.constraint_residuals(2 * w, state)) > 0.2  # W^T W + S^T S - I = 3 (0.09) I


# --------------------------------------------------------------------------------------
# Orthogonal(scale=s)


# Quick: cola_od; each method once and each shape at least once with the extended ones; the rest slow.
@pytest.mark.parametrize(
  "method, shape",
  quick_or_extended(
    [(m, s) for m in ("cola_od", "cola_ud", "constrained_adam", "manifold_muon") for s in ((6, 3), (3, 6), (2, 3, 4))],
    {("cola_od", (6, 3))},
    extended={("cola_ud", (2, 3, 4)), ("constrained_adam", (6, 3)), ("manifold_muon", (3, 6))},
  ),
)
def test_orthogonal_scale_holds_w_t_w_equal_s2_i(method, shape):
  s = 2.5
  axes = {"row_axes": 1, "column_axes": 2} if len(shape) == 3 else {}
  c = cola.Orthogonal(scale=s, **axes)
  key = jax.random.key(4)
  tx = {
    "cola_od": cola.cola_od(0.2, constraints=c, temperature=0.1, key=key),
    "cola_ud": cola.cola_ud(0.2, friction=1.0, constraints=c, temperature=0.1, key=key),
    "constrained_adam": cola.constrained(optax.adam(0.1), constraints=c),
    "manifold_muon": cola.manifold_muon(0.1, constraints=c),
  }[method]
  w = 3 * jax.random.normal(jax.random.key(0), shape)
  target = jax.random.normal(jax.random.key(1), shape)
  update = jax.jit(tx.update)
  state = tx.init(w)
  rows = max(shape[-2:])
  for _ in range(20):
    updates, state = update(2 * (w - target), state, w)
    w = optax.apply_updates(w, updates)
    m = _matrices(w, **axes)
    tall = m if m.shape[-2] >= m.shape[-1] else np.swapaxes(m, -1, -2)
    gram = np.swapaxes(tall, -1, -2) @ tall / s**2
    # the projection's test on W / s, re-measured in float64 (rows terms, the division by s and the product)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(gram.shape[-1]), gram.shape), atol=_defect_bound(rows))
    assert float(cola.constraint_residuals(w, state)) <= _defect_bound(rows)


def test_orthogonal_scale_nearest_is_scale_times_the_polar_factor():
  w = jax.random.normal(jax.random.key(2), (5, 3))
  u, _, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
  for s in (0.25, 3.0):
    np.testing.assert_allclose(cola.Orthogonal(scale=s).nearest(w), s * u @ vt, rtol=0, atol=16 * s * 2**-24)
  # scale 1 is the unscaled manifold, bit for bit
  np.testing.assert_array_equal(cola.Orthogonal(scale=1.0).nearest(w), cola.Orthogonal().nearest(w))


def test_orthogonal_scale_is_the_unit_dynamics_of_w_over_s():
  """CoLA-od in W on s V is CoLA-od in U = W / s at temperature tau / s^2 (the force |W - s T|^2 / 2), same draws."""
  s = 2.0  # a power of two: the scalings are exact, and so is the time change at these dyadic values
  h, tau, steps = 0.05, 0.02, 10
  w0 = jnp.eye(4, 2) * s
  grad = lambda w, target: w - target
  target = jax.random.normal(jax.random.key(5), (4, 2))

  def run(constraint, w, h, tau, scale_grad):
    tx = cola.cola_od(h, constraints=constraint, temperature=tau, key=jax.random.key(6))
    state, update = tx.init(w), jax.jit(tx.update)  # compiled once, reused by every step
    for _ in range(steps):
      updates, state = update(scale_grad(w), state, w)
      w = optax.apply_updates(w, updates)
    return w

  scaled = run(cola.Orthogonal(scale=s), w0, h, tau, lambda w: grad(w, s * target))
  # W_{k+1} = P_{sV}(W - h (W - s T) + sqrt(2 h tau) xi) is, divided by s,
  # U_{k+1} = P_V(U - h (U - T) + sqrt(2 h tau / s^2) xi): the unit manifold at temperature tau / s^2.
  unit = run(cola.Orthogonal(), w0 / s, h, tau / s**2, lambda u: grad(u, target))
  np.testing.assert_allclose(np.asarray(scaled) / s, np.asarray(unit), rtol=0, atol=64 * rounding.unit_roundoff())


# --------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_radius_and_scale_raise_naming_the_argument(bad):
  with pytest.raises(ValueError, match="MaxSpectralNorm: radius"):
    cola.MaxSpectralNorm(bad)
  with pytest.raises(ValueError, match="Orthogonal: scale"):
    cola.Orthogonal(scale=bad)


def test_other_bad_arguments_raise_naming_them():
  with pytest.raises(TypeError, match="radius"):
    cola.MaxSpectralNorm(optax.constant_schedule(1.0))  # pyright: ignore[reportArgumentType]
  with pytest.raises(TypeError, match="scale"):
    cola.Orthogonal(scale="2")  # pyright: ignore[reportArgumentType]
  with pytest.raises(ValueError, match="row_axes"):
    cola.MaxSpectralNorm(1.0, row_axes=0)
  with pytest.raises(ValueError, match="share an axis"):
    cola.MaxSpectralNorm(1.0, row_axes=0, column_axes=0)
  with pytest.raises(ValueError, match=r"\['b'\].*ndim >= 2"):
    cola.cola_od(0.1, constraints=cola.MaxSpectralNorm(1.0)).init({"b": jnp.zeros(3)})
  with pytest.raises(ValueError, match="column_axes"):
    cola.cola_od(0.1, constraints=cola.MaxSpectralNorm(1.0, row_axes=0, column_axes=5)).init({"w": jnp.zeros((2, 3))})


def test_constraints_are_hashable_values():
  assert cola.MaxSpectralNorm(1.0) == cola.MaxSpectralNorm(1)
  assert hash(cola.Orthogonal(scale=2)) == hash(cola.Orthogonal(scale=2.0))
  assert cola.Orthogonal(scale=2.0) != cola.Orthogonal()


# --------------------------------------------------------------------------------------
# Invariant law: [W; S] / r uniform on the Stiefel manifold V_2(R^4), W the top 2 x 2 block


def _truncated_haar_statistics(q):
  """Moments of ``Q = [W; S] / r`` (..., 4, 2) under the uniform law on V_2(R^4), and of ``W`` alone.

  Each row of the first 2 columns of a Haar O(4) matrix is the start of a
  uniform unit vector of R^4: E x^2 = 1/4, E x^4 = 3/24, E x_0^2 x_1^2 = 1/24.
  For ``W`` (the top 2 x 2 block, density ``det(I - W^T W)^{-1/2}``): E det W = 0
  (a row's sign flip) and E det(W)^2 = 1/6: by Cauchy-Binet the squares of the
  six 2 x 2 minors of ``Q``'s rows sum to ``det(Q^T Q) = 1``, and a row
  permutation (Haar-invariant) makes them equal in law. ``test_truncated_haar_reference``
  checks all on exact Haar samples.
  """
  out = {}
  for i in range(4):
    for j in range(2):
      out[f"Q[{i},{j}]"] = (q[..., i, j], 0.0)
      out[f"Q[{i},{j}]^2"] = (q[..., i, j] ** 2, 1 / 4)
      out[f"Q[{i},{j}]^4"] = (q[..., i, j] ** 4, 1 / 8)
    out[f"Q[{i},0]^2 Q[{i},1]^2"] = (q[..., i, 0] ** 2 * q[..., i, 1] ** 2, 1 / 24)
  det = q[..., 0, 0] * q[..., 1, 1] - q[..., 0, 1] * q[..., 1, 0]
  out["det W"] = (det, 0.0)
  out["det W^2"] = (det**2, 1 / 6)
  return out


@pytest.mark.extended  # the reference of the extended sampling test below
def test_truncated_haar_reference():
  """The moments hold for exact Haar samples."""
  rng = np.random.default_rng(0)
  q, rr = np.linalg.qr(rng.standard_normal((200_000, 4, 4)))
  q = (q * np.sign(np.diagonal(rr, axis1=-2, axis2=-1))[..., None, :])[..., :2]
  for name, (values, exact) in _truncated_haar_statistics(q).items():
    se = values.std() / math.sqrt(values.size)
    assert abs(values.mean() - exact) < 5 * se, name


def _chains(method, h, burn_in, snapshots, every, chains, seed, steps_scale=1):
  r = 0.5
  c = cola.MaxSpectralNorm(r)

  def chain(key):
    if method == "od":
      tx = cola.cola_od(h, constraints=c, temperature=r * r, key=key)
    else:
      tx = cola.cola_ud(h, friction=1.0, constraints=c, temperature=r * r, key=key)

    def step(carry, _):
      w, state = carry
      updates, state = tx.update(jnp.zeros_like(w), state, w)
      return (optax.apply_updates(w, updates), state), None

    advance = lambda carry, n: jax.lax.scan(step, carry, None, length=n)[0]

    def snapshot(carry, _):
      carry = advance(carry, every)
      w, state = carry
      return carry, jnp.concatenate([w, state.constraint_states.slack], axis=0) / r

    w = jnp.zeros((2, 2))
    carry = advance((w, tx.init(w)), burn_in)
    return jax.lax.scan(snapshot, carry, None, length=snapshots)[1]

  keys = jax.random.split(jax.random.key(seed), chains)
  return np.asarray(jax.jit(jax.vmap(chain))(keys), np.float64)


def _z(statistics):
  z = {}
  for name, (values, exact) in statistics.items():
    per_chain = values.mean(axis=1)
    z[name] = (per_chain.mean() - exact) / (per_chain.std(ddof=1) / math.sqrt(per_chain.size))
  return z


# Extended: ud's quick version (quick: test_invariant_measure.py's Haar moments on a Stiefel manifold); the rest slow.
LAW_CASES = quick_or_extended([("ud", "quick"), ("od", "quick"), ("ud", "slow")], (), extended={("ud", "quick")})


@pytest.mark.parametrize("method, size", LAW_CASES)
def test_without_force_the_slack_construction_samples_the_truncated_haar_law(method, size):
  """Zero gradient, temperature r^2 (entries of order r): ``[W; S] / r`` is Haar on V_2(R^4) for every h.

  Independent chains' time averages (their spread gives the standard error whatever the autocorrelation,
  as in test_invariant_measure.py). Chains stopped after a few steps from W = 0 fail the same test.
  """
  chains = 400 if size == "quick" else 2000
  h = 0.05 if method == "ud" else 0.01
  burn_in, every = (200, 10) if method == "ud" else (800, 30)
  q = _chains(method, h, burn_in, 16, every, chains, seed=11)
  gram = np.einsum("bmij,bmik->bmjk", q, q)
  np.testing.assert_allclose(gram, np.broadcast_to(np.eye(2), gram.shape), atol=_defect_bound(4))
  z = _z(_truncated_haar_statistics(q))
  worst = max(z, key=lambda k: abs(z[k]))
  print(f"\n{method}: max |z| = {abs(z[worst]):.2f} at {worst} ({len(z)} statistics, {chains} chains)")
  assert abs(z[worst]) < 4.5
  early = _chains(method, h, 0, 1, 5, chains, seed=12)
  z_early = _z(_truncated_haar_statistics(early))
  assert max(abs(v) for v in z_early.values()) > 8
