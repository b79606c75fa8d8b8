"""The geometry under extreme inputs: no hang, no silent wrong number.

Non-finite gradients and parameters, finite steps of any size (1e-30 to
3.4e38), rotation angles up to the largest float32, a step size of exactly 0,
and leaves of every float dtype. Each update must return, and end on the
manifold to the dtype's tolerance, or be flagged, or show its NaN.
"""

import json
import os
import subprocess
import sys
import textwrap

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended
from _constraints import case, params, start

import cola_jax as cola
from cola_jax import langevin

F32_MAX = float(np.finfo(np.float32).max)


def _named(name):
  """The registry's constraint ``name`` and a point of it."""
  constraint, shape = case(name)
  return constraint, start(constraint, shape)


def _transform(method, constraint, learning_rate=0.1):
  if method == "od":
    return cola.cola_od(learning_rate, constraints={"w": constraint})
  return cola.cola_ud(learning_rate, friction=1.0, constraints={"w": constraint})


def _run(tx, param, grad, steps=2):
  params = {"w": jnp.asarray(param)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(steps):
    updates, state = update({"w": jnp.asarray(grad)}, state, params)
    params = optax.apply_updates(params, updates)
  return params["w"], state


def _converged(state):
  aux = state.constraint_states["w"]
  return bool(aux.converged) if hasattr(aux, "converged") else True


# --------------------------------------------------------------------------------------
# Non-finite input: the step returns, and shows its NaN or is flagged


_HANG_PRONE = textwrap.dedent("""
    import json, numpy as np, jax, jax.numpy as jnp, optax, cola_jax as cola
    w = jnp.asarray(np.linalg.qr(np.random.default_rng(0).normal(size=(6, 4)))[0], jnp.float32)
    out = {}
    for projection in PROJECTIONS:
      c = cola.Orthogonal(projection=projection)
      for method in ("od", "ud"):
        tx = (cola.cola_od(0.1, constraints=c) if method == "od"
              else cola.cola_ud(0.1, friction=1.0, constraints=c))
        for where, value in (("grad", np.inf), ("grad", np.nan), ("param", np.inf)):
          p = {"w": w.at[0, 0].set(value) if where == "param" else w}
          g = {"w": w.at[0, 0].set(value) if where == "grad" else w}
          u, s = jax.jit(tx.update)(g, tx.init(p), p)
          new = optax.apply_updates(p, u)["w"]
          out[f"{projection} {method} {where} {value}"] = [
              bool(jnp.any(jnp.isnan(new))), bool(s.constraint_states["w"].converged)]
    projected = cola.project_params({"w": w.at[0, 0].set(np.inf)}, cola.Orthogonal())["w"]
    out["project_params inf"] = [bool(jnp.all(jnp.isnan(projected))), False]
    print(json.dumps(out))
""")


@pytest.mark.parametrize(  # quick: the default projection; the other two under slow
  "projections", [("quasi_newton",), pytest.param(("newton", "square_root"), marks=pytest.mark.slow)], ids="-".join
)
def test_non_finite_orthogonal_input_returns_nan_and_flagged(projections):
  # An SVD of a non-finite matrix never returns on CPU: run in a subprocess
  # with a timeout, so that a regression fails instead of hanging the suite.
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
  script = _HANG_PRONE.replace("PROJECTIONS", repr(projections))
  done = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, check=False
  )
  assert done.returncode == 0, done.stderr
  results = json.loads(done.stdout.strip().splitlines()[-1])
  assert len(results) == len(projections) * 2 * 3 + 1
  for run, (nan_shown, converged) in results.items():
    assert nan_shown and not converged, run


@pytest.mark.slow  # quick profile: tests/test_properties.py draws these inputs
@pytest.mark.parametrize("name", ["circle", "max_norm", "implicit"])
@pytest.mark.parametrize("method", ["od", "ud"])
@pytest.mark.parametrize("where, value", [("grad", np.inf), ("grad", np.nan), ("param", np.inf), ("param", np.nan)])
def test_non_finite_input_shows_or_is_flagged(name, method, where, value):
  constraint, param = _named(name)
  grad = np.full_like(param, 0.1)
  if where == "grad":
    grad.flat[0] = value
  else:
    param = param.copy()
    param.flat[0] = value
  new, state = _run(_transform(method, constraint), param, grad)
  residual = float(state.constraint_states["w"].residual(new))
  shown = bool(jnp.any(jnp.isnan(new))) or not np.isfinite(residual)
  assert shown or not _converged(state)
  if not shown:  # rejected (Implicit): still on the manifold
    assert residual <= 1e-6


