"""Constraints declared on the model (with_constraint, constraints_from) and chosen by path rules.

A model whose initializers are wrapped in ``cola.with_constraint`` must train
exactly (bit for bit) as the same model given the explicit constraint pytree
and started on the manifold by ``project_params``; the declarations must
survive what Flax users do with parameters (unboxing, sharding annotations,
TrainState, nnx.Optimizer, orbax checkpoints).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola

pytest.importorskip("flax")
ocp = pytest.importorskip("orbax.checkpoint")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

STEPS = 6
LECUN = nn.initializers.lecun_normal()
ORTHOGONAL = cola.Orthogonal()
CIRCLE = cola.Circle(0.3)
SPHERE = cola.MaxNorm(0.5)


def data():
  kx, kw = jax.random.split(jax.random.key(42))
  x = jax.random.normal(kx, (16, 4))
  return x, jnp.tanh(x @ jax.random.normal(kw, (4, 2)))


def cola_tx(constraints):
  return cola.cola_ud(0.2, friction=1.0, constraints=constraints, temperature=1e-4, key=jax.random.key(3))


def key_free(tree):
  return jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)


def assert_leaves_identical(a, b):
  leaves_a, leaves_b = jax.tree.leaves(key_free(a)), jax.tree.leaves(key_free(b))
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def max_residual(params, opt_state):
  return max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(params, opt_state)))


# flax.linen


class LinenMLP(nn.Module):
  """Three constrained kernels (two with sharding annotations, one in each nesting order)."""

  declare: bool = True

  @nn.compact
  def __call__(self, x):
    def init(constraint):
      return cola.with_constraint(LECUN, constraint) if self.declare else LECUN

    x = jnp.tanh(nn.Dense(6, kernel_init=nn.with_partitioning(init(ORTHOGONAL), (None, "model")))(x))
    x = jnp.tanh(nn.Dense(6, kernel_init=init(CIRCLE))(x))
    if self.declare:
      kernel_init = cola.with_constraint(nn.with_partitioning(LECUN, ("model", None)), SPHERE)
    else:
      kernel_init = nn.with_partitioning(LECUN, ("model", None))
    x = jnp.tanh(nn.Dense(6, kernel_init=kernel_init)(x))
    return nn.Dense(2)(x)


LINEN_CONSTRAINTS = {
  "Dense_0": {"kernel": ORTHOGONAL, "bias": None},
  "Dense_1": {"kernel": CIRCLE, "bias": None},
  "Dense_2": {"kernel": SPHERE, "bias": None},
  "Dense_3": {"kernel": None, "bias": None},
}


def linen_state(params, constraints):
  x, y = data()
  state = train_state.TrainState.create(apply_fn=LinenMLP().apply, params=params, tx=cola_tx(constraints))

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  return state, step


def train(state, step):
  for _ in range(STEPS):
    state = step(state)
  return state


@pytest.fixture(scope="module")
def linen_runs():
  """The declared model's boxed parameters, its TrainState run, and the explicit run."""
  x, _ = data()
  declared = LinenMLP().init(jax.random.key(0), x)["params"]
  plain = nn.meta.unbox(LinenMLP(declare=False).init(jax.random.key(0), x)["params"])
  state, step = linen_state(declared, cola.constraints_from(declared))
  return {
    "declared": declared,
    "projected": cola.project_params(plain, LINEN_CONSTRAINTS),
    "trained": train(state, step),
    "step": step,
    "explicit": train(*linen_state(cola.project_params(plain, LINEN_CONSTRAINTS), LINEN_CONSTRAINTS)),
  }


def test_linen_declared_model_starts_on_the_manifold_as_project_params_puts_it(linen_runs):
  x, _ = data()
  declared = linen_runs["declared"]
  assert cola.constraints_from(declared) == LINEN_CONSTRAINTS
  unboxed = nn.meta.unbox(declared)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(unboxed, is_leaf=nn.meta.is_axis_metadata))
  assert_leaves_identical(unboxed, linen_runs["projected"])
  assert max_residual(unboxed, cola_tx(LINEN_CONSTRAINTS).init(unboxed)) < 1e-6
  np.testing.assert_array_equal(LinenMLP().apply({"params": declared}, x), LinenMLP().apply({"params": unboxed}, x))


