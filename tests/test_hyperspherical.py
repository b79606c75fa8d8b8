"""``cola.hyperspherical_descent``: normalized Riemannian gradient descent on spheres, retracted by normalization.

The steps against the reference rule computed by hand in NumPy (whole matrix,
per column, per row), the sphere kept, the angle of a step (``arctan(lr)``, in
the plane of ``w`` and the Riemannian gradient), zero and extreme gradients,
schedules, compiled against eager evaluation, and the errors.
"""

import math

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola


def reference_step(w, g, lr):
  """Bernstein's rule on the unit sphere, in float64: a = g - w (w.g); a /= |a|; w -= lr a; w /= |w|."""
  w, g = np.asarray(w, np.float64).ravel(), np.asarray(g, np.float64).ravel()
  a = g - w * (w @ g)
  a /= np.linalg.norm(a)
  new = w - lr * a
  return new / np.linalg.norm(new)


def per_column(step, w, g, lr):
  """``step`` applied to each column of ``w`` with the same column of ``g``."""
  return np.stack([step(w[:, j], g[:, j], lr) for j in range(w.shape[1])], axis=1)


def quadratic(n, k, seed):
  """(start on the unit sphere of the whole matrix, loss tr(W^T A W), its gradient in NumPy)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, n))
  a = (x + x.T) / 2
  w = rng.standard_normal((n, k))
  return w / np.linalg.norm(w), lambda v: jnp.trace(v.T @ jnp.asarray(a, v.dtype) @ v), lambda v: 2 * a @ v


def one_step(tx, params, grads):
  updates, _ = tx.update(grads, tx.init(params), params)
  return optax.apply_updates(params, updates)


def test_whole_matrix_steps_are_the_reference_rule():
  w0, loss, grad = quadratic(8, 5, seed=0)
  tx = cola.hyperspherical_descent(0.2)
  w, state = jnp.asarray(w0, jnp.float32), tx.init(jnp.asarray(w0, jnp.float32))
  step = jax.jit(lambda w, s: tx.update(jax.grad(loss)(w), s, w))
  expected = w0
  for _ in range(10):
    updates, state = step(w, state)
    w = optax.apply_updates(w, updates)
    expected = reference_step(expected, grad(expected), 0.2).reshape(w0.shape)
    np.testing.assert_allclose(w, expected, atol=2e-6)


# Extended; quick: each column's step in test_each_unit_turns_by_arctan_lr_towards_minus_the_riemannian_gradient,
# each row's sphere in test_points_stay_on_their_spheres.
@pytest.mark.extended
def test_per_column_and_per_row_spheres_are_the_reference_rule_on_each_unit():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((6, 4))
  w /= np.linalg.norm(w, axis=0)
  g = rng.standard_normal((6, 4))
  got = one_step(cola.hyperspherical_descent(0.3, constraints=cola.UnitNorm()), jnp.asarray(w, jnp.float32), g)
  np.testing.assert_allclose(got, per_column(reference_step, w, g, 0.3), atol=1e-6)

  rows = w.T / np.linalg.norm(w.T, axis=1, keepdims=True)  # (4, 6), each row on the unit sphere
  got = one_step(cola.hyperspherical_descent(0.3, constraints=cola.UnitNorm(axis=-1)), jnp.asarray(rows), g.T)
  np.testing.assert_allclose(got, per_column(reference_step, rows.T, g, 0.3).T, atol=1e-6)


@pytest.mark.extended  # quick: test_each_unit_turns_by_arctan_lr_towards_minus_the_riemannian_gradient (radius 1.5)
def test_a_sphere_of_radius_r_follows_r_times_the_unit_sphere_trajectory():
  """The step has length lr r: the learning rate is an angle, whatever the radius (Hyperball's scaling)."""
  w0, loss, _ = quadratic(7, 3, seed=2)
  r = 3.0
  unit = cola.hyperspherical_descent(0.1)
  scaled = cola.hyperspherical_descent(0.1, constraints=cola.UnitNorm(r, axis="all"))

  def run(tx, w, loss):
    state = tx.init(w)
    for _ in range(20):
      updates, state = tx.update(jax.grad(loss)(w), state, w)
      w = optax.apply_updates(w, updates)
    return w

  w0 = jnp.asarray(w0, jnp.float32)
  np.testing.assert_allclose(run(scaled, r * w0, lambda v: loss(v / r)), r * run(unit, w0, loss), atol=1e-5)


@pytest.mark.parametrize(
  "constraint",
  [
    cola.UnitNorm(axis="all"),
    pytest.param(cola.UnitNorm(0.5), marks=pytest.mark.extended),
    cola.UnitNorm(2.0, axis=-1),
  ],
)
def test_points_stay_on_their_spheres(constraint):
  w0, loss, _ = quadratic(16, 8, seed=3)
  tx = cola.hyperspherical_descent(0.5, constraints=constraint)
  params = constraint.nearest(jnp.asarray(w0, jnp.float32))

  def body(carry, _):
    w, s = carry
    updates, s = tx.update(jax.grad(loss)(w), s, w)
    w = optax.apply_updates(w, updates)
    return (w, s), w

  _, path = jax.jit(lambda c: jax.lax.scan(body, c, None, length=200))((params, tx.init(params)))
  unit_axes = constraint.init(params).axes
  axes = tuple(a + 1 for a in unit_axes)  # the iterate's units, after the leading step axis
  norms = np.sqrt(np.sum(np.asarray(path, np.float64) ** 2, axis=axes))  # of the float32 iterates, in float64
  n = np.prod([params.shape[a] for a in unit_axes])
  assert np.max(np.abs(norms / constraint.radius - 1)) < rounding.stepped(n)  # at each of the 200 steps


def test_a_decaying_schedule_reaches_the_known_minimum():
  """min tr(W^T A W) over |W|_F = 1 is the smallest eigenvalue of A (every column along its eigenvector)."""
  rng = np.random.default_rng(10)
  x = rng.standard_normal((12, 12))
  a = (x + x.T) / 2
  tx = cola.hyperspherical_descent(optax.cosine_decay_schedule(0.3, 300))
  loss = lambda w: jnp.trace(w.T @ jnp.asarray(a, jnp.float32) @ w)
  w = jnp.asarray(rng.standard_normal((12, 4)), jnp.float32)
  w = w / jnp.linalg.norm(w)

  def body(carry, _):
    w, s = carry
    updates, s = tx.update(jax.grad(loss)(w), s, w)
    return (optax.apply_updates(w, updates), s), None

  (w, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=300))((w, tx.init(w)))
  assert float(loss(w)) == pytest.approx(np.linalg.eigvalsh(a)[0], abs=1e-5)


