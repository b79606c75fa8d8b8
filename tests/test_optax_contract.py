"""optax's generic optimizer tests, ported to cola's public transforms.

optax runs one set of generic tests on every optimizer it ships. The properties
they assert are written here afresh (no code is copied) for ``cola_od``,
``cola_ud``, the presets ``c_cola_od``, ``c_cola_ud``, ``o_cola_od``,
``o_cola_ud``, and ``constrained`` around ``optax.sgd`` with momentum,
``optax.adam``, ``optax.adamw``, ``optax.contrib.muon`` and an ``optax.chain``;
on every catalog constraint where it applies, at temperature 0 (no noise: the
runs are deterministic). Sources, in the optax 0.2.8 wheel:

* ``_src/alias_test.py``: ``test_optimization`` (convergence on a parabola
  and on Rosenbrock started at (0, 0), no recompilation on the second call,
  the no-op ``tree.map_params`` before training),
  ``test_optimizers_accept_extra_args``,
  ``test_optimizers_can_be_wrapped_in_inject_hyperparams``,
  ``test_preserve_dtype``, ``test_explicit_dtype``,
  ``test_state_shape_dtype_shard_stability``, ``test_gradient_accumulation``;
* ``contrib/_common_test.py``: the same properties for contrib
  (``test_optimizers`` on matrix targets, the recompile subtest of
  ``test_optimizers_accept_extra_args``, ``static_args`` for what cannot be
  injected);
* ``transforms/_accumulation_test.py``: ``test_multi_steps``,
  ``test_multi_steps_computes_mean``;
* ``transforms/_masking_test.py``: ``test_masked``,
  ``test_masked_state_structure``, ``test_empty``;
* ``transforms/_combining_test.py``: ``PartitionTest.test_partition``,
  ``PartitionTest.test_empty``;
* ``transforms/_conditionality_test.py``: ``test_apply_if_finite``;
* ``tree_utils/_state_utils_test.py``: ``test_tree_get``, ``test_tree_set``,
  ``test_adam`` (parameter specs through ``map_params``),
  ``test_inject_hparams``, ``test_map_non_params_to_none``.

Problems, feasible, with the optimum known in closed form: the nearest point of
each catalog constraint's set to a target outside it (optax's parabola where
nothing is constrained), Rosenbrock inside a circle or a box that contains
(1, 1), and the Rayleigh quotient ``tr(W^T A W)`` on the Stiefel manifold
(minimised by the smallest eigenvectors of ``A``, from ``numpy.linalg.eigh``).

The quick suite keeps a case or two of each test; ``-m extended`` one
constraint per transform (every constraint appears); ``pytest -m slow`` every
transform with every constraint, every dtype.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended
from _constraints import CASES, VARIANTS, takes

import cola_jax as cola

# The catalog: a constraint each, and the nearest point of its set to a target outside it.

RADIUS = 2.0  # of every Circle here; the c_cola presets take it as their radius


def _on_plane(x):
  return jnp.sum(x, keepdims=True) - 1


def _in_ball(x):
  return jnp.sum(x * x, keepdims=True) / 4 - 1  # |x| <= 2, of order one (Implicit's tolerance is absolute)


# Defined once: two Implicit compare equal only when their functions are the same objects.
PLANE_BALL = cola.Implicit(equality=_on_plane, inequality=_in_ball)


def _nearest_in_plane_ball(t):
  """The nearest point of ``{sum x = 1, |x| <= 2}``: onto the plane, then onto the disc the ball cuts from it."""
  center = np.full(t.size, 1 / t.size)
  x = t - (t.sum() - 1) / t.size
  if np.linalg.norm(x) <= 2:
    return x
  return center + (x - center) * np.sqrt(4 - center @ center) / np.linalg.norm(x - center)


def _polar(t):
  """The nearest matrix with orthonormal columns."""
  u, _, vt = np.linalg.svd(t, full_matrices=False)
  return u @ vt


def _into_spectral_ball(t, radius):
  """The nearest matrix of spectral norm at most ``radius``: the singular values clipped."""
  u, s, vt = np.linalg.svd(t, full_matrices=False)
  return (u * np.minimum(s, radius)) @ vt


def _into_unit_balls(t):
  """Each column scaled into the unit ball."""
  return t * np.minimum(1, 1 / np.linalg.norm(t, axis=0, keepdims=True))


class Problem(NamedTuple):
  constraint: Any
  start: np.ndarray
  target: np.ndarray  # of the loss sum((x - target)^2)
  optimum: np.ndarray


_VECTOR = np.array([2.0, -0.5, -3.0])
_MATRIX = np.array([[2.0, 0.1], [-1.0, 0.2], [0.5, -0.3]])  # column 0 outside the unit ball, column 1 inside
_TARGET = np.array([3.0, 1.0, -2.0])

CATALOG = {
  # optax's parabola (alias_test's _setup_parabola): nothing constrained.
  "none": Problem(None, np.array([-1.0, 10.0, 1.0]), np.array([1.0, -1.0, 1.0]), np.array([1.0, -1.0, 1.0])),
  "circle": Problem(
    cola.Circle(RADIUS), np.array([0.0, 1.0, -0.5]), np.array([3.0, -1.0, -5.0]), np.array([2.0, -1.0, -2.0])
  ),
  "box": Problem(cola.Box(-1.0, 0.5), np.array([0.0, 0.2, -0.5]), _VECTOR, np.clip(_VECTOR, -1.0, 0.5)),
  "non_negative": Problem(cola.NonNegative(), np.ones(3), _VECTOR, np.maximum(_VECTOR, 0.0)),
  "max_norm": Problem(cola.MaxNorm(1.0), np.full((3, 2), 0.3), _MATRIX, _into_unit_balls(_MATRIX)),
  "unit_norm": Problem(cola.UnitNorm(1.0), np.ones((3, 2)), _MATRIX, _MATRIX / np.linalg.norm(_MATRIX, axis=0)),
  "orthogonal": Problem(cola.Orthogonal(), np.eye(3, 2), _MATRIX, _polar(_MATRIX)),
  # Scale 1/2: the slowest mode of |W - T|^2 on s V relaxes at a rate ~ (sigma_i + sigma_j) / s of T's singular
  # values, so a scale below 1 converges faster than the unit manifold in the tests' step budgets.
  "orthogonal_scaled": Problem(cola.Orthogonal(scale=0.5), 0.5 * np.eye(3, 2), _MATRIX, 0.5 * _polar(_MATRIX)),
  # The target's singular values are 2.30 and 0.34: the optimum is on the boundary in one direction only.
  "max_spectral_norm": Problem(
    cola.MaxSpectralNorm(1.0), np.full((3, 2), 0.2), _MATRIX, _into_spectral_ball(_MATRIX, 1.0)
  ),
  "implicit": Problem(PLANE_BALL, np.array([0.5, 0.5, 0.0]), _TARGET, _nearest_in_plane_ball(_TARGET)),
}


def test_the_catalog_has_a_problem_for_every_constraint_of_the_registry():
  """The problems are closed forms, written per constraint: one missing leaves its constraint out of the contract."""
  assert {type(c).__name__ for _, c, _ in CASES} <= {type(p.constraint).__name__ for p in CATALOG.values()}


# The transforms: cola's own, `constrained` around optax optimizers, the presets on their constraint.

GENERAL = ("cola_od", "cola_ud", "sgd_momentum", "adam", "adamw", "muon", "chain")
ADAPTIVE = ("adam", "adamw", "muon")
PRESETS = {"c_cola_od": "circle", "c_cola_ud": "circle", "o_cola_od": "orthogonal", "o_cola_ud": "orthogonal"}
TRANSFORMS = GENERAL + tuple(PRESETS)
COMBOS = [(name, c) for name in GENERAL for c in CATALOG] + list(PRESETS.items())
# One constraint per transform, every constraint once or more: the representatives (extended; a few quick).
REPRESENTATIVE = {
  "cola_od": "orthogonal",
  "cola_ud": "circle",
  "sgd_momentum": "non_negative",
  "adam": "max_norm",
  "adamw": "box",
  "muon": "unit_norm",
  "chain": "implicit",
  "c_cola_od": "circle",
  "c_cola_ud": "circle",
  "o_cola_od": "orthogonal",
  "o_cola_ud": "orthogonal",
}
REPRESENTATIVES = set(REPRESENTATIVE.items()) | {("cola_ud", "max_spectral_norm"), ("adam", "orthogonal_scaled")}
# The wrappers' tests: a cola transform and an optax optimizer under constrained() (extended); the other pairs slow.
FEW = {("cola_ud", "circle"), ("adam", "max_norm")}
QUICK = {("cola_ud", "circle")}  # the quick suite's case of the convergence and wrappers' tests


def _ids(*case):
  return "-".join(str(c) for c in case)


def inner(name: str, lr: float = 0.05, steps: int = 100) -> optax.GradientTransformation:
  """The optax optimizer that ``constrained`` wraps for ``name``."""
  if name == "sgd_momentum":
    return optax.sgd(lr, momentum=0.9)
  if name == "adam":
    return optax.adam(lr)
  if name == "adamw":
    return optax.adamw(lr)
  if name == "muon":  # orthogonalised steps keep their size: constant, then decaying to let it settle in few steps
    schedule = optax.join_schedules(
      [optax.constant_schedule(lr), optax.cosine_decay_schedule(lr, steps // 2)], [steps // 2]
    )
    return optax.contrib.muon(schedule)
  assert name == "chain"
  return optax.chain(optax.clip_by_global_norm(10.0), optax.trace(decay=0.9), optax.scale(-lr))


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, cola.Constraint)


def _mask(spec):
  """The leaves ``spec`` constrains, as a mask for the presets (a callable for a callable spec)."""
  flags = lambda s: jax.tree.map(lambda c: c is not None, s, is_leaf=_is_spec_leaf)
  if callable(spec) and not isinstance(spec, cola.Constraint):
    return lambda params: flags(spec(params))
  return flags(spec)


def make(name: str, spec, lr: float = 0.05, adaptive_lr: float = 0.05, steps: int = 100):
  """The transform ``name`` on the constraints ``spec`` (a Constraint, a pytree prefix, or a callable).

  ``lr`` is the step size of SGD with momentum 0.9 (``cola_ud`` gets the
  ``(h, gamma)`` that reproduce it; ``cola_od`` takes it as plain SGD's);
  ``adaptive_lr`` is adam's, adamw's and muon's. A preset constrains the
  leaves ``spec`` constrains (with its own constraint, which ``spec`` names).
  """
  h, friction = cola.sgd_momentum_to_langevin(lr, 0.9)
  if name == "cola_od":
    return cola.cola_od(lr, constraints=spec)
  if name == "cola_ud":
    return cola.cola_ud(h, friction=friction, constraints=spec)
  if name in GENERAL:
    return cola.constrained(inner(name, adaptive_lr if name in ADAPTIVE else lr, steps), constraints=spec)
  mask = _mask(spec)
  if name == "c_cola_od":
    return cola.c_cola_od(lr, radius=RADIUS, mask=mask)
  if name == "c_cola_ud":
    return cola.c_cola_ud(h, friction=friction, radius=RADIUS, mask=mask)
  if name == "o_cola_od":
    return cola.o_cola_od(lr, mask=mask)
  assert name == "o_cola_ud"
  return cola.o_cola_ud(h, friction=friction, mask=mask)


def tree_problem(cname: str, dtype=jnp.float32):
  """``params = {'x': the catalog's start, 'free': a free vector}``, their constraints, and the loss."""
  problem = CATALOG[cname]
  params = {"x": jnp.asarray(problem.start, dtype), "free": jnp.asarray([0.5, -0.5], dtype)}
  targets = {"x": jnp.asarray(problem.target, dtype), "free": jnp.asarray([1.0, 2.0], dtype)}

  def loss(p):
    return jnp.sum((p["x"] - targets["x"]) ** 2) + jnp.sum((p["free"] - targets["free"]) ** 2)

  return params, {"x": problem.constraint, "free": None}, loss


# Helpers.


def leaves_of(tree) -> list:
  """The leaves, typed PRNG keys as their raw data, for comparisons."""
  return [jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in jax.tree.leaves(tree)]


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves_of(a), leaves_of(b)):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves_of(a), leaves_of(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def max_residual(params, state) -> float:
  return max((float(r) for r in jax.tree.leaves(cola.constraint_residuals(params, state))), default=0.0)


def max_difference(a, b) -> float:
  return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - y))) for x, y in zip(leaves_of(a), leaves_of(b)))


def minimise(tx, loss, params, steps: int):
  """``steps`` jitted steps of ``tx`` on ``loss``, as two calls of one compiled program.

  alias_test's test_optimization: the state may go through the no-op
  ``tree.map_params`` first, and the second call must not recompile (the
  state's types do not change in an update). Every update gets the loss value
  and an argument no optimizer expects (test_optimizers_accept_extra_args).
  """

  def step(carry, _):
    params, state = carry
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params, value=value, unexpected_extra_args_your_optimizer_doesnt_expect=1)
    return (optax.apply_updates(params, updates), state), None

  run = jax.jit(lambda carry: jax.lax.scan(step, carry, length=steps // 2)[0])
  state = optax.tree.map_params(tx, lambda v: v, tx.init(params))
  params, state = run(run((params, state)))
  assert run._cache_size() == 1, "the second call recompiled: an update changed the state's types"
  return params, state


# 1-3. Convergence (test_optimization), no recompilation, extra arguments.


@pytest.mark.parametrize("name, cname", quick_or_extended(COMBOS, QUICK, ids=_ids, extended=REPRESENTATIVES))
def test_converges_to_the_nearest_point_of_the_constraint_set(name, cname):
  """alias_test test_optimization (and contrib's test_optimizers on matrix targets), per catalog constraint."""
  problem = CATALOG[cname]
  tx = make(name, problem.constraint, lr=0.02, adaptive_lr=0.1, steps=500)
  loss = lambda x: jnp.sum((x - problem.target) ** 2)
  params, state = minimise(tx, loss, jnp.asarray(problem.start, jnp.float32), 500)
  np.testing.assert_allclose(params, problem.optimum, atol=1e-2)
  assert max_residual(params, state) <= 1e-5


ROSENBROCK_SETS = {"none": None, "circle": cola.Circle(RADIUS), "box": cola.Box(-0.5, 1.5)}  # each contains (1, 1)
ROSENBROCK = [(n, c) for n in GENERAL for c in ROSENBROCK_SETS] + [("c_cola_od", "circle"), ("c_cola_ud", "circle")]


@pytest.mark.parametrize(
  "name, cname", quick_or_extended(ROSENBROCK, QUICK, ids=_ids, extended={("cola_ud", "circle"), ("adamw", "box")})
)
def test_converges_on_rosenbrock_from_the_origin(name, cname):
  """alias_test test_optimization's Rosenbrock (a = 1, b = 100) from (0, 0), in a set that contains (1, 1)."""
  rosenbrock = lambda x: (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2
  tx = make(name, ROSENBROCK_SETS[cname], lr=1e-3, adaptive_lr=0.1, steps=20_000)
  params, state = minimise(tx, rosenbrock, jnp.zeros(2), 20_000)
  np.testing.assert_allclose(params, [1.0, 1.0], rtol=3e-2, atol=3e-2)  # optax's tolerance
  assert max_residual(params, state) <= 1e-5


@pytest.mark.parametrize(
  "name",
  quick_or_extended(
    [(n,) for n in (*GENERAL, "o_cola_od", "o_cola_ud")], {("o_cola_ud",)}, extended={("cola_od",), ("muon",)}
  ),
)
def test_rayleigh_quotient_on_the_stiefel_manifold_finds_the_smallest_eigenvectors(name):
  """min tr(W^T A W) over W^T W = I: the span of the two smallest eigenvectors (test_optimization's convergence)."""
  rng = np.random.default_rng(0)
  q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
  a = (q * np.arange(1.0, 6.0)) @ q.T  # eigenvalues 1, ..., 5
  eigenvalues, eigenvectors = np.linalg.eigh(a)
  smallest = eigenvectors[:, :2]
  start = jnp.asarray(np.linalg.qr(rng.normal(size=(5, 2)))[0], jnp.float32)
  a = jnp.asarray(a, jnp.float32)
  tx = make(name, cola.Orthogonal(), lr=0.1, adaptive_lr=0.05, steps=300)
  w, state = minimise(tx, lambda w: jnp.trace(w.T @ a @ w), start, 300)
  np.testing.assert_allclose(w @ w.T, smallest @ smallest.T, atol=1e-3)  # the subspace, whatever its basis
  np.testing.assert_allclose(jnp.trace(w.T @ a @ w), eigenvalues[:2].sum(), atol=1e-4)
  assert max_residual(w, state) <= 1e-5


ZERO_STARTS = {
  **{
    c: CATALOG[c]._replace(start=np.zeros_like(CATALOG[c].start))
    for c in ("none", "circle", "box", "non_negative", "max_norm", "unit_norm", "implicit")
  },
  # One unit: the whole vector is normed. A zero unit starts at r (1, ..., 1) / sqrt(n) (UnitNorm's docstring).
  "unit_norm_vector": Problem(cola.UnitNorm(1.0, axis=0), np.zeros(3), _VECTOR, _VECTOR / np.linalg.norm(_VECTOR)),
}
ZERO_COMBOS = [(n, c) for n in GENERAL for c in ZERO_STARTS] + [("c_cola_od", "circle"), ("c_cola_ud", "circle")]


@pytest.mark.parametrize(
  "name, cname",
  quick_or_extended(
    ZERO_COMBOS,
    {("cola_od", "unit_norm_vector")},
    ids=_ids,
    extended={("adam", "unit_norm"), ("cola_ud", "implicit")},
  ),
)
def test_converges_from_zeros(name, cname):
  """optax starts Rosenbrock at (0, 0): every constraint whose projection of 0 is defined, started there.

  (NonNegative's slack would be 0 at 0, where the gradient vanishes in the
  slack coordinates and without noise nothing leaves it: it starts at its
  ``START`` instead.)
  """
  problem = ZERO_STARTS[cname]
  tx = make(name, problem.constraint, lr=0.02, adaptive_lr=0.1, steps=500)
  loss = lambda x: jnp.sum((x - problem.target) ** 2)
  params, state = minimise(tx, loss, jnp.asarray(problem.start, jnp.float32), 500)
  np.testing.assert_allclose(params, problem.optimum, atol=1e-2)
  assert max_residual(params, state) <= 1e-5


def test_every_transform_is_extra_args_aware():
  """test_optimizers_accept_extra_args: each is a GradientTransformationExtraArgs, also as a chain's last link.

  (The jitted updates with ``value=`` and an unexpected argument run in every convergence test.)
  """
  params, spec, _ = tree_problem("circle")
  for name in TRANSFORMS:
    tx = make(name, spec)
    assert isinstance(tx, optax.GradientTransformationExtraArgs), name
    assert isinstance(optax.chain(optax.clip_by_global_norm(1.0), tx), optax.GradientTransformationExtraArgs), name


# 4. dtypes.

DTYPES = ("float16", "bfloat16", "float32", "float64")
DTYPE_COMBOS = [(n, c, d) for n, c in COMBOS for d in DTYPES]
# Extended; cola_ud on the circle in float32 and bfloat16 quick.
QUICK_DTYPES = {("cola_ud", "circle", d) for d in DTYPES} | {
  ("adam", "orthogonal", "bfloat16"),
  ("c_cola_od", "circle", "float16"),
  ("o_cola_ud", "orthogonal", "float64"),
  ("chain", "implicit", "bfloat16"),
}


def _compute_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)  # cola's geometry runs in at least float32


def _expected_state_dtype(path, dtype, x_constrained: bool):
  """The dtype of a floating leaf of the state (None: not cola's to say).

  cola's own fields (momenta, slacks, radii) are in the compute dtype, at least
  float32. ``constrained``'s inner optimizer keeps its moments as it would for
  the leaves it sees: a constrained leaf as its tangent coordinates, in the
  compute dtype; a free leaf as it is, in the parameter's dtype. Its other
  arrays (muon's ``ns_coeffs``) are its own business.
  """
  keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  if "inner_state" not in keys:
    return _compute_dtype(dtype)
  if "x" in keys:
    return _compute_dtype(dtype) if x_constrained else jnp.dtype(dtype)
  return jnp.dtype(dtype) if "free" in keys else None


@pytest.mark.parametrize(
  "name, cname, dtype",
  quick_or_extended(
    DTYPE_COMBOS, {("cola_ud", "circle", "float32"), ("cola_ud", "circle", "bfloat16")}, ids=_ids, extended=QUICK_DTYPES
  ),
)
def test_updates_come_in_the_parameter_dtype_and_the_state_keeps_its_dtypes(name, cname, dtype):
  """alias_test test_preserve_dtype and test_state_shape_dtype_shard_stability, and the step compiles once."""
  with jax.enable_x64(dtype == "float64"):
    dtype = jnp.dtype(dtype)
    params, spec, loss = tree_problem(cname, dtype)
    tx = make(name, spec)
    state = jax.jit(tx.init)(params)
    traces = []

    @jax.jit
    def step(params, state):
      traces.append(None)  # a Python side effect: runs once per compilation
      return tx.update(jax.grad(loss)(params), state, params)

    shapes_and_dtypes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    for _ in range(3):
      updates, new_state = step(params, state)
      assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
      assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
      params, state = optax.apply_updates(params, updates), new_state
      assert all(p.dtype == dtype for p in jax.tree.leaves(params))
    assert len(traces) == 1
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        expected = _expected_state_dtype(path, dtype, x_constrained=spec["x"] is not None)
        assert expected is None or leaf.dtype == expected, jax.tree_util.keystr(path)
    if name in ("cola_ud", "c_cola_ud", "o_cola_ud"):  # by design: momenta in at least float32
      assert {m.dtype for m in jax.tree.leaves(state.momentum)} == {_compute_dtype(dtype)}
    assert max_residual(params, state) <= {"float16": 1e-3, "bfloat16": 1e-2}.get(dtype.name, 1e-5)


@pytest.mark.parametrize(
  "state_dtype, params_dtype",
  quick_or_extended(
    [(s, p) for p in ("bfloat16", "float32") for s in (None, "bfloat16", "float32")],
    {(None, "bfloat16"), ("bfloat16", "float32")},  # the default, and a state below the parameters
    ids=_ids,
  ),
)
def test_explicit_state_dtype(params_dtype, state_dtype):
  """alias_test test_explicit_dtype: cola_ud's accumulator_dtype, and constrained's inner accumulator/mu dtype."""
  params, spec, _ = tree_problem("orthogonal", params_dtype)
  expected = jnp.dtype(state_dtype) if state_dtype else _compute_dtype(params_dtype)
  h, friction = cola.sgd_momentum_to_langevin(0.1, 0.9)
  for tx in (
    cola.cola_ud(h, friction=friction, constraints=spec, accumulator_dtype=state_dtype),
    cola.c_cola_ud(h, friction=friction, radius=RADIUS, mask={"x": True, "free": False}, accumulator_dtype=state_dtype),
    cola.o_cola_ud(h, friction=friction, accumulator_dtype=state_dtype),
  ):
    assert {m.dtype for m in jax.tree.leaves(tx.init(params).momentum)} == {expected}
  for tx, field in (
    (cola.constrained(optax.sgd(0.1, momentum=0.9, accumulator_dtype=state_dtype), constraints=spec), "trace"),
    (cola.constrained(optax.adam(0.1, mu_dtype=state_dtype), constraints=spec), "mu"),
    (cola.constrained(optax.adamw(0.1, mu_dtype=state_dtype), constraints=spec), "mu"),
  ):
    moment = optax.tree.get(tx.init(params), field)
    # The constrained leaf is seen in the compute dtype; the free one as it is (as the inner alone would see it).
    assert moment["x"].dtype == expected
    assert moment["free"].dtype == (jnp.dtype(state_dtype) if state_dtype else jnp.dtype(params_dtype))


# 5. inject_hyperparams.

_INJECT_PARAMS = {
  "w": 0.5 * jax.random.normal(jax.random.key(0), (4, 2)),
  "b": jnp.array([0.3, -0.2]),
}
_INJECT_GRADS = {"w": 4.0 * jax.random.normal(jax.random.key(1), (4, 2)), "b": jnp.array([1.0, -2.0])}
_INJECT_SPEC = {"w": cola.Orthogonal(), "b": cola.Circle(0.5)}

# factory: (its numeric hyperparameters, its other arguments, a new value for each numeric one)
INJECTED = {
  "cola_od": (
    cola.cola_od,
    {"learning_rate": 0.1, "temperature": 1e-3},
    {"constraints": _INJECT_SPEC},
    {"learning_rate": 0.2, "temperature": 0.0},
  ),
  "cola_ud": (
    cola.cola_ud,
    {"learning_rate": 0.3, "friction": 1.0, "temperature": 1e-3},
    {"constraints": _INJECT_SPEC},
    {"learning_rate": 0.2, "friction": 5.0, "temperature": 0.0},
  ),
  "c_cola_od": (
    cola.c_cola_od,
    {"learning_rate": 0.1, "radius": 0.5, "temperature": 1e-3},
    {},
    {"learning_rate": 0.2, "radius": 0.3, "temperature": 0.0},
  ),
  "c_cola_ud": (
    cola.c_cola_ud,
    {"learning_rate": 0.3, "friction": 1.0, "radius": 0.5, "temperature": 1e-3},
    {},
    {"learning_rate": 0.2, "friction": 5.0, "radius": 0.3, "temperature": 0.0},
  ),
  "o_cola_od": (
    cola.o_cola_od,
    {"learning_rate": 0.1, "temperature": 1e-3, "tolerance": 1e-6, "max_iterations": 20},
    {},
    {"learning_rate": 0.2, "temperature": 0.0, "tolerance": 0.1, "max_iterations": 1},
  ),
  "o_cola_ud": (
    cola.o_cola_ud,
    {"learning_rate": 0.3, "friction": 1.0, "temperature": 1e-3, "tolerance": 1e-6, "max_iterations": 20},
    {},
    {"learning_rate": 0.2, "friction": 5.0, "temperature": 0.0, "tolerance": 0.1, "max_iterations": 1},
  ),
}


def _hyperparameter(path, _) -> bool:
  """tree.get/tree.set filtering: the injected value, not a state field of that name (CircleState.radius)."""
  return any(getattr(k, "name", None) == "hyperparams" for k in path)


def _like(old, value):
  """``value`` as a hyperparameter in the state: ``old``'s dtype and weak type, so that nothing recompiles."""
  return jnp.asarray(value) if old.weak_type else jnp.asarray(value, old.dtype)


def _two_steps(tx):
  def step(_, carry):
    params, state = carry
    updates, state = tx.update(_INJECT_GRADS, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(lambda state, params: jax.lax.fori_loop(0, 2, step, (params, state)))


# The presets are cola_od and cola_ud with fixed constraints: the quick suite injects into cola_od, extended cola_ud.
@pytest.mark.parametrize(
  "factory", quick_or_extended([(name,) for name in INJECTED], {("cola_od",)}, extended={("cola_ud",)})
)
def test_inject_hyperparams_injects_every_numeric_hyperparameter(factory):
  """test_optimizers_can_be_wrapped_in_inject_hyperparams, and tree_utils' test_tree_get/test_tree_set.

  Every numeric hyperparameter lands in ``state.hyperparams`` (the PRNG key
  too: inject_hyperparams injects every array; cola reads it only at init).
  The wrapped transform equals the plain one; a value changed with
  ``optax.tree.set`` changes the step, and one compilation serves every value.
  """
  fn, numeric, other, changes = INJECTED[factory]
  key = jax.random.key(0)
  tx = optax.inject_hyperparams(fn)(**numeric, **other, key=key)
  state = tx.init(_INJECT_PARAMS)
  assert set(state.hyperparams) == {*numeric, "key"}
  for name, value in numeric.items():
    np.testing.assert_allclose(optax.tree.get(state, name, filtering=_hyperparameter), value, rtol=1e-6)
  run = _two_steps(tx)
  base, base_state = run(state, _INJECT_PARAMS)
  plain = fn(**numeric, **other, key=key)
  plain_params, plain_state = _two_steps(plain)(plain.init(_INJECT_PARAMS), _INJECT_PARAMS)
  assert_trees_close(base, plain_params)
  assert_trees_close(base_state.inner_state, plain_state)
  for name, value in changes.items():
    changed = optax.tree.set(state, _hyperparameter, **{name: _like(state.hyperparams[name], value)})
    np.testing.assert_allclose(optax.tree.get(changed, name, filtering=_hyperparameter), value, rtol=1e-6)
    moved, moved_state = run(changed, _INJECT_PARAMS)
    assert max_difference(moved, base) > 1e-4, name
    if name == "radius":  # the new radius bounds the circle-constrained leaf
      assert float(jnp.max(jnp.abs(moved["w"]))) <= value * (1 + 1e-6)
    if name == "max_iterations":  # the projection stopped at the new bound (base needed more)
      assert int(optax.tree.get(base_state, "constraint_states")["w"].iterations) > value
      assert int(optax.tree.get(moved_state, "constraint_states")["w"].iterations) <= value
    if name != "tolerance":
      assert max_residual(moved, moved_state) <= 1e-5
  assert run._cache_size() == 1


@pytest.mark.slow  # one compilation of the plain transform per changed value
@pytest.mark.parametrize("factory", INJECTED)
def test_inject_hyperparams_equals_the_plain_transform_at_every_value(factory):
  """test_optimizers_can_be_wrapped_in_inject_hyperparams at each changed value, from a fresh init."""
  fn, numeric, other, changes = INJECTED[factory]
  key = jax.random.key(0)
  run = _two_steps(optax.inject_hyperparams(fn)(**numeric, **other, key=key))
  for name, value in changes.items():
    hyperparameters = {**numeric, name: value}
    state = optax.inject_hyperparams(fn)(**hyperparameters, **other, key=key).init(_INJECT_PARAMS)
    injected, _ = run(state, _INJECT_PARAMS)
    plain = fn(**hyperparameters, **other, key=key)
    expected, _ = _two_steps(plain)(plain.init(_INJECT_PARAMS), _INJECT_PARAMS)
    assert_trees_close(injected, expected)
  assert run._cache_size() == 1


def test_inject_hyperparams_of_constrained_and_of_its_inner_optimizer():
  """``constrained`` has no numeric hyperparameter of its own; its inner optimizer's are injected inside it."""
  spec = {"w": cola.Orthogonal(), "b": None}
  wrapped = optax.inject_hyperparams(cola.constrained)(optax.adam(0.1), constraints=spec)
  assert wrapped.init(_INJECT_PARAMS).hyperparams == {}

  tx = cola.constrained(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), constraints=spec)
  state = tx.init(_INJECT_PARAMS)
  assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(0.1)
  run = _two_steps(tx)
  faster = optax.tree.set(state, learning_rate=_like(optax.tree.get(state, "learning_rate"), 0.2))
  moved, moved_state = run(faster, _INJECT_PARAMS)
  plain = cola.constrained(optax.adam(0.2), constraints=spec)
  expected, _ = _two_steps(plain)(plain.init(_INJECT_PARAMS), _INJECT_PARAMS)
  assert_trees_close(moved, expected, rtol=1e-4)  # optax's own adam and injected adam differ by 1e-5 (f32 eps)
  assert max_residual(moved, moved_state) <= 1e-5


def test_hyperparameters_that_cannot_be_injected_as_given():
  """contrib's static_args: callables are taken for schedules, so a callable ``constraints`` must be static.

  And a temperature above 0 without a key is refused where it is known (eagerly).
  """
  spec = lambda params: {"w": cola.Orthogonal(), "b": None}
  grads = _INJECT_GRADS
  unmarked = optax.inject_hyperparams(cola.cola_od)(0.1, constraints=spec)
  with pytest.raises(TypeError, match=r"hyperparams\['constraints'\]"):  # the schedule's output is not an array
    jax.jit(unmarked.update)(grads, unmarked.init(_INJECT_PARAMS), _INJECT_PARAMS)
  static = optax.inject_hyperparams(cola.cola_od, static_args=("constraints",))(0.1, constraints=spec)
  updates, state = jax.jit(static.update)(grads, static.init(_INJECT_PARAMS), _INJECT_PARAMS)
  assert max_residual(optax.apply_updates(_INJECT_PARAMS, updates), state) <= 1e-5

  hot = optax.tree.set(static.init(_INJECT_PARAMS), temperature=1.0)  # no key was given
  with pytest.raises(ValueError, match="needs a PRNG key"):
    static.update(grads, hot, _INJECT_PARAMS)


# 6. MultiSteps.


@pytest.mark.parametrize("name, cname", quick_or_extended(COMBOS, QUICK, ids=_ids, extended=FEW))
def test_multisteps_applies_the_mean_gradient_every_k_steps(name, cname):
  """_accumulation_test test_multi_steps and test_multi_steps_computes_mean."""
  params, spec, _ = tree_problem(cname)
  tx, k = make(name, spec), 2
  accumulated = optax.MultiSteps(tx, every_k_schedule=k)
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), (2 * k, *x.shape), x.dtype), params)

  @jax.jit
  def program(params):
    def mini_step(carry, g):
      params, state = carry
      updates, state = accumulated.update(g, state, params)
      return (optax.apply_updates(params, updates), state), (updates, accumulated.has_updated(state))

    def step(carry, g):
      params, state = carry
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), updates

    (params_k, state), (emitted, updated) = jax.lax.scan(mini_step, (params, accumulated.init(params)), grads)
    means = jax.tree.map(lambda g: g.reshape(2, k, *g.shape[1:]).mean(axis=1), grads)
    (params_1, reference), expected = jax.lax.scan(step, (params, tx.init(params)), means)
    return params_k, state, emitted, updated, params_1, reference, expected

  params_k, state, emitted, updated, params_1, reference, expected = program(params)
  np.testing.assert_array_equal(updated, [False, True] * 2)  # every k-th step, k = 2
  for i in (0, 2):  # nothing moves between the k-th steps
    assert all(not np.any(np.asarray(u[i])) for u in jax.tree.leaves(emitted))
  assert_trees_close(jax.tree.map(lambda u: u[1::2], emitted), expected)  # the unwrapped step on the mean
  assert_trees_close(state.inner_opt_state, reference)
  assert_trees_close(params_k, params_1)
  assert max_residual(params_k, state) <= 1e-5


@pytest.mark.parametrize(
  "name, dtype",
  quick_or_extended(
    [(n, d) for n in TRANSFORMS for d in ("bfloat16", "float32")],
    {("cola_ud", "bfloat16")},
    _ids,
    extended={("muon", "bfloat16")},
  ),
)
def test_gradient_accumulation_mini_step_is_zero_in_the_gradient_dtype(name, dtype):
  """alias_test / contrib test_gradient_accumulation: MultiSteps(tx, 4)'s first update is zeros, in bfloat16 too."""
  params, spec, loss = tree_problem(REPRESENTATIVE[name], dtype)
  accumulated = optax.MultiSteps(make(name, spec), every_k_schedule=4)
  grads = jax.grad(loss)(params)
  updates, _ = jax.jit(accumulated.update)(grads, jax.jit(accumulated.init)(params), params)
  assert_trees_equal(updates, jax.tree.map(jnp.zeros_like, grads))
  assert all(u.dtype == jnp.dtype(dtype) for u in jax.tree.leaves(updates))


# 7. masked and partition.


@pytest.mark.parametrize("name, cname", quick_or_extended(COMBOS, QUICK, ids=_ids, extended=FEW))
def test_masked_and_partition_give_cola_its_leaves_and_another_optimizer_the_rest(name, cname):
  """_masking_test test_masked / test_masked_state_structure, _combining_test test_partition.

  The constrained leaf goes to the cola transform, the free one to adam; the
  cola state holds ``optax.MaskedNode`` where adam rules, and each leaf moves as
  its optimizer alone would move it.
  """
  params, spec, loss = tree_problem(cname)
  cola_tx, other = make(name, spec), optax.adam(0.1)
  partitioned = optax.partition({"cola": cola_tx, "adam": other}, {"x": "cola", "free": "adam"})
  masked = optax.chain(
    optax.masked(other, {"x": False, "free": True}), optax.masked(cola_tx, {"x": True, "free": False})
  )
  alone = make(name, {"x": spec["x"]})

  def run(tx, params, loss):
    state = tx.init(params)
    for _ in range(2):
      updates, state = tx.update(jax.grad(loss)(params), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  @jax.jit
  def program(params):
    x, free = params["x"], params["free"]  # the loss is a sum over the leaves: each moves on its own
    expected = {
      "x": run(alone, {"x": x}, lambda p: loss({"x": p["x"], "free": free}))[0]["x"],
      "free": run(other, free, lambda f: loss({"x": x, "free": f}))[0],
    }
    return run(partitioned, params, loss), run(masked, params, loss), expected

  (by_partition, partition_state), (by_mask, mask_state), expected = program(params)
  assert_trees_close(by_partition, expected)
  assert_trees_close(by_mask, expected)
  for moved, state in ((by_partition, partition_state), (by_mask, mask_state)):
    assert cola.constraint_residuals(moved, state)["free"] is None
    assert max_residual(moved, state) <= 1e-5
    (cola_state,) = [s for s in jax.tree.leaves(state, is_leaf=_is_cola_state) if _is_cola_state(s)]
    assert isinstance(cola_state.constraint_states["free"], optax.MaskedNode)


def _is_cola_state(x) -> bool:
  return isinstance(x, cola.OverdampedState | cola.UnderdampedState | cola.ConstrainedState)


# 8. apply_if_finite.


@pytest.mark.parametrize("name, cname", quick_or_extended(COMBOS, QUICK, ids=_ids, extended=FEW))
def test_apply_if_finite_skips_a_nan_gradient(name, cname):
  """_conditionality_test test_apply_if_finite: a NaN step moves nothing and leaves the inner state as it was."""
  params, spec, loss = tree_problem(cname)
  tx = make(name, spec)
  guarded = optax.apply_if_finite(tx, max_consecutive_errors=2)

  @jax.jit
  def program(params):
    state = guarded.init(params)
    updates, good = guarded.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
    nan = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), jax.grad(loss)(params))
    skipped_updates, skipped = guarded.update(nan, good, params)
    skipped_params = optax.apply_updates(params, skipped_updates)
    after_updates, after = guarded.update(jax.grad(loss)(params), skipped, skipped_params)
    expected_updates, _ = tx.update(jax.grad(loss)(params), good.inner_state, params)
    return params, good, skipped_params, skipped, after_updates, after, expected_updates

  params, good, skipped_params, skipped, after_updates, after, expected_updates = program(params)
  assert not bool(skipped.last_finite) and int(skipped.notfinite_count) == 1
  assert_trees_equal(skipped_params, params)
  assert_trees_equal(skipped.inner_state, good.inner_state)
  assert bool(after.last_finite) and int(after.notfinite_count) == 0 and int(after.total_notfinite) == 1
  assert_trees_close(after_updates, expected_updates)
  assert max_residual(optax.apply_updates(params, after_updates), after) <= 1e-5