def test_linen_declarations_compose_with_partitioning_in_both_orders(linen_runs):
  x, _ = data()
  variables = {"params": linen_runs["declared"]}
  specs = nn.get_partition_spec(variables)["params"]
  assert specs["Dense_0"]["kernel"] == jax.sharding.PartitionSpec(None, "model")
  assert specs["Dense_2"]["kernel"] == jax.sharding.PartitionSpec("model", None)
  assert specs["Dense_1"]["kernel"] == jax.sharding.PartitionSpec()  # declared, not partitioned
  abstract = jax.eval_shape(LinenMLP().init, jax.random.key(0), x)
  assert cola.constraints_from(abstract["params"]) == LINEN_CONSTRAINTS
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  sharded = jax.device_put(variables, nn.get_sharding(abstract, mesh))
  kernel = sharded["params"]["Dense_0"]["kernel"].value.raw_value
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  assert cola.constraints_from(sharded["params"]) == LINEN_CONSTRAINTS
  assert_leaves_identical(sharded, variables)


def test_linen_train_state_with_declared_constraints_is_the_explicit_run(linen_runs):
  trained, explicit = linen_runs["trained"], linen_runs["explicit"]
  assert cola.constraints_from(trained.params) == LINEN_CONSTRAINTS  # the boxes survive training
  assert_leaves_identical(nn.meta.unbox(trained.params), explicit.params)
  assert_leaves_identical(trained.opt_state, explicit.opt_state)
  assert int(trained.step) == int(explicit.step) == STEPS
  assert max_residual(trained.params, trained.opt_state) < 1e-5
  moved = jnp.abs(explicit.params["Dense_1"]["kernel"] - linen_runs["projected"]["Dense_1"]["kernel"])
  assert float(jnp.max(moved)) > 1e-3


@pytest.mark.extended  # quick: the nnx state's round trip below; test_checkpoint.py resumes a run through orbax
def test_orbax_round_trip_of_a_linen_train_state_keeps_the_constraints(linen_runs, tmp_path):
  x, _ = data()
  state, step = linen_runs["trained"], linen_runs["step"]
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  # The target is rebuilt from the model code, as a fresh process would.
  fresh = LinenMLP().init(jax.random.key(1), x)["params"]
  like = train_state.TrainState.create(apply_fn=state.apply_fn, params=fresh, tx=state.tx)
  restored = checkpointer.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
  checkpointer.close()
  assert cola.constraints_from(restored.params) == cola.constraints_from(state.params) == LINEN_CONSTRAINTS
  assert_leaves_identical(restored.params, state.params)
  assert_leaves_identical(restored.opt_state, state.opt_state)
  assert_leaves_identical(step(restored), step(state))


def test_linen_declarations_refuse_a_scanned_axis():
  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      layer = nn.scan(
        lambda module, c, _: (nn.Dense(4, kernel_init=cola.with_constraint(LECUN, CIRCLE))(c), None),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=2,
      )
      return layer(self, x, None)[0]

  with pytest.raises(ValueError, match=r"cannot gain an axis.*path_constraints"):
    Scanned().init(jax.random.key(0), jnp.ones((3, 4)))


# flax.nnx


class NnxMLP(nnx.Module):
  def __init__(self, rngs, declare=True):
    def init(constraint):
      return cola.with_constraint(LECUN, constraint) if declare else LECUN

    self.layers = nnx.List(
      [nnx.Linear(4, 6, kernel_init=init(ORTHOGONAL), rngs=rngs), nnx.Linear(6, 6, kernel_init=init(CIRCLE), rngs=rngs)]
    )
    self.out = nnx.Linear(6, 2, kernel_init=init(SPHERE), rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return self.out(x)


NNX_CONSTRAINTS = nnx.State(
  {
    "layers": {0: {"kernel": ORTHOGONAL, "bias": None}, 1: {"kernel": CIRCLE, "bias": None}},
    "out": {"kernel": SPHERE, "bias": None},
  }
)


def nnx_train(model, constraints):
  x, y = data()
  optimizer = nnx.Optimizer(model, cola_tx(constraints), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))

  for _ in range(STEPS):
    step(model, optimizer)
  return nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)


# Quick: the linen model trains as the explicit run, and an nnx declaration starts on its manifold (the partitioning
# test below); the nnx training run under slow.
@pytest.mark.slow
def test_nnx_declared_model_starts_on_the_manifold_and_trains_as_the_explicit_run():
  declared = NnxMLP(nnx.Rngs(0))
  plain = NnxMLP(nnx.Rngs(0), declare=False)
  nnx.update(plain, cola.project_params(nnx.as_pure(nnx.state(plain, nnx.Param)), NNX_CONSTRAINTS))
  assert declared.layers[0].kernel.constraint == ORTHOGONAL
  constraints = cola.constraints_from(nnx.state(declared, nnx.Param))
  assert constraints == NNX_CONSTRAINTS
  start = nnx.as_pure(nnx.state(declared, nnx.Param))
  assert_leaves_identical(start, nnx.as_pure(nnx.state(plain, nnx.Param)))
  assert max_residual(start, cola_tx(constraints).init(start)) < 1e-6

  params, opt_state = nnx_train(declared, constraints)
  expected_params, expected_state = nnx_train(plain, NNX_CONSTRAINTS)
  assert_leaves_identical(params, expected_params)
  assert_leaves_identical(opt_state, expected_state)
  assert max_residual(params, opt_state) < 1e-5
  assert cola.constraints_from(nnx.state(declared, nnx.Param)) == NNX_CONSTRAINTS


