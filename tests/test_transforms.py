"""The optax transforms: equivalences, keys, jit/vmap/inject_hyperparams, errors."""

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended

import cola_jax as cola

# The presets' default choice of leaves is used on purpose here (the layers' kernels, biases free); that choice
# and the warning naming it are tested in test_validation.
pytestmark = pytest.mark.filterwarnings("ignore:.*not told which leaves to constrain:UserWarning")


def run(tx, params, loss, steps, *, jit=True):
  """Trains for ``steps`` with ``tx``; returns (params, state)."""

  def step(carry, i):
    p, s = carry
    grads = jax.grad(loss)(p, i)
    updates, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), None

  body = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(steps))[0]) if jit else None
  state = tx.init(params)
  return body((params, state))


def assert_trees_close(a, b, rtol, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# Equivalences with optax at temperature 0 (docs/errata.md, item 4).


@pytest.mark.extended  # quick: test_schedules_are_read_before_the_count_increments runs cola_od against optax.sgd
def test_overdamped_without_constraints_is_sgd(mlp_problem):
  params, loss = mlp_problem
  ours, _ = run(cola.cola_od(0.05), params, loss, 100)
  reference, _ = run(optax.sgd(0.05), params, loss, 100)
  assert_trees_close(ours, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.extended  # quick: test_mapped_hyperparameters_reproduce_sgd_momentum, the same equivalence
def test_underdamped_without_constraints_is_sgd_momentum(mlp_problem):
  params, loss = mlp_problem
  h, gamma = 0.3, 1.0
  ours, _ = run(cola.cola_ud(h, friction=gamma), params, loss, 100)
  reference, _ = run(optax.sgd(h**2, momentum=math.exp(-gamma * h)), params, loss, 100)
  assert_trees_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_schedules_are_read_before_the_count_increments(mlp_problem):
  params, loss = mlp_problem
  schedule = optax.piecewise_constant_schedule(0.1, {3: 0.1, 7: 0.1})
  ours, state = run(cola.cola_od(schedule), params, loss, 10)
  reference, _ = run(optax.sgd(schedule), params, loss, 10)
  assert_trees_close(ours, reference, rtol=1e-6, atol=1e-7)
  assert int(state.count) == 10


def test_sgd_momentum_mapping_round_trips():
  h, gamma = cola.sgd_momentum_to_langevin(0.1, 0.9)
  assert h == pytest.approx(math.sqrt(0.1))
  assert gamma == pytest.approx(-math.log(0.9) / math.sqrt(0.1))
  lr, momentum = cola.langevin_to_sgd_momentum(h, gamma)
  assert lr == pytest.approx(0.1) and momentum == pytest.approx(0.9)
  assert cola.langevin_to_sgd_momentum(0.3, 1.0) == pytest.approx((0.09, math.exp(-0.3)))
  with pytest.raises(ValueError, match="momentum"):
    cola.sgd_momentum_to_langevin(0.1, 0.0)


def test_mapped_hyperparameters_reproduce_sgd_momentum(mlp_problem):
  params, loss = mlp_problem
  h, gamma = cola.sgd_momentum_to_langevin(0.05, 0.9)
  ours, _ = run(cola.cola_ud(h, friction=gamma), params, loss, 100)
  reference, _ = run(optax.sgd(0.05, momentum=0.9), params, loss, 100)
  assert_trees_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [pytest.param(0.0, marks=pytest.mark.extended), 0.9])  # quick: momentum 0.9
def test_momentum_takes_optax_sgds_settings(mlp_problem, momentum):
  """``momentum=`` reads learning_rate and momentum as optax.sgd does: the newcomer's spelling is SGD-m."""
  params, loss = mlp_problem
  ours, _ = run(cola.cola_ud(0.05, momentum=momentum), params, loss, 100)
  reference, _ = run(optax.sgd(0.05, momentum=momentum), params, loss, 100)
  assert_trees_close(ours, reference, rtol=1e-5, atol=1e-6)
  free = lambda params: None  # every leaf free
  ours, _ = run(cola.o_cola_ud(0.05, momentum=momentum, constraints=free), params, loss, 20)
  reference, _ = run(optax.sgd(0.05, momentum=momentum), params, loss, 20)
  assert_trees_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({}, TypeError, "give momentum= .* got neither"),
    ({"friction": 1.0, "momentum": 0.9}, TypeError, "not both"),
    ({"momentum": 1.5}, ValueError, r"momentum must be in \[0, 1\]"),
    ({"momentum": optax.constant_schedule(0.9)}, TypeError, "momentum must be a number"),
  ],
)
def test_friction_or_momentum(kwargs, error, match):
  for make in (cola.cola_ud, cola.o_cola_ud, lambda lr, **kw: cola.c_cola_ud(lr, radius=1.0, **kw)):
    with pytest.raises(error, match=match):
      make(0.1, **kwargs)