# 9. tree.get and tree.set on the states.

_SCHEDULED = {
  "cola_od": lambda lr, spec: cola.cola_od(lr, constraints=spec),
  "cola_ud": lambda lr, spec: cola.cola_ud(lr, friction=1.0, constraints=spec),
  "c_cola_od": lambda lr, spec: cola.c_cola_od(lr, radius=RADIUS, mask=_mask(spec)),
  "c_cola_ud": lambda lr, spec: cola.c_cola_ud(lr, friction=1.0, radius=RADIUS, mask=_mask(spec)),
  "o_cola_od": lambda lr, spec: cola.o_cola_od(lr, mask=_mask(spec)),
  "o_cola_ud": lambda lr, spec: cola.o_cola_ud(lr, friction=1.0, mask=_mask(spec)),
}


@pytest.mark.parametrize(
  "name", quick_or_extended([(n,) for n in _SCHEDULED], {("cola_ud",)}, extended={("cola_od",), ("o_cola_ud",)})
)
def test_tree_get_reads_the_count_and_tree_set_moves_the_schedule(name):
  """tree_utils test_tree_get / test_tree_set on cola's own states: the count drives a learning-rate schedule."""
  cname = PRESETS.get(name, "orthogonal" if name == "cola_od" else "circle")
  params, spec, loss = tree_problem(cname)
  schedule = lambda count: 0.1 * 0.5**count
  tx = _SCHEDULED[name](schedule, spec)
  state = tx.init(params)
  assert int(optax.tree.get(state, "count")) == 0
  late = optax.tree.set(state, count=jnp.asarray(3, jnp.int32))
  assert int(optax.tree.get(late, "count")) == 3
  grads = jax.grad(loss)(params)
  updates, after = jax.jit(tx.update)(grads, late, params)
  assert int(optax.tree.get(after, "count")) == 4
  constant = _SCHEDULED[name](schedule(3), spec)
  expected, _ = jax.jit(constant.update)(grads, constant.init(params), params)
  assert_trees_close(updates, expected)