@pytest.mark.parametrize("lr", [1e-3, 0.1, 1.0, 10.0])
def test_each_unit_turns_by_arctan_lr_towards_minus_the_riemannian_gradient(lr):
  """w+ = cos(t) w + sin(t) r (-a / |a|) with t = arctan(lr): the geodesic of length r arctan(lr)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(4)
    r = 1.5
    w = rng.standard_normal((5, 3))
    w *= r / np.linalg.norm(w, axis=0)
    g = rng.standard_normal((5, 3))
    new = np.asarray(one_step(cola.hyperspherical_descent(lr, constraints=cola.UnitNorm(r)), jnp.asarray(w), g))
    a = g - w * np.sum(w * g, axis=0) / r**2
    angle = math.atan(lr)
    np.testing.assert_allclose(new, math.cos(angle) * w - math.sin(angle) * r * a / np.linalg.norm(a, axis=0))
    cos = np.sum(w * new, axis=0) / r**2
    sin = np.linalg.norm(new - cos * w, axis=0) / r
    np.testing.assert_allclose(np.arctan2(sin, cos), angle, rtol=1e-12)


def test_a_zero_gradient_leaves_the_unit_where_it_is():
  rng = np.random.default_rng(5)
  w = rng.standard_normal((4, 3)).astype(np.float32)
  w /= np.linalg.norm(w, axis=0)
  g = rng.standard_normal((4, 3)).astype(np.float32)
  g[:, 1] = 0.0
  tx = cola.hyperspherical_descent(0.5, constraints=cola.UnitNorm())
  new = np.asarray(jax.jit(one_step, static_argnums=0)(tx, jnp.asarray(w), jnp.asarray(g)))
  assert np.all(np.isfinite(new))
  # The unit is renormalised, and w's float32 columns are within 3 u of norm 1 (numpy's roundings).
  np.testing.assert_allclose(new[:, 1], w[:, 1], rtol=0, atol=rounding.renormalised(4) + 3 * rounding.unit_roundoff())
  assert np.all(np.abs(new[:, [0, 2]] - w[:, [0, 2]]).max(axis=0) > 0.1)  # the others move
  whole = one_step(cola.hyperspherical_descent(0.5), jnp.asarray(w / np.linalg.norm(w)), jnp.zeros((4, 3)))
  np.testing.assert_allclose(
    whole, w / np.linalg.norm(w), rtol=0, atol=rounding.renormalised(12) + 3 * rounding.unit_roundoff()
  )


@pytest.mark.parametrize("scale", [1e-30, *(pytest.param(s, marks=pytest.mark.extended) for s in (1e-20, 1e20)), 1e30])
def test_the_step_does_not_depend_on_the_size_of_the_gradient(scale):
  """Tiny gradients (whose squares underflow) and huge ones (whose squares overflow) give the same step."""
  rng = np.random.default_rng(6)
  w = rng.standard_normal((6, 2)).astype(np.float32)
  w /= np.linalg.norm(w)
  g = rng.standard_normal((6, 2)).astype(np.float32)
  tx = cola.hyperspherical_descent(0.2)
  step = jax.jit(one_step, static_argnums=0)
  np.testing.assert_allclose(step(tx, jnp.asarray(w), jnp.asarray(scale * g)), step(tx, jnp.asarray(w), g), atol=1e-6)


def test_free_leaves_take_plain_gradient_descent():
  params = {"w": jnp.eye(3, 2) / jnp.sqrt(2.0), "b": jnp.array([1.0, -2.0])}
  grads = {"w": jnp.ones((3, 2)), "b": jnp.array([0.5, 4.0])}
  tx = cola.hyperspherical_descent(0.1, constraints={"w": cola.UnitNorm(axis="all"), "b": None})
  new = one_step(tx, params, grads)
  np.testing.assert_allclose(new["b"], params["b"] - 0.1 * grads["b"], rtol=1e-7)
  np.testing.assert_allclose(jnp.linalg.norm(new["w"]), 1.0, rtol=1e-6)


@pytest.mark.extended  # quick: test_a_decaying_schedule_reaches_the_known_minimum
def test_a_schedule_sets_the_angle_of_each_step():
  schedule = optax.piecewise_constant_schedule(1.0, {2: 0.1})  # 1, 1, 0.1, 0.1, ...
  tx = cola.hyperspherical_descent(schedule)
  rng = np.random.default_rng(7)
  w = jnp.asarray(rng.standard_normal(5) / 3, jnp.float32)
  w = w / jnp.linalg.norm(w)
  g = jnp.asarray(rng.standard_normal(5), jnp.float32)
  state = tx.init(w)
  for k in range(4):
    updates, state = tx.update(g, state, w)
    new = optax.apply_updates(w, updates)
    angle = float(jnp.arccos(jnp.clip(jnp.dot(w, new), -1, 1)))
    assert angle == pytest.approx(math.atan(float(schedule(k))), abs=1e-3), k
    w = new


def test_inject_hyperparams_sets_the_learning_rate():
  rng = np.random.default_rng(8)
  w = jnp.asarray(rng.standard_normal((3, 3)), jnp.float32)
  w = w / jnp.linalg.norm(w)
  g = jnp.asarray(rng.standard_normal((3, 3)), jnp.float32)
  injected = optax.inject_hyperparams(cola.hyperspherical_descent)(learning_rate=0.3)
  # The same step, but XLA may fold the constant learning rate into other products: each result within
  # stepped(9) of the exact step plus eta times its direction's error (entries at most 1).
  bound = 2 * (rounding.stepped(9) + 0.3 * rounding.unit_tangent(9))
  np.testing.assert_allclose(one_step(injected, w, g), one_step(cola.hyperspherical_descent(0.3), w, g), atol=bound)


@pytest.mark.parametrize("case", ["random", pytest.param("zero", marks=pytest.mark.extended), "subnormal"])
def test_compiled_and_eager_steps_agree(case):
  """Jitted with arguments, jitted with the inputs as compile-time constants (which XLA folds), and op by op."""
  rng = np.random.default_rng(9)
  w = rng.standard_normal((5, 4)).astype(np.float32)
  w /= np.linalg.norm(w, axis=0)
  g = {"random": rng.standard_normal((5, 4)), "zero": np.zeros((5, 4)), "subnormal": np.full((5, 4), 1e-41)}[case]
  w, g = jnp.asarray(w), jnp.asarray(g, jnp.float32)
  tx = cola.hyperspherical_descent(0.4, constraints=cola.UnitNorm())
  jitted = jax.jit(lambda w, g: one_step(tx, w, g))(w, g)
  folded = jax.jit(lambda: one_step(tx, w, g))()
  with jax.disable_jit():
    eager = one_step(tx, w, g)
  for got in (folded, eager):
    assert bool(jnp.all(jnp.isfinite(got)))
    # Fused or op by op (the reductions' order and the fused multiply-adds differ), each column is within
    # stepped(5) of the exact step plus eta times its direction's error (entries at most 1).
    np.testing.assert_allclose(got, jitted, rtol=0, atol=2 * (rounding.stepped(5) + 0.4 * rounding.unit_tangent(5)))
  if case != "random":  # a zero unit, and one of subnormal entries (compiled code reads them as zeros), stays
    np.testing.assert_allclose(jitted, w, rtol=0, atol=rounding.renormalised(5) + 3 * rounding.unit_roundoff())


@pytest.mark.parametrize(
  ("learning_rate", "error", "message"),
  [
    ("0.1", TypeError, "learning_rate must be a number"),
    (None, TypeError, "learning_rate must be a number"),
    (-0.1, ValueError, "learning_rate must be positive and finite"),
    (0.0, ValueError, "learning_rate must be positive and finite"),
    (float("nan"), ValueError, "learning_rate must be positive and finite"),
    (jnp.ones(2), ValueError, "learning_rate must be a scalar"),
  ],
)
def test_a_bad_learning_rate_is_an_error_at_construction(learning_rate, error, message):
  with pytest.raises(error, match=f"hyperspherical_descent: {message}"):
    cola.hyperspherical_descent(learning_rate)


@pytest.mark.parametrize(
  ("constraints", "where"),
  [
    (cola.Orthogonal(), "given as constraints is Orthogonal"),
    ({"w": cola.MaxNorm(1.0), "b": None}, r"at constraints\['w'\] is MaxNorm"),
    ({"w": "sphere"}, r"at constraints\['w'\] is 'sphere'"),
  ],
)
def test_a_constraint_that_is_not_a_sphere_is_an_error_at_construction(constraints, where):
  with pytest.raises(TypeError, match=f"hyperspherical_descent: the (constraint|value) {where}.*UnitNorm"):
    cola.hyperspherical_descent(0.1, constraints=constraints)


def test_a_callable_giving_another_constraint_is_an_error_at_init():
  tx = cola.hyperspherical_descent(0.1, constraints=cola.path_constraints([("w", cola.Orthogonal())]))
  with pytest.raises(TypeError, match=r"hyperspherical_descent: the constraint for the leaf at \['w'\] is Orthogonal"):
    tx.init({"w": jnp.eye(3, 2), "b": jnp.zeros(2)})


def test_update_needs_the_parameters():
  tx = cola.hyperspherical_descent(0.1)
  w = jnp.eye(2) / jnp.sqrt(2.0)
  with pytest.raises(ValueError, match="needs the current parameters"):
    tx.update(w, tx.init(w))


def test_the_default_leaves_a_bias_alone():
  """Not told which leaves, it takes the weight matrices: a zero bias is no longer put on the unit sphere
  (it became [0.5, 0.5, 0.5, 0.5] after one step with a zero gradient)."""
  params = {"kernel": jnp.eye(4) / 2, "bias": jnp.zeros(4)}
  new = one_step(cola.hyperspherical_descent(0.1), params, jax.tree.map(jnp.zeros_like, params))
  np.testing.assert_array_equal(new["bias"], jnp.zeros(4))
  np.testing.assert_allclose(jnp.linalg.norm(new["kernel"]), 1.0, rtol=1e-6)
