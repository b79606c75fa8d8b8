"""The flag is a promise: no point off the manifold reads as converged, and NaN always shows.

Tangential steps whose spectral norm runs on a log scale from 0.1 to 1e4 (a
square kernel's projection has no root beyond 1), NaN and inf planted in
parameters, gradients, momenta and slacks, and the orthogonal RNN of issue 21.
The quick suite runs a few points of each sweep, ``-m extended`` a few more; ``-m slow`` runs them all.
"""

import dataclasses
import functools

import _constraints as registry
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended

import cola_jax as cola
from cola_jax import langevin
from cola_jax.constraints import stiefel_projection
from cola_jax.constraints.orthogonal import StiefelPoint, tall_view

# --------------------------------------------------------------------------------------
# Orthogonal: tangential steps of any size, every solver and shape, od and ud

# s = 64 columns: XLA:CPU's max reduction drops NaN from a 64 x 64 defect (not from small ones).
SHAPES = {"square": (64, 64), "tall": (96, 64), "wide": (64, 96), "conv": (3, 3, 8, 64)}
SOLVERS = ("quasi_newton", "newton", "square_root")
ALL_SIZES = tuple(float(s) for s in np.logspace(-1, 4, 11))  # the step's spectral norm
QUICK_SIZES = (0.1, 0.5, 0.9, 1.5, 40.0, 1e4)


def _tangential_steps(shape, sizes):
  """The start ``Q_n`` (tall view) and tangential steps ``Q_n A`` with ``|A|_2`` = each size."""
  w = cola.Orthogonal().nearest(jax.random.normal(jax.random.key(0), shape))
  q_n = tall_view(w)
  a = jax.random.normal(jax.random.key(1), (q_n.shape[1],) * 2)
  a = (a - a.T) / jnp.linalg.norm(a - a.T, 2)
  return q_n, jnp.stack([s * q_n @ a for s in sizes])


@functools.partial(jax.jit, static_argnums=0)
def _od(constraint, q_n, steps):
  point = StiefelPoint(q_n, constraint.init(q_n))
  # h = 1 and the gradient -step: the unprojected point is Q_n + step.
  return jax.vmap(lambda step: langevin.overdamped_step(constraint, point, -step, 1.0))(steps)


@functools.partial(jax.jit, static_argnums=0)
def _ud(constraint, q_n, steps):
  point = StiefelPoint(q_n, constraint.init(q_n))
  return jax.vmap(lambda step: langevin.a_step(constraint, point, step, 1.0))(steps)


def _check_tangential_sweep(solver, shape_name, method, sizes):
  constraint = cola.Orthogonal(projection=solver, tolerance=1e-6)
  q_n, steps = _tangential_steps(SHAPES[shape_name], sizes)
  out = (_od if method == "od" else _ud)(constraint, q_n, steps)
  points, momenta = (out, None) if method == "od" else out
  eye = np.eye(q_n.shape[1])
  for i, size in enumerate(sizes):
    q = np.asarray(points.matrix[i], np.float64)
    converged = bool(points.info.converged[i])
    case = f"{solver} {shape_name} {method} |A|_2 = {size:.3g}, converged={converged}"
    # On the manifold whether flagged or not (the polar factor finishes a flagged step).
    assert np.abs(q.T @ q - eye).max() <= 5e-6, case
    if size <= 0.5:  # beyond, the solvers may need more than max_iterations: flagged then
      assert converged, case
    if size >= 1.01:  # no root: ||skew(Q_n^T Q)||_2 <= 1 for every Q on the manifold
      assert not converged, case
    if converged:  # the paper's point: Q - Q_bar = -Q_n Lambda, Lambda symmetric
      force = q - np.asarray(q_n + steps[i], np.float64)
      multiplier = q_n.T @ force
      assert np.abs(multiplier - multiplier.T).max() <= 1e-4 * (1 + size**2), case
      np.testing.assert_allclose(q_n @ multiplier, force, atol=1e-4 * (1 + size**2), err_msg=case)
    if momenta is not None:  # the RATTLE momentum is cotangent at the new point
      p = np.asarray(momenta[i], np.float64)
      sym = q.T @ p + p.T @ q
      assert np.abs(sym).max() <= 1e-4 * (1 + np.abs(p).max()), case