# Keys and determinism.

NOISY = {
  "c_cola_od": lambda key: cola.c_cola_od(0.05, radius=0.5, temperature=1e-3, key=key),
  "c_cola_ud": lambda key: cola.c_cola_ud(0.3, friction=1.0, radius=0.5, temperature=1e-3, key=key),
  "o_cola_od": lambda key: cola.o_cola_od(0.05, temperature=1e-4, key=key),
  "o_cola_ud": lambda key: cola.o_cola_ud(0.1, friction=1.0, temperature=1e-4, key=key),
}


def _one_quick(names, quick):
  """``names`` as parameters, all but ``quick`` behind the slow marker (compilation dominates)."""
  return [pytest.param(n) if n == quick else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _one_quick(sorted(NOISY), "c_cola_ud"))
def test_same_key_is_bit_identical_and_other_keys_differ(name, mlp_problem):
  params, loss = mlp_problem
  train = jax.jit(lambda key: run(NOISY[name](key), params, loss, 20)[0])  # one program, run for each key
  a, b, c = train(jax.random.key(3)), train(jax.random.key(3)), train(jax.random.key(4))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  differences = [float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c))]
  assert min(differences) > 0


@pytest.mark.extended  # quick: test_platform_noise.py draws from a raw PRNGKey; typed keys in every other test
def test_raw_uint32_keys_work(mlp_problem):
  params, loss = mlp_problem
  a, _ = run(NOISY["c_cola_ud"](jax.random.PRNGKey(3)), params, loss, 5)
  b, _ = run(NOISY["c_cola_ud"](jax.random.wrap_key_data(jax.random.PRNGKey(3))), params, loss, 5)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_noise_is_independent_across_leaves():
  params = {"a": jnp.zeros(2000), "b": jnp.zeros(2000)}
  tx = cola.cola_od(0.1, temperature=1.0, key=jax.random.key(0))
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  a, b = np.asarray(updates["a"]), np.asarray(updates["b"])
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.1  # 0.1 is > 4 standard errors for n = 2000
  np.testing.assert_allclose(a.std(), math.sqrt(2 * 0.1), rtol=0.1)


def test_zero_temperature_draws_no_noise_and_needs_no_key(mlp_problem):
  params, loss = mlp_problem
  with_key, state = run(cola.c_cola_ud(0.3, friction=1.0, radius=0.5, key=jax.random.key(0)), params, loss, 10)
  without, _ = run(cola.c_cola_ud(0.3, friction=1.0, radius=0.5), params, loss, 10)
  for x, y in zip(jax.tree.leaves(with_key), jax.tree.leaves(without)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(jax.random.key(0)))


# jit, vmap, inject_hyperparams.


@pytest.mark.extended  # quick: test_optax_contract.py's dtype test counts the traces of a jitted step
def test_jit_compiles_once(mlp_problem):
  params, loss = mlp_problem
  tx = NOISY["o_cola_ud"](jax.random.key(0))
  traces = []

  @jax.jit
  def step(p, s):
    traces.append(1)
    updates, s = tx.update(jax.grad(loss)(p, 0), s, p)
    return optax.apply_updates(p, updates), s

  p, s = params, tx.init(params)
  for _ in range(3):
    p, s = step(p, s)
  assert len(traces) == 1


_COMPILES = []
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
jax.monitoring.register_event_duration_secs_listener(
  lambda event, duration, **_: _COMPILES.append(event) if event == _COMPILE_EVENT else None
)


def _compiles(fn):
  """``fn()``'s result and how many programs XLA compiled while it ran."""
  _COMPILES.clear()
  out = jax.block_until_ready(fn())
  return out, len(_COMPILES)


def test_outside_jit_init_project_params_and_residuals_compile_one_program_each():
  """Op by op, each operation and while loop of the leaves compiled on its own: 45 to 121 programs here."""
  # A new Implicit (its own function): nothing of these leaves is compiled yet in this process.
  constraints = {
    "orthogonal": cola.Orthogonal(),
    "circle": cola.Circle(0.5),
    "max_norm": cola.MaxNorm(0.5),
    "implicit": cola.Implicit(inequality=lambda w: jnp.sum(w * w) / 0.25 - 1, axis=0),
    "free": None,
  }
  params = {name: 0.1 + 0.01 * jnp.arange(24.0).reshape(6, 4) for name in constraints}
  makes = {
    "cola_od": lambda: cola.cola_od(0.1, constraints=constraints),
    "cola_ud": lambda: cola.cola_ud(0.1, friction=1.0, constraints=constraints),
    "constrained": lambda: cola.constrained(optax.adam(0.1), constraints=constraints),
  }
  for name, make in makes.items():
    state, compiles = _compiles(lambda: make().init(params))
    assert compiles <= 3, name  # the leaves' program, and at most JAX's own for the count and the momenta
    if name != "constrained":  # its program holds the inner transformation's init, one per instance
      assert _compiles(lambda: make().init(params))[1] == 0, name
  projected, compiles = _compiles(lambda: cola.project_params(params, constraints))
  assert compiles <= 2 * len(constraints), compiles  # one program per leaf, and JAX's own
  state = makes["cola_od"]().init(projected)  # the slacks of the projected leaves, as a run started from them has
  residuals, compiles = _compiles(lambda: cola.constraint_residuals(projected, state))
  assert compiles == 1
  assert residuals["free"] is None and max(jax.tree.leaves(residuals)) < 1e-5


@pytest.mark.parametrize("name", _one_quick(sorted(NOISY), "c_cola_ud"))
def test_vmap_over_keys_runs_independent_seeds(name, mlp_problem):
  params, loss = mlp_problem
  keys = jax.random.split(jax.random.key(7), 3)
  batched, _ = jax.vmap(lambda k: run(NOISY[name](k), params, loss, 10))(keys)
  alone = jax.jit(lambda k: run(NOISY[name](k), params, loss, 10))  # one program, run for each key
  for i in range(3):
    single, _ = alone(keys[i])
    assert_trees_close(jax.tree.map(lambda x: x[i], batched), single, rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(batched["layer1"]["w"][0] - batched["layer1"]["w"][1]))) > 0


@pytest.mark.extended  # quick: test_optax_contract.py's inject_hyperparams test compares with the plain transform
def test_inject_hyperparams_matches_the_plain_transform(mlp_problem):
  params, loss = mlp_problem
  constraints = {
    "layer0": {"w": cola.Circle(0.5), "b": None},
    "layer1": {"w": cola.Orthogonal(), "b": None},
    "layer2": None,
  }
  key = jax.random.key(5)
  injected = optax.inject_hyperparams(cola.cola_ud)(
    learning_rate=0.3, friction=1.0, temperature=1e-4, key=key, constraints=constraints
  )
  plain = cola.cola_ud(0.3, friction=1.0, temperature=1e-4, key=key, constraints=constraints)
  a, state = run(injected, params, loss, 20)
  b, _ = run(plain, params, loss, 20)
  assert_trees_close(a, b, rtol=1e-5, atol=1e-6)
  assert float(cola.constraint_residuals(a, state)["layer1"]["w"]) < 1e-5


@pytest.mark.slow  # a long run: the quick suite keeps within its time
def test_inject_hyperparams_schedule_anneals_temperature_to_zero(mlp_problem):
  params, loss = mlp_problem
  schedule = optax.linear_schedule(1e-3, 0.0, transition_steps=5)
  tx = optax.inject_hyperparams(cola.c_cola_od)(
    learning_rate=0.05, radius=0.5, temperature=schedule, key=jax.random.key(0)
  )
  annealed, state = run(tx, params, loss, 10)
  # optax's linear schedule ends a rounding error below zero (-1.5e-11 in float32);
  # the transform reads it as 0 instead of taking the square root of a negative.
  assert abs(float(state.hyperparams["temperature"])) < 1e-9
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(annealed))
  # After annealing, one more step equals a noiseless step from the same point.
  grads = jax.grad(loss)(annealed, 10)
  noisy_updates, _ = tx.update(grads, state, annealed)
  clean = cola.c_cola_od(0.05, radius=0.5)
  clean_updates, _ = clean.update(grads, state.inner_state._replace(key=None), annealed)
  assert_trees_close(noisy_updates, clean_updates, rtol=1e-6, atol=1e-7)


