"""Eager and compiled evaluation of every constraint agree, on edge inputs.

XLA rewrites a compiled program before it runs: its algebraic simplifier
reassociates products with constants, and its constant folder evaluates what
is known at compile time (in exact IEEE arithmetic, where compiled code flushes
subnormal numbers to zero). Op by op (eager) every operation runs as written.
A rewrite that is exact in real arithmetic need not be in floating point:
scaled by the power of two that brings a zero unit to order one
(``s = 2**126`` in float32), ``(0 s) (0 s)`` is 0, but XLA reassociates it into
``(s s) 0 = inf 0 = NaN``. That is how a zero ``UnitNorm`` unit, which the
eager call puts at ``r (1, ..., 1) / sqrt(n)``, came out of
``project_params`` as NaN.

Every constraint of the catalog is evaluated on edge inputs (zero leaves and
units, zero slacks, points exactly on the bounds, the poles of the sphere,
subnormal entries, zero momenta, ``h = 0``): its methods ``point``,
``nearest``, ``unpack``, ``project``, ``a_step`` and the state's ``residual``,
and the public functions ``project_params`` and ``constraint_residuals``, in
three ways:

* compiled, with the inputs as arguments (``jax.jit(f)(x)``);
* compiled, with the inputs closed over as compile-time constants
  (``jax.jit(lambda: f(x))()``), which XLA folds and reassociates;
* eager, op by op, under ``jax.disable_jit()`` (the public functions and
  ``nearest`` compile internally otherwise, see ``cola_jax._compiled``).

They must agree: NaN in the same entries and nowhere else, infinities equal,
integer and boolean outputs (iteration counts, convergence flags) equal, and
the numbers to ``ULPS`` ulps of the larger of 1 (the scale of every case:
radii and bounds of order one) and the output's largest entry: fused and
folded reductions sum in other orders, and the constant folder computes with
the subnormal numbers that compiled code reads as zero (their square roots,
the slacks of ``NonNegative``, are ``1e-19`` in float32). The A step gets
``ULPS / h`` ulps: its RATTLE momentum is a difference of positions divided
by ``h``. Units whose entries are all below the smallest normal number count
as zero units, so that the folder and the compiled code agree on them. A zero
``UnitNorm`` unit must be at ``r / sqrt(n)`` in every entry, in every mode.

Each case is one program per compiled mode (its edge inputs are separate
leaves of one call, so that each is a constant of its own when folded), and
eager Newton iterations are Python loops: compilation and those loops
dominate the run time, which the choice of inputs keeps to a few seconds per
case. The extended tier runs one of the cases (``EXTENDED``), the slow tier the
others, and adds shapes, solvers, float64, and bfloat16 parameters (through the
public functions: the geometry computes in float32 for them).
"""

import dataclasses
import math
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import _constraints as registry
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import quick_or_extended

import cola_jax as cola

ULPS = 4
H = 0.1  # the step size of the A steps


def _norm2_minus_one(w):
  return jnp.atleast_1d(jnp.sum(w * w) - 1)


UNIT_NORM_EQUALITY = cola.Implicit(equality=_norm2_minus_one, max_iterations=8)
UNIT_BALL = cola.Implicit(inequality=_norm2_minus_one, max_iterations=8)


def _eye(shape):
  """A leaf of ``shape`` whose tall matrix view has orthonormal columns (or rows): on the Stiefel manifold."""
  rows = math.prod(shape[:-1])
  return np.eye(max(rows, shape[-1]))[:rows, : shape[-1]].reshape(shape)


@dataclasses.dataclass(frozen=True)
class Case:
  """A constraint, its leaf shape, a parameter on its bounds and edge slacks.

  ``slacks`` are ``(parameter name, slack value)`` pairs: the state of that
  parameter with every slack set to the value. ``unprojectable`` names the
  parameters that ``nearest`` cannot put on the manifold (it raises eagerly).
  The parameters are zeros, subnormal numbers, small ones (with subnormal
  squares), ``bound``, a generic one and the ``extra`` ones, less ``skip``;
  steps and flights start from the points of the states ``moving``.
  """

  constraint: cola.Constraint
  shape: tuple[int, ...]
  bound: np.ndarray
  slacks: tuple[tuple[str, float], ...] = ()
  unprojectable: tuple[str, ...] = ()
  extra: tuple[tuple[str, np.ndarray], ...] = ()  # more named parameters
  skip: tuple[str, ...] = ()  # parameters left out
  moving: tuple[str, ...] = ("zeros", "bound")  # the states whose points steps and flights start from