# The quick suite: the default solver on the square kernel; extended: each other solver once, the wide shape, ud.
QUICK_SWEEPS = [
  ("quasi_newton", "square", "od"),
  pytest.param("newton", "square", "ud", marks=pytest.mark.extended),
  pytest.param("square_root", "wide", "od", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("solver, shape_name, method", QUICK_SWEEPS)
def test_tangential_steps_of_any_size_are_the_papers_point_or_flagged(solver, shape_name, method):
  _check_tangential_sweep(solver, shape_name, method, QUICK_SIZES)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["od", "ud"])
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
@pytest.mark.parametrize("solver", SOLVERS)
def test_tangential_step_sweep(solver, shape_name, method):
  _check_tangential_sweep(solver, shape_name, method, ALL_SIZES)


@pytest.mark.extended  # quick: test_tangential_steps_of_any_size_are_the_papers_point_or_flagged (its flags)
def test_tangential_norm_bound_is_a_lower_bound_that_detects_the_square_case():
  a = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
  a = (a - a.T) / np.linalg.norm(a - a.T, 2)
  eye = jnp.eye(16)
  sizes = jnp.array([0.5, 1.1, 3.0])
  bounds = jax.jit(jax.vmap(lambda size: stiefel_projection.tangential_norm_bound(eye, eye + size * a)))(sizes)
  for bound, size in zip(np.asarray(bounds), np.asarray(sizes)):
    assert 0.5 * size <= bound <= size * (1 + 1e-5)
  assert np.isnan(float(stiefel_projection.tangential_norm_bound(eye, eye.at[0, 0].set(np.nan))))


# --------------------------------------------------------------------------------------
# NaN and inf planted in parameters, gradients, momenta and slacks


# Every constraint of the registry on a leaf large enough for XLA:CPU's max reduction to drop NaN (a 64 x 64 Gram
# matrix, 5120 entries), from a point of it.
SHAPE = (80, 64)
NAMES = [name for name, _, _ in registry.CASES]


def _plant(tree, value):
  """The tree with ``value`` in the first entry of each of its non-empty float leaves."""

  def plant(x):
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or x.size == 0:
      return x
    return jnp.asarray(x).reshape(-1).at[0].set(value).reshape(x.shape)

  return jax.tree.map(plant, tree)


def _shows(params, state, name="w", repaired_is_fine=False):
  """Whether a non-finite value shows: in the parameter, its residual, or the flag.

  With ``repaired_is_fine`` a finite parameter on its manifold passes too (the
  geometry rebuilt the planted value from the parameter).
  """
  residual = cola.constraint_residuals(params, state)[name]
  finite = bool(jnp.all(jnp.isfinite(params[name]))) and bool(jnp.isfinite(residual))
  converged = getattr(state.constraint_states[name], "converged", True)
  repaired = repaired_is_fine and finite and float(residual) <= 1e-5
  return not finite or not bool(converged) or repaired


def _with_slack(aux, slack):
  return aux._replace(slack=slack) if hasattr(aux, "_replace") else dataclasses.replace(aux, slack=slack)


# The quick suite: a gradient and a momentum, jitted (test_conformance.py plants a NaN in a parameter and a momentum);
# extended: the other places once; -m slow: every constraint at every place, eager and jitted.
QUICK_PLANTS = [
  pytest.param("unit_norm", "param", marks=pytest.mark.extended),
  ("non_negative", "grad"),
  ("orthogonal", "momentum"),
  pytest.param("circle", "slack", marks=pytest.mark.extended),
]
ALL_PLANTS = [(name, where) for name in NAMES for where in ("param", "grad", "momentum", "slack")]


@pytest.mark.parametrize("name, where", QUICK_PLANTS)
def test_planted_nan_and_inf_always_show(name, where):
  _check_planted(name, where, jit=True)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name, where", ALL_PLANTS)
def test_planted_nan_and_inf_always_show_everywhere(name, where, jit):
  _check_planted(name, where, jit)


def _check_planted(name, where, jit):
  constraint = registry.case(name)[0]
  params = {"w": jnp.asarray(registry.start(constraint, SHAPE))}
  tx = cola.cola_ud(0.1, friction=1.0, constraints={"w": constraint})
  state = tx.init(params)
  aux = state.constraint_states["w"]
  if where == "slack" and getattr(aux, "slack", jnp.zeros(0)).size == 0:
    pytest.skip(f"{name} has no slack")
  update = jax.jit(tx.update) if jit else tx.update
  for value in (np.nan, np.inf):
    grads = {"w": jnp.full_like(params["w"], 0.1)}
    bad_params, bad_state = params, state
    if where == "param":
      bad_params = _plant(params, value)
    elif where == "grad":
      grads = _plant(grads, value)
    elif where == "momentum":
      bad_state = state._replace(momentum=_plant(state.momentum, value))
    else:
      bad_state = state._replace(constraint_states={"w": _with_slack(aux, _plant(aux.slack, value))})
    updates, new_state = update(grads, bad_state, bad_params)
    new_params = optax.apply_updates(bad_params, updates)
    assert _shows(new_params, new_state, repaired_is_fine=where == "slack"), (name, where, value)


# The quick suite: the Stiefel manifold; extended: a constraint of each other kind (the others' residuals are the
# same code); -m slow the rest.
QUICK_RESIDUALS = {"orthogonal", "circle", "max_norm", "box", "non_negative", "unit_norm", "implicit"}


@pytest.mark.parametrize(
  "name",
  quick_or_extended(
    [(n,) for n in NAMES], {("orthogonal",)}, ids=str, extended={(n,) for n in QUICK_RESIDUALS - {"orthogonal"}}
  ),
)
def test_residual_of_a_non_finite_leaf_is_never_finite(name):
  constraint = registry.case(name)[0]
  params = {"w": jnp.asarray(registry.start(constraint, SHAPE))}
  state = cola.cola_od(0.1, constraints={"w": constraint}).init(params)
  for bad in (_plant(params, np.nan), {"w": jnp.full_like(params["w"], np.nan)}, _plant(params, np.inf)):
    for residuals in (cola.constraint_residuals, jax.jit(cola.constraint_residuals)):
      assert not np.isfinite(float(residuals(bad, state)["w"])), name


# --------------------------------------------------------------------------------------
# The orthogonal RNN of issue 21, its first steps


def _adding_task(key, batch, length):
  values_key, first_key, second_key = jax.random.split(key, 3)
  values = jax.random.uniform(values_key, (batch, length))
  first = jax.random.randint(first_key, (batch,), 0, length // 2)
  second = jax.random.randint(second_key, (batch,), length // 2, length)
  marks = jax.nn.one_hot(first, length) + jax.nn.one_hot(second, length)
  return jnp.stack([values, marks], -1), jnp.sum(values * marks, -1)


def _rnn_loss(params, inputs, targets):
  def cell(hidden, x):
    return jnp.tanh(hidden @ params["recurrent"] + x @ params["input"]), None

  hidden, _ = jax.lax.scan(cell, jnp.zeros((inputs.shape[0], 64)), jnp.swapaxes(inputs, 0, 1))
  return jnp.mean((hidden @ params["readout"][:, 0] - targets) ** 2)


@pytest.mark.extended  # quick: the tangential steps of any size on a 64 x 64 square matrix above
def test_orthogonal_rnn_at_a_large_step_keeps_its_recurrent_matrix_orthonormal():
  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    "recurrent": cola.Orthogonal().nearest(jax.random.normal(keys[0], (64, 64))),
    "input": jax.random.normal(keys[1], (2, 64)),
    "readout": jax.random.normal(keys[2], (64, 1)),
  }
  mask = {"recurrent": True, "input": False, "readout": False}
  tx = cola.o_cola_ud(0.3, friction=1.0, mask=mask, temperature=1e-6, key=keys[3])
  state = tx.init(params)

  @jax.jit
  def step(params, state, key):
    grads = jax.grad(_rnn_loss)(params, *_adding_task(key, 64, 50))
    updates, state = tx.update(grads, state, params)
    finite = jnp.all(jnp.isfinite(grads["recurrent"]))
    return optax.apply_updates(params, updates), state, finite

  for i in range(4):
    params, state, finite = step(params, state, jax.random.key(10 + i))
    w = np.asarray(params["recurrent"], np.float64)
    if bool(finite):
      assert np.abs(w.T @ w - np.eye(64)).max() <= 1e-5, i
    else:
      assert _shows(params, state, "recurrent"), i


@pytest.mark.extended  # quick: test_tangential_steps_of_any_size_are_the_papers_point_or_flagged
def test_small_steps_skip_the_root_bound_and_agree_with_it():
  # |D|_F <= 1/2 answers "a root may exist" without the power steps; the fixed form always runs them.
  rng = np.random.default_rng(3)
  q_n = jnp.linalg.qr(jnp.asarray(rng.normal(size=(32, 8)), jnp.float32))[0]
  a = rng.normal(size=(8, 8)).astype(np.float32)
  tangential = jnp.asarray(q_n @ ((a - a.T) / np.linalg.norm(a - a.T, 2)))  # |skew(Q_n^T D)|_2 = 1 per unit size
  random = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
  random = random / jnp.linalg.norm(random)
  constraint = cola.Orthogonal()
  has_root = jax.jit(constraint._has_root, static_argnums=2)
  for direction in (tangential, random):
    for size in (1e-3, 0.1, 0.5, 0.6, 1.5, 3.0, np.inf, np.nan):
      step = direction * np.float32(size)
      fast, full = bool(has_root(q_n, step, False)), bool(has_root(q_n, step, True))
      assert fast == full, (size, fast, full)
      frobenius = size * float(jnp.linalg.norm(direction))
      if frobenius <= 0.5:
        assert fast
  # A tangential step of spectral norm 1.5 or 3 has no root (and the bound finds it); non-finite steps neither.
  for size in (1.5, 3.0, np.inf, np.nan):
    assert not bool(has_root(q_n, tangential * np.float32(size), False))