def test_tree_get_finds_the_count_of_constrained_in_its_inner_optimizer():
  """test_tree_get: ``constrained`` has no count of its own; adam's is found, and set, inside it."""
  params, spec, loss = tree_problem("max_norm")
  tx = make("adam", spec)
  state = tx.init(params)
  assert int(optax.tree.get(state, "count")) == 0
  assert optax.tree.get(make("sgd_momentum", spec).init(params), "count") is None  # optax.sgd keeps none
  updates, after = jax.jit(tx.update)(jax.grad(loss)(params), optax.tree.set(state, count=jnp.asarray(7)), params)
  assert int(optax.tree.get(after, "count")) == 8
  injected = optax.inject_hyperparams(cola.cola_od)(0.1, constraints=spec).init(params)
  with pytest.raises(KeyError, match="multiple values"):  # as for a chain of two inject_hyperparams in optax
    optax.tree.get(injected, "count")
  by_state = lambda path, _: getattr(path[-1], "tuple_name", None) == "OverdampedState"
  assert int(optax.tree.get(injected, "count", filtering=by_state)) == 0


# 10. Edge trees: empty, 0-d, Python floats, None leaves.

# None, and every constraint of the registry that takes a 0-d leaf (MaxNorm: one unit of one entry, the circle).
SCALAR_SETS = {"none": None, **{name: c for name, c, _ in CASES + VARIANTS if takes(c, ())}}
EDGE_COMBOS = [(n, c) for n in GENERAL for c in SCALAR_SETS] + [
  ("c_cola_od", "circle"),
  ("c_cola_ud", "circle"),
  ("o_cola_od", "none"),
  ("o_cola_ud", "none"),
]
# Extended; cola_od on the circle quick.
QUICK_EDGES = {
  ("cola_od", "circle"),
  ("cola_ud", "implicit_inequality"),
  ("adam", "non_negative"),
  ("muon", "max_norm"),
}