def test_nnx_declarations_compose_with_nnx_partitioning():
  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    model = nnx.Linear(
      6,
      4,
      rngs=nnx.Rngs(0),
      kernel_init=cola.with_constraint(nnx.with_partitioning(LECUN, (None, "model")), ORTHOGONAL),
    )
  assert model.kernel.out_sharding == (None, "model") and model.kernel.constraint == ORTHOGONAL
  assert cola.constraints_from(nnx.state(model, nnx.Param)) == nnx.State({"kernel": ORTHOGONAL, "bias": None})
  kernel = np.asarray(model.kernel[...], np.float64)
  np.testing.assert_allclose(kernel.T @ kernel, np.eye(4), atol=1e-6)

  with jax.set_mesh(mesh):
    reversed_order = nnx.Linear(
      6,
      4,
      rngs=nnx.Rngs(0),
      kernel_init=nnx.with_partitioning(cola.with_constraint(LECUN, ORTHOGONAL), (None, "model")),
    )
  with pytest.raises(ValueError, match=r"cola.with_constraint\(nnx.with_partitioning\(init"):
    cola.constraints_from(nnx.state(reversed_order, nnx.Param))


def test_nnx_declarations_refuse_layers_stacked_by_vmap():
  @nnx.vmap(in_axes=0, out_axes=0)
  def stacked_layers(key):
    return nnx.Linear(4, 4, kernel_init=cola.with_constraint(LECUN, ORTHOGONAL), rngs=nnx.Rngs(key))

  layers = stacked_layers(jax.random.split(jax.random.key(0), 3))
  with pytest.raises(ValueError, match=r"of shape \(3, 4, 4\) declares Orthogonal.* for the shape \(4, 4\)"):
    cola.constraints_from(nnx.state(layers, nnx.Param))


def test_orbax_round_trip_of_an_nnx_state_keeps_the_constraints(tmp_path):
  model = NnxMLP(nnx.Rngs(0))
  state = nnx.state(model)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "model", state)
  checkpointer.wait_until_finished()
  abstract = nnx.state(nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(1))))
  restored = checkpointer.restore(tmp_path / "model", abstract)
  checkpointer.close()
  assert cola.constraints_from(restored) == cola.constraints_from(state) == NNX_CONSTRAINTS
  assert_leaves_identical(nnx.as_pure(restored), nnx.as_pure(state))


# Path rules


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="mix")(jnp.tanh(nn.Dense(4, name="proj")(x)))