@pytest.mark.parametrize("name", ["circle", pytest.param("max_norm", marks=pytest.mark.extended)])  # quick: circle
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_project_params_shows_a_non_finite_entry(name, value):
  constraint, param = _named(name)
  bad = jnp.asarray(param).at[0, 0].set(value)
  projected = cola.project_params({"w": bad}, {"w": constraint})["w"]
  assert np.isnan(projected[0, 0])
  np.testing.assert_allclose(projected[1:, 1:], bad[1:, 1:], rtol=1e-6)  # others unchanged


def test_implicit_nearest_raises_for_a_non_finite_parameter():
  constraint, param = _named("implicit")
  with pytest.raises(ValueError, match="could not be projected"):
    constraint.nearest(jnp.asarray(param).at[(0,) * param.ndim].set(np.nan))


# --------------------------------------------------------------------------------------
# Finite input of any size: on the manifold, or flagged


@pytest.mark.slow  # quick profile: tests/test_properties.py draws these inputs
@pytest.mark.parametrize("constraint, shape", params())
@pytest.mark.parametrize("method", ["od", "ud"])
def test_finite_gradients_of_any_size_end_on_the_manifold_or_flagged(constraint, shape, method):
  param = start(constraint, shape)
  tx = _transform(method, constraint)
  for size in (1e-30, 1e-7, 1e8, 1e30):
    _check_finite_gradient(tx, param, size)


def _check_finite_gradient(tx, param, size):
  grad = size * np.sign(np.random.default_rng(1).normal(size=param.shape)).astype(np.float32)
  new, state = _run(tx, param, grad, steps=3)
  assert new.shape == param.shape and new.dtype == param.dtype
  # On the manifold (a rejected Implicit step stays where it was); a step
  # whose projection did not converge is flagged and finished by the polar factor.
  assert float(state.constraint_states["w"].residual(new)) <= 1e-6, size
  if size <= 1e-7:
    assert _converged(state), size


@pytest.mark.parametrize(  # quick: the matrix manifold, every size
  "name", [pytest.param(n, marks=pytest.mark.extended) for n in ("circle", "max_norm")] + ["orthogonal"]
)
@pytest.mark.parametrize("size", [1e-30, 1e30, F32_MAX])
def test_parameters_of_any_finite_size_are_moved_onto_the_manifold(name, size):
  # The constraint's own point (params + updates cannot carry a move from 1e30
  # to 0.5 in float32: the difference rounds to -1e30).
  constraint, param = _named(name)
  param = jnp.asarray(param).at[0, 0].set(size)
  point = jax.jit(lambda p: constraint.point(p, constraint.init(p)))(param)
  new, aux = constraint.unpack(point, param)
  assert float(aux.residual(new)) <= 1e-6
  nearest = cola.project_params({"w": param}, {"w": constraint})["w"]
  assert float(constraint.init(nearest).residual(nearest)) <= 1e-6


@pytest.mark.parametrize(  # quick: the largest step
  "step", [*(pytest.param(s, marks=pytest.mark.extended) for s in (1e19, 1e20, 1e30)), F32_MAX]
)
def test_circle_overdamped_huge_step_lands_on_the_side_it_points_to(step):
  r = 0.05
  c = cola.Circle(r)
  theta = jnp.float32([0.01, -0.02, 0.0, 0.049])
  point = c.point(theta, c.init(theta))
  for sign in (1.0, -1.0):
    # h g = sign * step: the weight moves towards -sign * infinity.
    grad = jnp.full(4, sign * step, jnp.float32)
    new = jax.jit(lambda p, g: langevin.overdamped_step(c, p, g, 1.0))(point, grad)
    weight, state = c.unpack(new, theta)
    np.testing.assert_allclose(weight, np.full(4, -sign * r), rtol=2 * np.finfo(np.float32).eps)
    assert np.all(np.isfinite(state.slack)) and np.all(np.abs(state.slack) <= 1e-6 * r)


@pytest.mark.parametrize(  # quick: the circle at the largest angle
  ("name", "size"),
  quick_or_extended(
    [(n, s) for n in ("circle", "max_norm") for s in (1e7, 1e8, 1e20, 1e30)],
    {("circle", 1e30)},
    ids=lambda n, s: f"{s}-{n}",
  ),
)
def test_underdamped_large_angles_keep_the_radius(name, size):
  # h = 0.3, r = 0.05: rotation angles of 6e7 to 6e30 radians.
  constraint = cola.Circle(0.05) if name == "circle" else cola.MaxNorm(0.05)
  param = np.full((3, 2), 0.01, np.float32)
  grad = np.full_like(param, size)
  grad[0] = -size
  new, state = _run(_transform("ud", constraint, learning_rate=0.3), param, grad, steps=3)
  assert float(state.constraint_states["w"].residual(new)) <= 1e-6