R = 1.5
# Columns (the units of MaxNorm and UnitNorm): on the bound, on the bound the other way, zero, one with a
# subnormal entry.
UNITS = np.array([[R, 0.0, 0.0, R], [0.0, 0.0, 0.0, 1e-40], [0.0, -R, 0.0, 0.0]])
CASES = {
  # Circle and Box: zeros start at the pole (0, r); with a zero slack they are the origin.
  "circle": Case(
    cola.Circle(R),
    (2, 3),
    np.array([[R, -R, 0.0], [-R, R, -0.0]]),
    (("zeros", 0.0), ("zeros", -R)),
    moving=("bound", "zeros, slack -1.5"),
  ),
  "box": Case(
    cola.Box(-0.5, 2.0),
    (2, 3),
    np.array([[-0.5, 2.0, 0.75], [2.0, -0.5, -0.5]]),
    (("centre", 0.0),),
    extra=(("centre", np.full((2, 3), 0.75)),),
  ),
  # The origin, the antipodal pole; zeros start at the pole.
  "max_norm": Case(
    cola.MaxNorm(R), (3, 4), UNITS, (("zeros", 0.0), ("zeros", -R)), moving=("bound", "zeros, slack -1.5")
  ),
  "unit_norm": Case(cola.UnitNorm(R), (3, 4), UNITS, moving=("bound",)),
  "unit_norm_axis0": Case(cola.UnitNorm(1.0, axis=0), (2,), np.array([1.0, 0.0]), moving=("bound",)),
  "unit_norm_axis01": Case(
    cola.UnitNorm(0.5, axis=(0, 1)),
    (2, 2, 3),
    np.array([[[0.0, 0.5, 0.3], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, -0.4]]]),
    moving=("bound",),
  ),
  "orthogonal_tall": Case(cola.Orthogonal(), (4, 2), _eye((4, 2)), moving=("bound",)),
  "orthogonal_wide": Case(cola.Orthogonal(), (2, 4), _eye((2, 4)), moving=("bound",)),
  "orthogonal_conv": Case(cola.Orthogonal(), (2, 2, 2, 3), _eye((2, 2, 2, 3)), moving=("bound",)),
  "orthogonal_scaled": Case(cola.Orthogonal(scale=R), (4, 2), R * _eye((4, 2)), moving=("bound",)),
  # On the boundary sigma = R: the start rule moves it to 0.99 R, through the stacked polar factor.
  "max_spectral_norm_tall": Case(cola.MaxSpectralNorm(R), (4, 2), R * _eye((4, 2)), moving=("bound",)),
  "max_spectral_norm_wide": Case(cola.MaxSpectralNorm(R), (2, 3), 0.5 * _eye((2, 3)), moving=("bound",)),
  # The negative branch s = -sqrt(w).
  "non_negative": Case(
    cola.NonNegative(),
    (2, 3),
    np.array([[0.0, 1.0, -1.0], [-0.0, 4.0, 0.0]]),
    (("bound", -1.0),),
    moving=("bound", "bound, slack -1.0"),
  ),
  # Newton's iterations are Python loops when eager: the scaled norms' "small" inputs are left out, and
  # the equality moves from its manifold only (from zeros every projection fails, after max_iterations).
  "implicit_equality": Case(
    UNIT_NORM_EQUALITY, (2, 3), np.eye(2, 3), unprojectable=("zeros", "subnormal"), skip=("small",), moving=("bound",)
  ),
  # On the bound (a zero slack); the origin with a zero slack is off the manifold, and G = 0 there.
  "implicit_inequality": Case(UNIT_BALL, (2, 3), np.eye(2, 3), (("zeros", 0.0),), skip=("small",), moving=("bound",)),
}
# More shapes, solvers and loops, in the slow variant only.
SLOW_CASES = {
  "max_norm_vector": Case(
    cola.MaxNorm(0.5, axis=0),
    (3,),
    np.array([0.0, 0.5, 0.0]),
    (("zeros", -0.5),),
    moving=("zeros", "bound", "zeros, slack -0.5"),
  ),
  "max_norm_conv": Case(cola.MaxNorm(1.0), (2, 2, 1, 2), _eye((2, 2, 1, 2))),
  "unit_norm_conv": Case(cola.UnitNorm(3.0), (2, 2, 1, 2), 3 * _eye((2, 2, 1, 2))),
  "unit_norm_vector_default_axis": Case(cola.UnitNorm(2.0), (3, 2), np.array([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])),
  "orthogonal_square": Case(cola.Orthogonal(), (3, 3), _eye((3, 3))),
  "orthogonal_per_tap": Case(cola.Orthogonal(row_axes=2, column_axes=3), (2, 1, 3, 2), _eye((2, 1, 3, 2))),
  "max_spectral_norm_per_tap": Case(
    cola.MaxSpectralNorm(1.0, row_axes=2, column_axes=3), (2, 1, 3, 2), 0.5 * _eye((2, 1, 3, 2)), moving=("bound",)
  ),
  "orthogonal_newton": Case(cola.Orthogonal(projection="newton"), (4, 2), _eye((4, 2))),
  "orthogonal_square_root_fixed": Case(cola.Orthogonal(projection="square_root", loop="fixed"), (3, 3), _eye((3, 3))),
  "implicit_per_unit": Case(
    cola.Implicit(equality=_norm2_minus_one, axis=0, quasi_newton=True),
    (3, 2),
    np.eye(3, 2),
    unprojectable=("zeros", "subnormal", "small"),
  ),
  "implicit_fixed_loop": Case(
    cola.Implicit(inequality=_norm2_minus_one, loop="fixed", max_iterations=8),
    (2, 2),
    np.eye(2),
    (("zeros", 0.0),),
    moving=("zeros", "bound", "zeros, slack 0.0"),
  ),
}


def test_every_constraint_of_the_registry_has_edge_cases_here():
  """The edge inputs are written per constraint (its bounds, its poles): one missing leaves its constraint out."""
  assert {type(c).__name__ for _, c, _ in registry.CASES} <= {type(case.constraint).__name__ for case in CASES.values()}


def _with_slack(aux, value):
  slack = jnp.full_like(aux.slack, value)
  return aux._replace(slack=slack) if isinstance(aux, tuple) else dataclasses.replace(aux, slack=slack)


def _ambient(point):
  """A point as an ambient vector (a step of the opposite sign takes it to the origin)."""
  if hasattr(point, "matrix"):  # Orthogonal
    return point.matrix
  if hasattr(point, "x"):  # Implicit: flat, the leaf then the slacks
    return jnp.concatenate([point.x.ravel(), point.slack.ravel()])
  return point


def _inputs(case: Case, dtype):
  """The edge inputs of a case: parameters, states, steps and flights, each a dict of named leaves."""
  c = case.constraint
  info = jnp.finfo(dtype)
  subnormal = 0.375 * float(info.tiny)
  signs = np.where(np.arange(math.prod(case.shape)).reshape(case.shape) % 2, -1.0, 1.0)
  params = {
    "zeros": jnp.zeros(case.shape, dtype),
    "subnormal": jnp.asarray(subnormal * signs, dtype),
    # Normal, with subnormal squares: about 1e-21 in float32.
    "small": jnp.asarray(
      0.01 * math.sqrt(float(info.tiny)) * signs * np.arange(1, signs.size + 1).reshape(signs.shape), dtype
    ),
    "bound": jnp.asarray(case.bound, dtype),
    "generic": (2 * jax.random.normal(jax.random.key(0), case.shape)).astype(dtype),
    **{name: jnp.asarray(value, dtype) for name, value in case.extra},
  }
  params = {name: p for name, p in params.items() if name not in case.skip}

  @jax.jit
  def build(params):
    states = {name: (p, c.init(p)) for name, p in params.items()}
    for name, value in case.slacks:
      states[f"{name}, slack {value}"] = (params[name], _with_slack(c.init(params[name]), value))
    points = {name: c.point(*states[name]) for name in case.moving}
    step = {name: jax.tree.map(lambda v: 0.3 * v, c.ambient_normal(jax.random.key(1), p)) for name, p in points.items()}
    momentum = {name: c.cotangent_normal(p, c.cotangent_draw(jax.random.key(2), p)) for name, p in points.items()}
    return states, points, step, momentum

  states, points, step, momentum = build(params)
  # Scaled here, in numpy: compiled code would flush the subnormal results to zero.
  tiny_step = jax.tree.map(lambda v: jnp.asarray(np.asarray(v) * np.asarray(subnormal / 0.3, v.dtype)), step["bound"])
  tiny_momentum = jnp.asarray(np.asarray(momentum["bound"]) * np.asarray(subnormal, dtype))
  assert 0 < np.max(np.abs(np.asarray(tiny_momentum, np.float64))) < float(info.tiny)
  h, zero = jnp.asarray(H, dtype), jnp.asarray(0.0, dtype)
  steps, flights = {}, {}
  for name, point in points.items():
    steps[f"{name} + step"] = (point, step[name])
    steps[f"{name} + step to the origin"] = (point, jax.tree.map(jnp.negative, _ambient(point)))
    flights[f"{name}, zero momentum"] = (point, jnp.zeros_like(momentum[name]), h)
    flights[f"{name}, flight"] = (point, momentum[name], h)
  steps["bound + zero step"] = (points["bound"], jax.tree.map(jnp.zeros_like, step["bound"]))
  steps["bound + subnormal step"] = (points["bound"], tiny_step)
  flights["bound, h = 0"] = (points["bound"], momentum["bound"], zero)
  flights["bound, subnormal momentum"] = (points["bound"], tiny_momentum, h)
  return params, states, steps, flights


def _everything(c: cola.Constraint, unprojectable, params, states, steps, flights, opt_state):
  """Every method of ``c`` on every edge input, and the public functions."""
  projectable = {name: p for name, p in params.items() if name not in unprojectable}
  points = {name: c.point(p, aux) for name, (p, aux) in states.items()}
  return {
    "point": points,
    "unpack": {name: c.unpack(points[name], p) for name, (p, _) in states.items()},
    "residual": {name: aux.residual(p) for name, (p, aux) in states.items()},
    "nearest": {name: c.nearest(p) for name, p in projectable.items()},
    "project": {name: c.project(anchor, step) for name, (anchor, step) in steps.items()},
    "a_step": {name: c.a_step(point, momentum, h) for name, (point, momentum, h) in flights.items()},
    # nearest again, less the parameters' other inputs.
    "project_params": cola.project_params(
      {name: projectable[name] for name in ("zeros", "bound") if name in projectable}, c
    ),
    "constraint_residuals": cola.constraint_residuals(params, opt_state),
  }


def _three_ways(fn, *args):
  """``fn(*args)`` compiled with the inputs as arguments, compiled with them as constants, and eager."""
  results = {"jit": jax.jit(fn)(*args), "jit, constant inputs": jax.jit(lambda: fn(*args))()}
  with jax.disable_jit():
    results["eager"] = fn(*args)
  return results


def _disagreement(a, b, ulps):
  """Why ``a`` and ``b`` differ, or None where they agree (see the module docstring)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
  if not jnp.issubdtype(a.dtype, jnp.inexact):
    return None if np.array_equal(a, b) else f"{a} vs {b}"
  x, y = a.astype(np.float64), b.astype(np.float64)
  if not np.array_equal(np.isnan(x), np.isnan(y)):
    return f"NaN in {x} vs {y}"
  if not (np.array_equal(np.isinf(x), np.isinf(y)) and np.array_equal(x[np.isinf(x)], y[np.isinf(y)])):
    return f"infinities in {x} vs {y}"
  finite = np.isfinite(y)
  tolerance = ulps * float(jnp.finfo(a.dtype).eps) * max(np.max(np.abs(y[finite]), initial=0.0), 1.0)
  error = np.max(np.abs(x[finite] - y[finite]), initial=0.0)
  if error > tolerance:
    return f"{x} vs {y} (differ by {error:.3g}, more than {tolerance:.3g})"
  return None


def _assert_agree(results):
  """Every mode's result against the eager one; see the module docstring for the tolerances."""
  reference, reference_tree = jax.tree_util.tree_flatten_with_path(results["eager"])
  failures = []
  for mode, result in results.items():
    leaves, tree = jax.tree_util.tree_flatten_with_path(result)
    assert tree == reference_tree, f"{mode} vs eager: {tree} vs {reference_tree}"
    for (path, a), (_, b) in zip(leaves, reference):
      # RATTLE's new momentum (Orthogonal, Implicit) is a difference of positions divided by h.
      why = _disagreement(a, b, ULPS / H if path[0].key == "a_step" else ULPS)
      if why is not None:
        failures.append(f"{mode} vs eager at {jax.tree_util.keystr(path)}: {why}")
  assert not failures, "\n".join(failures)


def _assert_zero_units_at_the_documented_point(c: cola.UnitNorm, params, result, dtype):
  """Units of zeros and of subnormal numbers are put at ``r (1, ..., 1) / sqrt(n)``, as is a step to the origin."""
  axes = c.init(params["zeros"]).axes
  n = math.prod(params["zeros"].shape[a] for a in axes)
  expected = c.radius / math.sqrt(n)
  rtol = 2 * float(jnp.finfo(dtype).eps)
  outputs = [
    (params[name], result[kind][name]) for kind in ("point", "nearest") for name in ("zeros", "subnormal", "bound")
  ]
  outputs += [
    (params["zeros"], result["project_params"]["zeros"]),
    (params["zeros"], result["project"]["bound + step to the origin"]),
  ]
  for param, value in outputs:
    zero = np.all(np.abs(np.asarray(param, np.float64)) < float(jnp.finfo(dtype).tiny), axis=axes, keepdims=True)
    value = np.asarray(value, np.float64)
    np.testing.assert_allclose(value[np.broadcast_to(zero, value.shape)], expected, rtol=rtol)


def _check(case: Case, dtype):
  c = case.constraint
  params, states, steps, flights = _inputs(case, dtype)
  opt_state = cola.cola_od(0.1, constraints=c).init(params)

  def everything(params, states, steps, flights, opt_state):
    return _everything(c, case.unprojectable, params, states, steps, flights, opt_state)

  results = _three_ways(everything, params, states, steps, flights, opt_state)
  _assert_agree(results)
  if isinstance(c, cola.UnitNorm):
    for result in results.values():
      _assert_zero_units_at_the_documented_point(c, params, result, dtype)


def _check_public(case: Case, dtype):
  """The public functions alone, on parameters of ``dtype`` (computed in float32, as the updates are)."""
  c = case.constraint
  params, _, _, _ = _inputs(case, jnp.float32)
  params = {name: p.astype(dtype) for name, p in params.items()}
  opt_state = cola.cola_od(0.1, constraints=c).init(params)
  projectable = {name: params[name] for name in ("zeros", "bound") if name not in case.unprojectable}

  def public(projectable, params, opt_state):
    return {
      "project_params": cola.project_params(projectable, c),
      "constraint_residuals": cola.constraint_residuals(params, opt_state),
    }

  _assert_agree(_three_ways(public, projectable, params, opt_state))


# The extended tier keeps the zero units of UnitNorm (the NaN above; quick: test_optax_contract.py's
# test_unit_norm_started_at_zero_is_the_same_under_jit); test_conformance's check_constraint compares
# jit and eager on every constraint (at generic inputs, the matrix manifolds and Newton's iterations included),
# and the other edge cases here run under ``slow``.
EXTENDED = {("unit_norm",)}


@pytest.mark.parametrize(
  "name", quick_or_extended([(name,) for name in CASES], set(), ids=lambda name: name, extended=EXTENDED)
)
def test_eager_equals_jit(name):
  _check(CASES[name], jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_eager_equals_jit_more_shapes(name):
  _check(SLOW_CASES[name], jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", {**CASES, **SLOW_CASES})
def test_eager_equals_jit_float64(name):
  with jax.enable_x64(True):
    _check({**CASES, **SLOW_CASES}[name], jnp.float64)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_eager_equals_jit_bfloat16(name):
  # The geometry never sees bfloat16 (LAPACK has no bfloat16 SVD, Newton no bfloat16 tolerance):
  # the public functions, which compute in float32, are what bfloat16 parameters meet.
  _check_public(CASES[name], jnp.bfloat16)