class Nested(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = Block(name=f"block_{i}")(x)
    return nn.Dense(2, kernel_init=nn.with_partitioning(LECUN, (None, "model")), name="head")(x)


RULES = [
  (r"block_0/proj/kernel$", CIRCLE),  # one layer of one block
  (r"block_\d+/\w+/kernel$", ORTHOGONAL),  # the other block kernels
  (r"head/bias", None),
]


def linen_expected_by_rules():
  expected = {
    f"block_{i}": {name: {"kernel": ORTHOGONAL, "bias": SPHERE} for name in ("proj", "mix")} for i in range(3)
  }
  expected["block_0"]["proj"]["kernel"] = CIRCLE
  expected["head"] = {"kernel": SPHERE, "bias": None}
  return expected


def test_path_rules_select_linen_leaves_boxed_or_not():
  x, _ = data()
  boxed = Nested().init(jax.random.key(0), x)["params"]
  rules = cola.path_constraints(RULES, default=SPHERE)
  assert rules(boxed) == rules(nn.meta.unbox(boxed)) == linen_expected_by_rules()
  params = cola.project_params(nn.meta.unbox(boxed), rules)
  kernel = np.asarray(params["block_2"]["mix"]["kernel"], np.float64)
  np.testing.assert_allclose(kernel.T @ kernel, np.eye(4), atol=1e-6)
  states = cola_tx(rules).init(params).constraint_states
  assert isinstance(states["block_0"]["proj"]["kernel"], cola.CircleState)
  assert isinstance(states["block_1"]["mix"]["bias"], cola.MaxNormState) and states["head"]["bias"] is None


def test_path_rules_select_nnx_leaves_by_list_index():
  model = NnxMLP(nnx.Rngs(0), declare=False)
  rules = cola.path_constraints([(r"layers/1/kernel", CIRCLE), (r"kernel", ORTHOGONAL)])
  expected = nnx.State(
    {
      "layers": {0: {"kernel": ORTHOGONAL, "bias": None}, 1: {"kernel": CIRCLE, "bias": None}},
      "out": {"kernel": ORTHOGONAL, "bias": None},
    }
  )
  assert rules(nnx.state(model, nnx.Param)) == rules(nnx.as_pure(nnx.state(model, nnx.Param))) == expected
  optimizer = nnx.Optimizer(model, cola_tx(rules), wrt=nnx.Param)
  states = optimizer.opt_state.constraint_states
  assert isinstance(nnx.as_pure(states["layers"][1]["kernel"]), cola.CircleState)
  assert isinstance(nnx.as_pure(states["out"]["kernel"]), cola.ProjectionInfo)


def test_a_rule_that_selects_nothing_is_an_error_naming_it():
  x, _ = data()
  params = Nested().init(jax.random.key(0), x)["params"]
  typo = cola.path_constraints([(r"block_\d+/mix/kernel", ORTHOGONAL), (r"blok_0/proj/kernel", CIRCLE)])
  with pytest.raises(
    ValueError,
    match=r"rule 1 \('blok_0/proj/kernel', Circle\(radius=0.3\)\) matches no "
    r"parameter path.*block_0/mix/bias",
  ):
    cola_tx(typo).init(params)
  shadowed = cola.path_constraints([(r"kernel", ORTHOGONAL), (r"block_0/proj/kernel", CIRCLE)])
  with pytest.raises(
    ValueError,
    match=r"rule 1 .* selects no parameter: every path it matches "
    r"\(block_0/proj/kernel\) is taken by an earlier rule",
  ):
    cola.project_params(params, shadowed)


def test_path_rules_are_checked_at_construction():
  with pytest.raises(ValueError, match=r"rule 1 has an invalid regex 'block_\(0': missing \)"):
    cola.path_constraints([(r"kernel", ORTHOGONAL), (r"block_(0", CIRCLE)])
  with pytest.raises(
    TypeError, match=r"the constraint of rule 0 \('kernel'\) must be a cola_jax Constraint or None, got 0.3"
  ):
    cola.path_constraints([(r"kernel", 0.3)])
  with pytest.raises(TypeError, match="default must be a cola_jax Constraint or None"):
    cola.path_constraints([(r"kernel", CIRCLE)], default="orthogonal")
  with pytest.raises(TypeError, match=r"rule 0 must be a \(regex, constraint\) pair"):
    cola.path_constraints([r"kernel"])
  with pytest.raises(TypeError, match="rules must be a sequence of"):
    cola.path_constraints({r"kernel": CIRCLE})


# Errors and the optional dependency


def test_with_constraint_errors():
  with pytest.raises(TypeError, match="constraint must be a cola_jax Constraint"):
    cola.with_constraint(LECUN, "orthogonal")
  with pytest.raises(TypeError, match="initializer must be callable"):
    cola.with_constraint(ORTHOGONAL, LECUN)
  with pytest.raises(
    ValueError, match=r"Orthogonal constraint on the leaf at <with_constraint initializer>, of shape \(6,\)"
  ):
    nn.Dense(6, bias_init=cola.with_constraint(nn.initializers.zeros, ORTHOGONAL)).init(
      jax.random.key(0), jnp.ones((1, 4))
    )
  with pytest.raises(ValueError, match=r"already declares the constraint Circle\(radius=0.3\)"):
    cola.with_constraint(cola.with_constraint(LECUN, CIRCLE), ORTHOGONAL)(jax.random.key(0), (4, 6))
  x, _ = data()
  with pytest.raises(ValueError, match="no parameter in the tree declares a constraint.*before flax.linen.meta.unbox"):
    cola.constraints_from(nn.meta.unbox(LinenMLP().init(jax.random.key(0), x)["params"]))
  with pytest.raises(ValueError, match="no parameter in the tree declares a constraint"):
    cola.constraints_from(nnx.as_pure(nnx.state(NnxMLP(nnx.Rngs(0)), nnx.Param)))


def test_importing_cola_jax_does_not_import_flax():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = "import sys, cola_jax; assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
  result = subprocess.run(
    [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr
