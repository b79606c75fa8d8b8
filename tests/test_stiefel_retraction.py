"""Retractions onto the Stiefel manifold and the matrix sign: residuals, agreement with the eigh polar factor and
the SVD, first-order agreement of QR, non-finite input, and the retractions inside ``constrained(optax.adam)``."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax.constraints import stiefel_retraction as sr
from cola_jax.constraints.orthogonal import tall_view

RETRACTIONS = ("newton_schulz", "qr", "polar")


def _tolerance(rows):
  return max(1e-6, sr.rounding_floor(rows))


def _residual(q):
  return float(np.abs(np.asarray(sr.gram_defect(q))).max())


def _tangent_step(seed, rows, columns, size):
  """``(Q, xi)``: ``Q`` orthonormal, ``xi`` tangent at ``Q`` with ``|xi|_2 = size``."""
  key_q, key_xi = jax.random.split(jax.random.key(seed))
  q, _ = jnp.linalg.qr(jax.random.normal(key_q, (rows, columns)))
  xi = jax.random.normal(key_xi, (rows, columns))
  sym = q.T @ xi
  xi = xi - q @ (sym + sym.T) / 2
  return q, xi * (size / jnp.linalg.norm(xi, 2))


@jax.jit
def _three_retractions(m):
  ns, _, ns_ok = sr.newton_schulz_polar(m)
  qr, qr_ok = sr.qr_retraction(m)
  return (ns, qr, sr.polar_of_tangent_step(m)), (ns_ok, qr_ok)


@pytest.mark.parametrize(("shape", "size"), [((48, 16), 1e-3), pytest.param((32, 32), 0.3, marks=pytest.mark.slow)])
def test_each_retraction_is_orthonormal_to_rounding(shape, size):
  q, xi = _tangent_step(0, *shape, size)
  points, flags = _three_retractions(q + xi)
  for point in points:
    assert _residual(point) <= _tolerance(shape[0])
  assert all(bool(flag) for flag in flags)


@pytest.mark.parametrize(("size", "iterations"), [(0.1, 1), (0.3, 2), (0.7, 3), (1.0, 4)])
def test_newton_schulz_is_the_eigh_polar_factor(size, iterations):
  """Same point as the eigendecomposition to rounding, in the iterations the docstring states."""
  q, xi = _tangent_step(1, 64, 32, size)
  ns, k, ok = jax.jit(sr.newton_schulz_polar)(q + xi)
  assert bool(ok) and int(k) == iterations
  assert float(jnp.max(jnp.abs(ns - sr.polar_of_tangent_step(q + xi)))) <= sr.rounding_floor(64)


@pytest.mark.extended  # quick: test_constrained.py's test_large_adam_steps_stay_finite_and_on_the_manifold
def test_newton_schulz_hands_a_large_step_to_the_eigendecomposition():
  """``|xi|_2 = 3`` is outside the polynomial's region: the iteration stops at once and eigh gives the point."""
  q, xi = _tangent_step(2, 40, 20, 3.0)
  ns, k, ok = jax.jit(sr.newton_schulz_polar)(q + xi)
  assert bool(ok) and int(k) <= 1
  np.testing.assert_allclose(ns, sr.polar_of_tangent_step(q + xi), atol=1e-6)


@pytest.mark.extended  # quick: tests/test_fixed_loops.py, the fixed loops against the while loops
def test_fixed_loops_give_the_same_newton_schulz_point():
  q, xi = _tangent_step(3, 24, 12, 0.5)
  loose, k, ok = jax.jit(sr.newton_schulz_polar)(q + xi)
  fixed, k_fixed, ok_fixed = jax.jit(functools.partial(sr.newton_schulz_polar, fixed=True))(q + xi)
  np.testing.assert_array_equal(loose, fixed)
  assert (int(k), bool(ok)) == (int(k_fixed), bool(ok_fixed))


def test_qr_agrees_with_the_polar_factor_to_first_order():
  """``|qf(Q + t xi) - polar(Q + t xi)| = O(t^2)``: a tenth of the step, a hundredth of the difference."""
  q, xi = _tangent_step(4, 30, 10, 1.0)
  with jax.enable_x64():
    q, xi = jnp.asarray(q, jnp.float64), jnp.asarray(xi, jnp.float64)
    gaps = []
    for t in (0.1, 0.01):
      qr, _ = jax.jit(sr.qr_retraction)(q + t * xi)
      gaps.append(float(jnp.max(jnp.abs(qr - jax.jit(sr.polar_of_tangent_step)(q + t * xi)))))
  assert gaps[1] <= 0.02 * gaps[0]  # ratio 1e-2 for order two, 1e-1 for order one
  assert gaps[0] <= 0.1**2


@pytest.mark.extended  # quick: test_a_non_finite_step_through_orthogonal_gives_nan_and_false (both retractions)
def test_non_finite_input_gives_nan_and_false():
  q, xi = _tangent_step(8, 12, 6, 0.1)
  retractions = jax.jit(lambda m: (sr.newton_schulz_polar(m), sr.qr_retraction(m)))
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    m = (q + xi).at[3, 2].set(bad)
    (ns, _, ns_ok), (qr, qr_ok) = retractions(m)
    assert bool(jnp.all(jnp.isnan(ns))) and not bool(ns_ok)
    assert bool(jnp.all(jnp.isnan(qr))) and not bool(qr_ok)


