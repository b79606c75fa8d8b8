"""Generated inputs: every method keeps shapes and dtypes and ends on the manifold, or says it did not.

For every constraint of the registry, both dynamics and both splittings,
hypothesis draws a leaf (zero-size, wide, tall, N-d kernels), a dtype
(float16, bfloat16, float32, float64), hyperparameters and gradients from
1e-30 to 1e30, inf and NaN. After two updates each leaf must keep its shape and
dtype and be on its manifold to the dtype's tolerance, or the step is flagged
(``ProjectionInfo.converged`` / ``ImplicitState.converged`` False), or a NaN
shows in the parameter or its residual.

Profiles: ``quick`` (the default, few derandomized examples; compilation
dominates, so shapes come from a small set and hyperparameters are traced
arguments of one compiled step per method, shape and dtype) and ``long``
(``pytest -m slow``).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cola_jax as cola


def _unit_norm(w):
  return jnp.sum(w * w) - 1.0


_IMPLICIT_UNIT_NORM = cola.Implicit(equality=_unit_norm)  # defined once: equal across updates

# The constraints under test, one line each: name -> (factory, which leaf shapes it takes).
CONSTRAINTS = {
    "free": (lambda: None, lambda shape: True),
    "circle": (lambda: cola.Circle(0.5), lambda shape: True),
    "sphere": (lambda: cola.Sphere(1.0), lambda shape: True),
    "orthogonal": (lambda: cola.Orthogonal(), lambda shape: len(shape) >= 2),
    "implicit": (lambda: _IMPLICIT_UNIT_NORM, lambda shape: math.prod(shape) >= 2),
}

# Dynamics: name -> transform from (learning_rate, temperature, friction, constraint, key).
METHODS = {
    "cola_od": lambda h, tau, gamma, c, key: cola.cola_od(h, constraints=c, temperature=tau, key=key),
    "cola_ud_oba": lambda h, tau, gamma, c, key: cola.cola_ud(
        h, friction=gamma, constraints=c, temperature=tau, key=key, splitting="OBA"),
    "cola_ud_baoab": lambda h, tau, gamma, c, key: cola.cola_ud(
        h, friction=gamma, constraints=c, temperature=tau, key=key, splitting="BAOAB"),
}

SHAPES = [(), (5,), (0, 3), (3, 0), (1, 1), (6, 2), (2, 5), (4, 4), (2, 2, 3), (3, 3, 2, 4)]
LOW_DTYPES = ["float32", "float16", "bfloat16"]
# Gradient scales, and the special values that may replace one entry.
SCALES = [1e-30, 1e-10, 1e-3, 1.0, 1e3, 1e10, 1e19, 1e30]
SPECIALS = [None, 0.0, float("inf"), -float("inf"), float("nan")]

# Tolerance on the residual after an update, by parameter dtype: a leaf is
# stored in its own dtype, so its rounding (relative eps) bounds what the
# residual can show, a few times over.
TOLERANCE = {"float16": 8e-3, "bfloat16": 6e-2, "float32": 2e-5, "float64": 2e-5}

settings.register_profile(
    "quick", max_examples=10, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "long", max_examples=200, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])


def fixed_layout(constraint_name, dtypes):
  """Every shape the constraint takes, the dtypes in turn: one compilation covers them all."""
  shapes = [s for s in SHAPES if CONSTRAINTS[constraint_name][1](s)]
  return tuple((shape, dtypes[i % len(dtypes)]) for i, shape in enumerate(shapes))


def drawn_layouts(constraint_name, dtypes):
  shapes = [s for s in SHAPES if CONSTRAINTS[constraint_name][1](s)]
  leaf = st.tuples(st.sampled_from(shapes), st.sampled_from(dtypes))
  return st.lists(leaf, min_size=1, max_size=3).map(tuple)


@st.composite
def problems(draw, layouts):
  layout = draw(layouts)
  return dict(
      layout=layout,
      seed=draw(st.integers(0, 2**16)),
      scales=[draw(st.sampled_from(SCALES)) for _ in layout],
      specials=[draw(st.sampled_from(SPECIALS)) for _ in layout],
      h=draw(st.sampled_from([1e-4, 1e-2, 0.1, 0.3, 1.0])),
      tau=draw(st.sampled_from([0.0, 1e-6, 1e-3, 1.0])),
      gamma=draw(st.sampled_from([0.0, 0.1, 1.0, 10.0])))


@functools.lru_cache(maxsize=None)
def _compiled_steps(method, constraint_name, layout, x64):
  """Two updates as one compiled function of (params, grads, h, tau, gamma, key)."""
  del layout, x64  # part of the cache key: jit compiles per shape and dtype anyway
  constraint = CONSTRAINTS[constraint_name][0]()

  def run(params, grads, h, tau, gamma, key):
    constraints = {name: (None if name == "b" else constraint) for name in params}
    tx = METHODS[method](h, tau, gamma, constraints, key)
    state = tx.init(params)
    trajectory = []
    for _ in range(2):
      updates, state = tx.update(grads, state, params)
      trajectory.append((updates, state))
      params = optax.apply_updates(params, updates)
    return params, trajectory, cola.constraint_residuals(params, state)

  return jax.jit(run)


def _flagged(states, name) -> bool:
  converged = [getattr(state.constraint_states[name], "converged", None) for state in states]
  return any(c is not None and not bool(c) for c in converged)


def check_method(method, constraint_name, problem):
  rng = np.random.default_rng(problem["seed"])
  params, grads = {"b": jnp.zeros(3)}, {"b": jnp.ones(3)}
  for i, ((shape, dtype), scale, special) in enumerate(
      zip(problem["layout"], problem["scales"], problem["specials"])):
    grad = np.sign(rng.standard_normal(shape)) * scale
    if special is not None and grad.size:
      grad.flat[rng.integers(grad.size)] = special
    params[f"w{i}"] = jnp.asarray(0.3 * rng.standard_normal(shape), dtype)
    with np.errstate(over="ignore"):  # 1e30 is inf in float16: meant
      grads[f"w{i}"] = jnp.asarray(grad, dtype)
  step = _compiled_steps(method, constraint_name, problem["layout"], jax.config.jax_enable_x64)
  new, trajectory, residuals = step(
      params, grads, problem["h"], problem["tau"], problem["gamma"], jax.random.key(problem["seed"]))

  shapes = jax.tree.map(lambda p: (p.shape, p.dtype), params)
  for updates, _ in trajectory:
    assert jax.tree.map(lambda u: (u.shape, u.dtype), updates) == shapes
  assert jax.tree.map(lambda p: (p.shape, p.dtype), new) == shapes
  states = [state for _, state in trajectory]
  for i, (shape, dtype) in enumerate(problem["layout"]):
    name, residual = f"w{i}", residuals[f"w{i}"]
    if residual is None:  # a free leaf, or one without entries
      continue
    visible_nan = not (bool(jnp.all(jnp.isfinite(new[name]))) and math.isfinite(float(residual)))
    on_manifold = float(residual) <= TOLERANCE[dtype]
    assert on_manifold or _flagged(states, name) or visible_nan, (
        f"{method} with {constraint_name}: residual {float(residual):.3g} after a silent step "
        f"(leaf {shape} {dtype}, h={problem['h']}, tau={problem['tau']}, gamma={problem['gamma']}, "
        f"|grad| = {problem['scales'][i]:.3g}, special entry {problem['specials'][i]})")


def _test(method, constraint_name, data, layouts):
  problem = data.draw(problems(layouts))
  with jax.enable_x64(any(dtype == "float64" for _, dtype in problem["layout"])):
    check_method(method, constraint_name, problem)


# Cases the geometry of this branch does not handle yet; fixed on the
# rel-geometry branch (issue 11). Those that hang are not run.
_HANGS = "needs rel-geometry: a non-finite step under Orthogonal hangs in the polar SVD"
_BREAKS = "needs rel-geometry: large rotation angles and squares that overflow break the constraint"
NEEDS_GEOMETRY_FIX = {
    **{(m, "orthogonal"): (_HANGS, False) for m in METHODS},
    **{(m, c): (_BREAKS, True) for m in METHODS for c in ("circle", "sphere")},
}


def _marks(method, constraint_name):
  if (method, constraint_name) not in NEEDS_GEOMETRY_FIX:
    return []
  reason, run = NEEDS_GEOMETRY_FIX[(method, constraint_name)]
  return [pytest.mark.xfail(reason=reason, run=run, strict=False)]


CASES = [pytest.param(m, c, id=f"{m}-{c}", marks=_marks(m, c)) for m in METHODS for c in CONSTRAINTS]
CASES_X64 = [case for case in CASES if case.values[0] == "cola_ud_baoab"]


@pytest.mark.parametrize("method, constraint_name", CASES)
@settings(settings.get_profile("quick"))
@given(data=st.data())
def test_update_keeps_shapes_and_the_manifold_or_flags(method, constraint_name, data):
  _test(method, constraint_name, data, st.just(fixed_layout(constraint_name, LOW_DTYPES)))


@pytest.mark.parametrize("method, constraint_name", CASES_X64)
@settings(settings.get_profile("quick"))
@given(data=st.data())
def test_update_keeps_shapes_and_the_manifold_or_flags_float64(method, constraint_name, data):
  _test(method, constraint_name, data, st.just(fixed_layout(constraint_name, ["float64"])))


@pytest.mark.slow
@pytest.mark.parametrize("method, constraint_name", CASES)
@settings(settings.get_profile("long"))
@given(data=st.data())
def test_update_keeps_shapes_and_the_manifold_or_flags_long(method, constraint_name, data):
  _test(method, constraint_name, data, drawn_layouts(constraint_name, LOW_DTYPES + ["float64"]))