@pytest.mark.extended  # quick: test_optax_contract.py injects into cola_od without a key, and against the plain one
def test_inject_hyperparams_without_key_draws_no_noise(mlp_problem):
  params, loss = mlp_problem
  tx = optax.inject_hyperparams(cola.c_cola_ud)(learning_rate=0.3, friction=1.0, radius=0.5)
  a, _ = run(tx, params, loss, 10)
  b, _ = run(cola.c_cola_ud(0.3, friction=1.0, radius=0.5), params, loss, 10)
  assert_trees_close(a, b, rtol=1e-6, atol=1e-7)


# Off-manifold starts (design decision: the first update projects).


def test_circle_weights_outside_the_radius_start_inside_it_at_the_first_update():
  params = {"w": jnp.array([[-3.0, -0.05, 0.0, 0.02, 0.5]])}
  tx = cola.c_cola_ud(0.3, friction=1.0, radius=0.1)
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.zeros((1, 5))}, state, params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(new["w"], [[-0.099, -0.05, 0.0, 0.02, 0.099]], atol=1e-7)  # 0.99 r: free to move
  # params + updates rounds at the scale of the old value (3.0): one float32 ulp of it.
  ulp_of_old = float(np.spacing(np.float32(3.0)))
  assert float(cola.constraint_residuals(new, state)["w"]) <= 2 * ulp_of_old / 0.1
  # From then on old and new values are close, the subtraction is exact, and the
  # constraint holds to float32 rounding.
  updates, state = tx.update({"w": jnp.zeros((1, 5))}, state, new)
  new = optax.apply_updates(new, updates)
  assert float(cola.constraint_residuals(new, state)["w"]) < 1e-6
  assert jnp.max(jnp.abs(new["w"])) <= jnp.float32(0.1)


@pytest.mark.parametrize(
  "shape",
  [
    pytest.param((6, 3), marks=pytest.mark.extended),  # quick: the wide kernel (3, 6)
    (3, 6),
    pytest.param((3, 3, 2, 4), marks=pytest.mark.extended),
  ],
)
def test_non_orthonormal_kernels_become_their_polar_factor(shape):
  w = jax.random.normal(jax.random.key(0), shape)
  params = {"w": w}
  tx = cola.o_cola_ud(0.1, friction=1.0)
  updates, state = tx.update({"w": jnp.zeros(shape)}, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  matrix = np.asarray(w, np.float64).reshape(-1, shape[-1])
  u, _, vt = np.linalg.svd(matrix, full_matrices=False)
  np.testing.assert_allclose(np.asarray(new["w"]).reshape(matrix.shape), u @ vt, atol=2e-6)
  assert float(cola.constraint_residuals(new, state)["w"]) < 1e-5


# Clear errors.


def test_positive_temperature_without_key_is_an_error():
  with pytest.raises(ValueError, match="key"):
    cola.cola_od(0.1, temperature=1e-3)
  with pytest.raises(ValueError, match="key"):
    cola.c_cola_ud(0.1, friction=1.0, radius=0.1, temperature=optax.constant_schedule(1e-3))


@pytest.mark.parametrize("bad", [0.0, -0.1])
def test_non_positive_learning_rate_is_an_error(bad):
  with pytest.raises(ValueError, match="learning_rate"):
    cola.cola_ud(bad, friction=1.0)


def test_negative_friction_and_temperature_are_errors():
  with pytest.raises(ValueError, match="friction"):
    cola.cola_ud(0.1, friction=-1.0)
  with pytest.raises(ValueError, match="temperature"):
    cola.cola_od(0.1, temperature=-1.0, key=jax.random.key(0))


def test_bad_key_is_an_error():
  with pytest.raises(TypeError, match="key"):
    cola.cola_od(0.1, temperature=1.0, key=42)


@pytest.mark.parametrize("radius", [0.0, -1.0])
def test_non_positive_radius_is_an_error_naming_the_leaf(radius, mlp_problem):
  params, _ = mlp_problem
  with pytest.raises(ValueError, match="radius"):
    cola.Circle(radius)
  radii = {"layer0": 0.1, "layer1": radius, "layer2": 0.1}
  with pytest.raises(ValueError, match=r"c_cola_od: radius\['layer1'\] must be positive"):
    cola.c_cola_od(0.1, radius=radii)
  tx = cola.c_cola_od(0.1, radius=lambda _: radii)  # known at init only
  with pytest.raises(ValueError, match=r"\['layer1'\]\['w'\]"):
    tx.init(params)


def test_orthogonal_constraint_on_a_vector_is_an_error_naming_the_leaf(mlp_problem):
  params, _ = mlp_problem
  tx = cola.o_cola_od(0.1, mask=lambda p: jax.tree.map(lambda _: True, p))
  with pytest.raises(ValueError, match=r"\['layer0'\]\['b'\].*ndim >= 2"):
    tx.init(params)


def test_missing_params_is_an_error(mlp_problem):
  params, _ = mlp_problem
  tx = cola.c_cola_ud(0.1, friction=1.0, radius=0.1)
  with pytest.raises(ValueError, match="params"):
    tx.update(params, tx.init(params))


def test_state_of_other_parameters_is_an_error(mlp_problem):
  params, _ = mlp_problem
  tx = cola.c_cola_ud(0.1, friction=1.0, radius=0.1)
  state = tx.init({"other": jnp.zeros((2, 2))})
  with pytest.raises(ValueError, match="structure of the parameters"):
    tx.update(params, state, params)


def test_state_of_other_constraints_is_an_error(mlp_problem):
  params, _ = mlp_problem
  state = cola.o_cola_ud(0.1, friction=1.0).init(params)
  tx = cola.c_cola_ud(0.1, friction=1.0, radius=0.1)
  with pytest.raises(ValueError, match=r"\['layer0'\]\['w'\].*does not match its constraint"):
    tx.update(params, state, params)


def test_constraint_that_is_not_a_constraint_is_an_error(mlp_problem):
  params, _ = mlp_problem
  with pytest.raises(TypeError, match=r"\['layer0'\]\['w'\]"):
    cola.cola_od(0.1, constraints={"layer0": {"w": 0.1, "b": None}, "layer1": None, "layer2": None}).init(params)


@pytest.mark.extended  # quick: test_constraint_residuals_find_the_leaf_states_of_every_transform, in a chain
def test_residuals_are_found_inside_a_chain(mlp_problem):
  params, loss = mlp_problem
  tx = optax.chain(optax.clip_by_global_norm(1.0), cola.c_cola_ud(0.3, friction=1.0, radius=0.2))
  new, state = run(tx, params, loss, 50)
  residuals = cola.constraint_residuals(new, state)
  assert residuals["layer0"]["b"] is None
  assert all(float(r) <= 1e-5 for r in jax.tree.leaves(residuals))


def test_per_layer_radii_none_frees_a_layer_and_callables_work(mlp_problem):
  params, loss = mlp_problem
  radii = {"layer0": 0.05, "layer1": 0.1, "layer2": None}
  new, state = run(cola.c_cola_ud(0.3, friction=1.0, radius=radii), params, loss, 30)
  assert jnp.max(jnp.abs(new["layer0"]["w"])) <= jnp.float32(0.05)
  assert jnp.max(jnp.abs(new["layer1"]["w"])) <= jnp.float32(0.1)
  assert state.constraint_states["layer2"]["w"] is None
  assert state.constraint_states["layer0"]["b"] is None  # biases stay free by default
  by_callable, _ = run(cola.c_cola_ud(0.3, friction=1.0, radius=lambda p: radii), params, loss, 30)
  for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(by_callable)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  masked, state = run(
    cola.c_cola_od(0.1, radius=0.1, mask={"layer0": True, "layer1": False, "layer2": False}), params, loss, 5
  )
  assert state.constraint_states["layer1"]["w"] is None
  assert state.constraint_states["layer0"]["b"] is not None  # the mask includes layer0's bias


def test_project_params_puts_constrained_leaves_on_the_manifold(mlp_problem):
  params, _ = mlp_problem
  on_circle = cola.project_params(params, cola.circle_constraints({"layer0": 0.05, "layer1": 0.1, "layer2": None}))
  assert jnp.max(jnp.abs(on_circle["layer0"]["w"])) <= jnp.float32(0.05)
  np.testing.assert_array_equal(on_circle["layer2"]["w"], params["layer2"]["w"])
  np.testing.assert_array_equal(on_circle["layer0"]["b"], params["layer0"]["b"])
  orthonormal = cola.project_params(params, cola.orthogonal_constraints())
  for layer in ("layer0", "layer1", "layer2"):
    w = orthonormal[layer]["w"]
    q = w if w.shape[0] >= w.shape[1] else w.T
    np.testing.assert_allclose(q.T @ q, np.eye(q.shape[1]), atol=2e-6)
  # On the manifold, the first update with zero gradient moves nothing.
  tx = cola.o_cola_ud(0.1, friction=1.0)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, orthonormal), tx.init(orthonormal), orthonormal)
  assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(updates)) <= 1e-6


LOW_PRECISION = {
  "c_cola_ud": lambda: cola.c_cola_ud(0.3, friction=1.0, radius=0.2, temperature=1e-5, key=jax.random.key(0)),
  "o_cola_od": lambda: cola.o_cola_od(0.05, temperature=1e-6, key=jax.random.key(0)),
}


# The quick suite takes bfloat16 with c_cola_ud; float16 with o_cola_od is extended, the other pairs slow.
@pytest.mark.parametrize(
  "dtype, name",
  quick_or_extended(
    [(d, n) for d in (jnp.bfloat16, jnp.float16) for n in LOW_PRECISION],
    {(jnp.bfloat16, "c_cola_ud")},
    ids=lambda d, n: f"{jnp.dtype(d).name}-{n}",
    extended={(jnp.float16, "o_cola_od")},
  ),
)
def test_low_precision_parameters_keep_their_dtype_and_the_constraint(dtype, name, mlp_problem):
  params, loss = mlp_problem
  low = jax.tree.map(lambda p: p.astype(dtype), params)
  loss_in_float32 = lambda p, i: loss(jax.tree.map(lambda x: x.astype(jnp.float32), p), i)
  new, state = run(LOW_PRECISION[name](), low, loss_in_float32, 50)
  assert all(x.dtype == dtype for x in jax.tree.leaves(new))
  residual = max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(new, state)))
  assert residual <= 8 * float(jnp.finfo(dtype).eps), residual


class _CountedCircle(cola.Circle):
  """A Circle that counts the traces of its point and its init."""

  calls: ClassVar[dict] = {"point": 0, "init": 0}

  def point(self, param, aux):
    _CountedCircle.calls["point"] += 1
    return super().point(param, aux)

  def init(self, param):
    _CountedCircle.calls["init"] += 1
    return super().init(param)


@pytest.mark.parametrize(
  "make",
  [
    cola.cola_od,
    pytest.param(lambda *a, **k: cola.cola_ud(*a, friction=1.0, **k), marks=pytest.mark.extended),  # quick: od
  ],
  ids=["od", "ud"],
)
def test_an_update_traces_each_leafs_point_once_and_its_state_check_no_init(make):
  params = {"a": jnp.full(3, 0.1), "b": jnp.full((2, 2), 0.2)}
  tx = make(0.1, constraints=_CountedCircle(0.5), temperature=1e-3, key=jax.random.key(0))
  state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)
  jax.jit(tx.update).lower(grads, state, params)  # the state check learns each leaf's state structure once
  _CountedCircle.calls.update(point=0, init=0)
  jax.jit(lambda g, s, p: tx.update(g, s, p)).lower(grads, state, params)  # a new trace
  assert _CountedCircle.calls == {"point": 2, "init": 0}


class _UsersState(NamedTuple):
  """A state of a transform of one's own that keeps its leaves' constraint states as the engine does."""

  constraint_states: Any


@pytest.mark.parametrize(
  "make",
  [
    pytest.param(lambda c: cola.cola_od(0.1, constraints=c), marks=pytest.mark.extended),
    pytest.param(
      lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, splitting=cola.Splitting("OBABO")),
      marks=pytest.mark.extended,
    ),
    lambda c: cola.constrained(optax.adam(1e-2), constraints=c),  # quick: constrained's state, in a chain
    pytest.param(lambda c: cola.manifold_muon(0.1, constraints=c), marks=pytest.mark.extended),
    pytest.param(
      lambda c: cola.hyperspherical_descent(0.1, constraints={"w": cola.UnitNorm(), "b": None}),
      marks=pytest.mark.extended,
    ),
  ],
  ids=["cola_od", "cola_ud", "constrained", "manifold_muon", "hyperspherical_descent"],
)
def test_constraint_residuals_find_the_leaf_states_of_every_transform(make):
  params = {"w": jnp.eye(3, 2), "b": jnp.zeros(2)}
  tx = optax.chain(optax.clip_by_global_norm(1.0), make({"w": cola.Orthogonal(), "b": None}))
  state = tx.init(params)
  updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  params: Any = optax.apply_updates(params, updates)
  residuals = cola.constraint_residuals(params, state)
  assert residuals["b"] is None and float(residuals["w"]) < 1e-5
  users = cola.constraint_residuals(params, _UsersState(optax.tree.get(state, "constraint_states")))
  assert users["b"] is None and users["w"] == residuals["w"]