@pytest.mark.parametrize("retraction", ["newton_schulz", "qr"])
def test_a_non_finite_step_through_orthogonal_gives_nan_and_false(retraction):
  constraint = cola.Orthogonal(retraction=retraction)
  q, xi = _tangent_step(14, 12, 6, 0.1)
  point = constraint.point(q, constraint.init(q))
  matrix, info = jax.jit(constraint.retract)(point, xi.at[0, 0].set(jnp.inf))
  assert bool(jnp.all(jnp.isnan(matrix))) and not bool(info.converged)


LEAVES = {
  "tall": ((24, 8), {}),
  "square": ((16, 16), {}),
  "wide": ((6, 20), {}),
  "conv": ((3, 3, 4, 8), {"row_axes": 2, "column_axes": 3}),
  "batched": ((5, 12, 6), {"row_axes": 1, "column_axes": 2}),
}


def _retract_leaves(retraction, leaves):
  """Each of these ``LEAVES`` on its manifold, retracted along a tangent step: ``{leaf: (new, info)}``."""
  out = {}
  for leaf in leaves:
    shape, axes = LEAVES[leaf]
    constraint = cola.Orthogonal(retraction=retraction, **axes)
    param = constraint.nearest(jax.random.normal(jax.random.key(9), shape))
    point = constraint.point(param, constraint.init(param))
    gradient = jax.random.normal(jax.random.key(10), shape)
    tangent = constraint.cotangent(point, 0.2 * constraint.ambient_gradient(point, gradient))
    out[leaf] = constraint.unpack(constraint.retract(point, tangent), param)
  return out


def _check_leaves(retraction, leaves, eager):
  compiled = jax.jit(_retract_leaves, static_argnums=(0, 1))(retraction, leaves)
  for leaf, (new, info) in compiled.items():
    shape, axes = LEAVES[leaf]
    assert new.shape == shape
    rows = tall_view(new, axes.get("row_axes"), axes.get("column_axes")).shape[-2]
    assert float(info.residual(new)) <= _tolerance(rows), leaf
    assert bool(info.converged), leaf
  if eager:
    for leaf, (other, other_info) in _retract_leaves(retraction, leaves).items():
      new, info = compiled[leaf]
      np.testing.assert_allclose(other, new, atol=1e-6)
      assert (int(other_info.iterations), bool(other_info.converged)) == (int(info.iterations), bool(info.converged))


@pytest.mark.extended  # quick: test_each_retraction_is_orthonormal_to_rounding; a conv leaf: test_lapack_under_vmap.py
@pytest.mark.parametrize(
  ("retraction", "leaves"),
  [
    ("newton_schulz", tuple(LEAVES)),
    pytest.param("qr", ("wide", "conv"), marks=pytest.mark.extended),
    pytest.param("polar", ("batched",), marks=pytest.mark.extended),
  ],
)
def test_orthogonal_retract_stays_on_the_manifold(retraction, leaves):
  """Tall, square, wide, conv (per tap) and batched leaves through ``Orthogonal.retract`` (every pair, and eager
  against compiled: the slow test below)."""
  _check_leaves(retraction, leaves, eager=False)


@pytest.mark.slow
@pytest.mark.parametrize("retraction", RETRACTIONS)
def test_orthogonal_retract_stays_on_the_manifold_every_leaf(retraction):
  _check_leaves(retraction, tuple(LEAVES), eager=True)


@pytest.mark.extended  # quick: test_newton_schulz_is_the_eigh_polar_factor, compiled, against eigh's point
def test_newton_schulz_compiled_equals_eager():
  """(QR's and the leaves' eager runs: the slow test above.)"""
  q, xi = _tangent_step(13, 20, 10, 0.5)
  for compiled, eager in zip(jax.jit(sr.newton_schulz_polar)(q + xi), sr.newton_schulz_polar(q + xi)):
    np.testing.assert_allclose(compiled, eager, atol=1e-6)


@pytest.mark.extended  # quick: test_constrained.py's test_large_adam_steps_stay_finite_and_on_the_manifold
@pytest.mark.parametrize(  # one retraction through constrained(adam) here, the others under slow
  "retraction", [pytest.param(r, marks=() if r == "newton_schulz" else pytest.mark.slow) for r in RETRACTIONS]
)
def test_constrained_adam_stays_on_the_manifold(retraction):
  constraint = cola.Orthogonal(retraction=retraction)
  params = {"w": cola.Orthogonal().nearest(jax.random.normal(jax.random.key(11), (32, 16))), "b": jnp.zeros(16)}
  tx = cola.constrained(optax.adam(3e-2), constraints={"w": constraint, "b": None})
  state = tx.init(params)

  @jax.jit
  def step(params, state, key):
    grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for key in jax.random.split(jax.random.key(12), 5):
    params, state = step(params, state, key)
    assert _residual(params["w"]) <= _tolerance(32)
    assert bool(state.constraint_states["w"].converged)


def test_the_retraction_is_checked_at_construction():
  with pytest.raises(ValueError, match=r"retraction must be one of \('newton_schulz', 'qr', 'polar'\)"):
    cola.Orthogonal(retraction="cayley")


def test_rounding_floor_grows_like_the_square_root_of_the_rows():
  assert sr.rounding_floor(400) == pytest.approx(2 * math.sqrt(400) * np.finfo(np.float32).eps)
  assert sr.rounding_floor(4 * 400) == pytest.approx(2 * sr.rounding_floor(400))