def test_circle_a_step_turns_by_the_exact_angle_below_2_to_13_and_keeps_the_radius_above():
  r, h = 0.5, 1.0
  c = cola.Circle(r)
  theta = jnp.zeros(6, jnp.float32)  # the point (0, r): angle pi/2
  point = c.point(theta, c.init(theta))
  v = jnp.float32([0.3, -2.0, 101.7, -1234.5, 4095.9, -4095.0])  # angles up to 8191.8 rad
  (new_theta, new_xi), _ = jax.jit(lambda p, v: c.a_step(p, v, h))(point, v)
  angle = np.asarray(v * np.float32(h / r), np.float64)  # the float32 angle, reduced in float64
  np.testing.assert_allclose(new_theta, r * np.sin(angle), atol=2e-7)
  np.testing.assert_allclose(new_xi, r * np.cos(angle), atol=2e-7)
  big = jnp.float32([1e5, 3e9, -7e19, 1e30, 1.7e38])
  (new_theta, new_xi), _ = jax.jit(lambda p, v: c.a_step(p, v, h))((point[0][:5], point[1][:5]), big)
  radius = np.hypot(np.asarray(new_theta, np.float64), np.asarray(new_xi, np.float64))
  np.testing.assert_allclose(radius, r, rtol=3e-7)


# --------------------------------------------------------------------------------------
# A step size of exactly 0 (the end of optax.cosine_decay_schedule)


@pytest.mark.slow  # quick profile: tests/test_properties.py draws these inputs
@pytest.mark.parametrize("constraint, shape", params())
@pytest.mark.parametrize("method", ["od", "ud-OBA", "ud-BAOAB"])
def test_zero_step_size_moves_nothing(constraint, shape, method):
  param = start(constraint, shape)
  schedule = optax.cosine_decay_schedule(0.1, decay_steps=2)  # 0.1, 0.05, then exactly 0
  assert float(schedule(2)) == 0.0
  if method == "od":
    tx = cola.cola_od(schedule, constraints={"w": constraint})
  else:
    tx = cola.cola_ud(schedule, friction=1.0, constraints={"w": constraint}, splitting=method.split("-")[1])
  params = {"w": jnp.asarray(param)}
  state = tx.init(params)
  grads = {"w": jnp.full_like(params["w"], 0.3)}
  update = jax.jit(tx.update)
  for _ in range(2):
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  before, momentum_before = params["w"], getattr(state, "momentum", None)
  for _ in range(2):  # h = 0
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  r = float(jnp.max(jnp.abs(before)))
  # Each of the two steps re-establishes the constraint: a unit of 6 weights and a slack renormalised, at most.
  np.testing.assert_allclose(params["w"], before, rtol=0, atol=2 * rounding.renormalised(7) * r)
  assert _converged(state)
  assert float(state.constraint_states["w"].residual(params["w"])) <= 1e-6
  if momentum_before is not None:
    momentum = state.momentum["w"]
    assert np.all(np.isfinite(momentum))
    np.testing.assert_allclose(momentum, momentum_before["w"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# Leaves of every float dtype


DTYPES = [jnp.float16, jnp.bfloat16, jnp.float64]  # float32: every other test


@pytest.mark.slow  # quick profile: tests/test_properties.py draws these inputs
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", ["circle", "max_norm", "orthogonal", "implicit"])
@pytest.mark.parametrize("method", ["od", "ud"])
def test_every_float_dtype_keeps_shape_dtype_and_constraint(dtype, name, method):
  constraint, param = _named(name)
  with jax.enable_x64(dtype == jnp.float64):
    param = jnp.asarray(param, dtype)
    grad = jnp.asarray(np.random.default_rng(2).normal(size=param.shape), dtype)
    new, state = _run(_transform(method, constraint), param, grad, steps=3)
    assert new.shape == param.shape and new.dtype == param.dtype
    assert _converged(state)
    # The leaf is stored in its dtype: the constraint holds to its rounding.
    eps = float(jnp.finfo(dtype).eps)
    tolerance = max(8 * eps, 2e-6) if dtype != jnp.float64 else 1e-6
    assert float(state.constraint_states["w"].residual(new)) <= tolerance