@pytest.mark.parametrize(
  "name, container",
  quick_or_extended(  # every transform on a dict, cola_od on every container; the rest extended
    [(n, c) for c in (dict, tuple, list) for n in TRANSFORMS],
    {(n, dict) for n in TRANSFORMS} | {("cola_od", tuple), ("cola_od", list)},
    ids=lambda n, c: f"{n}-{c.__name__}",
  ),
)
def test_empty_params(name, container):
  """_masking_test / _combining_test test_empty: no leaves, no work, an empty update (eagerly and jitted)."""
  tx = make(name, container())
  state = tx.init(container())
  updates, _ = tx.update(container(), state, container())
  assert updates == container()
  updates, _ = jax.jit(tx.update)(container(), state, container())
  assert updates == container()


@pytest.mark.parametrize(
  "name, cname", quick_or_extended(EDGE_COMBOS, {("cola_od", "circle")}, ids=_ids, extended=QUICK_EDGES)
)
def test_scalar_float_and_none_leaves(name, cname):
  """0-d arrays (_accumulation_test's ``{'a': jnp.zeros([])}``), Python floats (_masking_test's params), None.

  As optax treats it, None is an empty subtree: it comes back as None, and an
  empty container as itself.
  """
  constraint = SCALAR_SETS[cname]
  params = {"scalar": jnp.asarray(0.25), "float": 0.25, "none": None, "empty": {}, "list": []}
  spec = {"scalar": constraint, "float": constraint, "none": None, "empty": None, "list": None}
  loss = lambda p: (p["scalar"] - 3.0) ** 2 + (p["float"] + 3.0) ** 2
  tx = make(name, spec)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(jax.grad(loss)(params), state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert updates["none"] is None and updates["empty"] == {} and updates["list"] == []
  assert updates["scalar"].shape == () and updates["scalar"].dtype == jnp.float32
  new = optax.apply_updates(params, updates)
  assert all(bool(jnp.isfinite(x)) for x in jax.tree.leaves(new))
  assert max_residual(new, state) <= 1e-5


@pytest.mark.parametrize(
  "make_tx",
  [
    lambda: cola.cola_od(0.1, constraints=cola.UnitNorm()),
    lambda: cola.cola_ud(0.1, friction=1.0, constraints=cola.Orthogonal()),
    lambda: cola.o_cola_od(0.1, mask=True),
    lambda: cola.constrained(optax.adam(0.1), constraints=cola.UnitNorm()),
  ],
  ids=["UnitNorm", "Orthogonal", "o_cola_od", "constrained-UnitNorm"],
)
def test_constraints_that_need_axes_refuse_a_scalar_naming_it(make_tx):
  """Where a constraint cannot apply to a 0-d leaf, the error names the leaf."""
  with pytest.raises(ValueError, match=r"\['scalar'\]"):
    make_tx().init({"scalar": jnp.asarray(0.5)})


# 11. tree.map_params.


def _spec_forms(cname: str, form: str):
  """(params, constraints, specs) in one of the forms a constraint spec takes."""
  params, spec, _ = tree_problem(cname)
  if form == "tuple":
    return (params["x"], params["free"]), (spec["x"], None), ("X", "F")
  specs = {"x": "X", "free": "F"}
  if form == "callable":
    return params, lambda p: {"x": spec["x"], "free": None}, specs
  return params, spec, specs


@pytest.mark.parametrize(
  "name, form",
  quick_or_extended(  # every transform on a dict, cola_ud and adam in every form; the rest extended
    [(n, f) for f in ("dict", "tuple", "callable") for n in TRANSFORMS],
    {(n, "dict") for n in TRANSFORMS} | {(n, f) for n in ("cola_ud", "adam") for f in ("tuple", "callable")},
    ids=_ids,
  ),
)
def test_map_params_maps_the_parameter_shaped_fields(name, form):
  """_state_utils_test test_adam / test_map_non_params_to_none, and test_optimization's no-op map.

  Mapping the identity gives the state back. Mapping parameter specs reaches
  exactly the fields shaped like the parameters: cola_ud's momentum (as
  ``optax.sgd(0.1, momentum=0.9)``'s trace), the inner optimizer's moments in
  ``constrained`` (as the inner alone gives); count, key and the constraint
  states go to ``transform_non_params``.
  """
  params, spec, specs = _spec_forms(REPRESENTATIVE[name], form)
  tx = make(name, spec)
  state = tx.init(params)
  assert_trees_equal(optax.tree.map_params(tx, lambda v: v, state), state)

  # muon partitions its leaves (optax.MaskedNode inside its state): the masked form of _masking_test.
  to_specs = lambda opt, state: optax.tree.map_params(
    opt,
    lambda p, s: None if isinstance(p, optax.MaskedNode) else s,
    state,
    specs,
    is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    transform_non_params=lambda _: None,
  )
  mapped = to_specs(tx, state)
  sgd = optax.sgd(0.1, momentum=0.9)
  (trace, _) = to_specs(sgd, sgd.init(params))
  assert trace.trace == specs
  if isinstance(state, cola.OverdampedState):
    assert mapped == cola.OverdampedState(count=None, key=None, constraint_states=None, free_state=None)
  elif isinstance(state, cola.UnderdampedState):
    assert mapped == cola.UnderdampedState(
      count=None, key=None, constraint_states=None, momentum=trace.trace, free_state=None
    )
  else:
    opt = inner(name)
    assert mapped == cola.ConstrainedState(inner_state=to_specs(opt, opt.init(params)), constraint_states=None)


def test_map_params_through_inject_hyperparams_and_masked():
  """_state_utils_test test_inject_hparams and _masking_test test_tree_map_params, on cola_ud."""
  params, spec, _ = tree_problem("orthogonal")
  injected = optax.inject_hyperparams(cola.cola_ud)(0.3, friction=1.0, constraints=spec)
  plus_one = optax.tree.map_params(injected, lambda v: v + 1, injected.init(params))
  assert float(plus_one.hyperparams["learning_rate"]) == pytest.approx(0.3)
  assert_trees_equal(plus_one.inner_state.momentum, jax.tree.map(jnp.ones_like, params))
  masked = optax.masked(cola.cola_ud(0.3, friction=1.0, constraints=spec), {"x": True, "free": False})
  state = masked.init(params)
  assert_trees_equal(optax.tree.map_params(masked, lambda v: v, state), state)
  specs = optax.tree.map_params(
    masked,
    lambda p, s: None if isinstance(p, optax.MaskedNode) else s,
    state,
    {"x": "X", "free": "F"},
    is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    transform_non_params=lambda _: None,
  )
  assert specs.inner_state.momentum == {"x": "X", "free": None}


# Defects found while porting (see each docstring).


def test_unit_norm_started_at_zero_is_the_same_under_jit():
  """UnitNorm's docstring: a zero unit is put at ``r (1, ..., 1) / sqrt(n)``. Under jit it became NaN.

  (Found by test_converges_from_zeros[cola_od-unitnorm_vector]: a leaf that is
  one unit, e.g. a vector with ``axis=0``; leaves of several units were fine.)
  """
  tx = cola.cola_od(0.1, constraints=cola.UnitNorm(1.0, axis=0))
  x = jnp.zeros(3)
  state = tx.init(x)
  eager, _ = tx.update(jnp.zeros(3), state, x)
  jitted, _ = jax.jit(tx.update)(jnp.zeros(3), state, x)
  np.testing.assert_allclose(eager, np.full(3, 3**-0.5), rtol=1e-6)
  np.testing.assert_allclose(jitted, eager, rtol=1e-6)


@pytest.mark.parametrize(
  "constraint",
  [
    cola.NonNegative(),
    pytest.param(cola.Implicit(inequality=jnp.negative), marks=pytest.mark.extended),  # quick: NonNegative
  ],
  ids=["NonNegative", "Implicit"],
)
def test_constrained_sgd_reaches_a_lower_bound_however_large_its_step(constraint):
  """test_optimization for ``constrained(optax.sgd(lr))`` on ``(x + 3)^2``, ``x >= 0``, from ``x = 1``.

  ``constrained``'s retraction must exist for every finite step: RATTLE's
  has none for a step past the parabola's vertex, and when it was used a
  leaf at ``lr = 0.2`` never left ``x = 1`` (SGD asks the same step again at
  the same point). Near the vertex the loss along the manifold is
  ``9 + 6 sigma^2`` in arc length ``sigma``, so Riemannian SGD converges for
  ``lr < 1/6`` and at ``lr = 0.2`` ends in a two-cycle next to the bound.
  """
  for lr, within in ((0.05, 1e-3), (0.2, 0.2)):
    tx = cola.constrained(optax.sgd(lr), constraints=constraint)
    x, state = minimise(tx, lambda x: jnp.sum((x + 3.0) ** 2), jnp.ones(1), 200)
    assert -1e-6 <= float(x[0]) < within, (lr, x)  # Implicit holds x = s^2 to its tolerance, 1e-6
    assert max(jax.tree.leaves(cola.constraint_residuals(x, state))) < 1e-5
