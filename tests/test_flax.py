"""CoLA inside Flax: linen with TrainState, nnx with nnx.Optimizer.

The model is a small CNN whose 3x3 conv kernel is kept orthonormal (its 9 x 4
tall view has orthonormal columns) and whose dense kernel is circle-constrained
(``|w| <= RADIUS`` entrywise), trained on synthetic regression data.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

RADIUS = 0.1
STEPS = 40
TOLERANCE = 1e-5  # on every constraint residual


def synthetic_data():
  """Images (32, 8, 8, 1) and targets from a fixed random teacher."""
  kx, kw = jax.random.split(jax.random.key(42))
  x = jax.random.normal(kx, (32, 8, 8, 1))
  teacher = jax.random.normal(kw, (8 * 8, 3)) / 8.0
  y = jnp.tanh(x.reshape(32, -1) @ teacher)
  return x, y


def cola_tx(constraints, key=jax.random.key(0)):
  return cola.cola_ud(0.3, friction=1.0, constraints=constraints, temperature=1e-7, key=key)


def assert_on_manifold(params, opt_state):
  residuals = cola.constraint_residuals(params, opt_state)
  values = [float(r) for r in jax.tree.leaves(residuals)]
  assert len(values) == 2  # the conv kernel and the dense kernel; biases are free
  assert max(values) <= TOLERANCE, residuals


def assert_trees_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def tall_gram_defect(kernel):
  q = np.asarray(kernel, np.float64).reshape(-1, kernel.shape[-1])
  return np.max(np.abs(q.T @ q - np.eye(q.shape[1])))


# flax.linen


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Conv(features=4, kernel_size=(3, 3), name="conv")(x))
    return nn.Dense(3, name="dense")(x.reshape(x.shape[0], -1))


LINEN_CONSTRAINTS = {
  "conv": {"kernel": cola.Orthogonal(), "bias": None},
  "dense": {"kernel": cola.Circle(RADIUS), "bias": None},
}


def linen_setup(constraints=LINEN_CONSTRAINTS):
  x, y = synthetic_data()
  model = LinenCNN()
  params = model.init(jax.random.key(1), x)["params"]
  params = cola.project_params(params, constraints)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=cola_tx(constraints))

  def loss_fn(params):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  return state, loss_fn


@pytest.mark.extended  # quick: test_nnx_optimizer_trains_on_the_manifold checks that project_params took effect
def test_project_params_starts_the_linen_model_on_the_manifold():
  state, _ = linen_setup()
  assert tall_gram_defect(state.params["conv"]["kernel"]) < 1e-5
  assert float(jnp.max(jnp.abs(state.params["dense"]["kernel"]))) <= np.float32(RADIUS)
  assert_on_manifold(state.params, state.opt_state)


@pytest.mark.parametrize("spec", ["prefix", pytest.param("callable", marks=pytest.mark.extended)])  # quick: prefix
def test_linen_train_state_trains_on_the_manifold(spec):
  def by_layer_name(params):  # the same assignment, derived from the parameter names
    return {
      name: {"kernel": cola.Orthogonal() if name == "conv" else cola.Circle(RADIUS), "bias": None} for name in params
    }

  state, loss_fn = linen_setup(LINEN_CONSTRAINTS if spec == "prefix" else by_layer_name)

  @jax.jit
  def train_step(state):
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(STEPS):
    state, loss = train_step(state)
    losses.append(float(loss))
  final = float(loss_fn(state.params))
  assert final < 0.1 * losses[0], (losses[0], final)
  assert int(state.step) == STEPS and int(state.opt_state.count) == STEPS
  assert_on_manifold(state.params, state.opt_state)
  assert tall_gram_defect(state.params["conv"]["kernel"]) < 1e-5
  assert float(jnp.max(jnp.abs(state.params["dense"]["kernel"]))) <= np.float32(RADIUS)
  assert float(jnp.max(jnp.abs(state.params["dense"]["kernel"]))) > 0.99 * RADIUS  # the bound is active
  # The constraint states sit where the prefix put them.
  assert isinstance(state.opt_state.constraint_states["conv"]["kernel"], cola.ProjectionInfo)
  assert isinstance(state.opt_state.constraint_states["dense"]["kernel"], cola.CircleState)
  assert state.opt_state.constraint_states["conv"]["bias"] is None


def test_linen_apply_gradients_is_update_then_apply_updates():
  state, loss_fn = linen_setup()

  @jax.jit
  def via_train_state(state):
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  @jax.jit
  def by_hand(params, opt_state):
    updates, opt_state = state.tx.update(jax.grad(loss_fn)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(3):  # from a state with momenta and a split key, not only the first step
    state = via_train_state(state)
  params, opt_state = by_hand(state.params, state.opt_state)
  state = via_train_state(state)
  assert_trees_equal(state.params, params)
  assert_trees_equal(state.opt_state, opt_state)


# flax.nnx


class NnxCNN(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.dense = nnx.Linear(8 * 8 * 4, 3, rngs=rngs)

  def __call__(self, x):
    x = jnp.tanh(self.conv(x))
    return self.dense(x.reshape(x.shape[0], -1))


# nnx.Optimizer initialises the transform on an nnx.State of Param variables
# and updates it with an nnx.State of plain arrays: a dict prefix does not match
# either (State is its own pytree node), an nnx.State prefix matches both.
NNX_CONSTRAINTS = nnx.State(
  {
    "conv": {"kernel": cola.Orthogonal(), "bias": None},
    "dense": {"kernel": cola.Circle(RADIUS), "bias": None},
  }
)


def nnx_constraints_by_path(params):
  """A callable spec; ``is_leaf`` stops at Variables (init) or arrays (update)."""

  def assign(path, _):
    layer, name = path[0].key, path[1].key
    if name != "kernel":
      return None
    return cola.Orthogonal() if layer == "conv" else cola.Circle(RADIUS)

  return jax.tree_util.tree_map_with_path(assign, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def nnx_setup(constraints=NNX_CONSTRAINTS):
  x, y = synthetic_data()
  model = NnxCNN(nnx.Rngs(1))
  params = nnx.state(model, nnx.Param)
  nnx.update(model, cola.project_params(nnx.as_pure(params), constraints))
  optimizer = nnx.Optimizer(model, cola_tx(constraints), wrt=nnx.Param)

  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  return model, optimizer, loss_fn


def nnx_residuals_ok(model, optimizer):
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  assert_on_manifold(params, nnx.as_pure(optimizer.opt_state))
  assert tall_gram_defect(params["conv"]["kernel"]) < 1e-5
  assert float(jnp.max(jnp.abs(params["dense"]["kernel"]))) <= np.float32(RADIUS)
  assert float(jnp.max(jnp.abs(params["dense"]["kernel"]))) > 0.99 * RADIUS  # the bound is active


@pytest.mark.parametrize(
  "constraints",
  [NNX_CONSTRAINTS, pytest.param(nnx_constraints_by_path, marks=pytest.mark.extended)],  # quick: the State prefix
  ids=["state_prefix", "callable"],
)
def test_nnx_optimizer_trains_on_the_manifold(constraints):
  model, optimizer, loss_fn = nnx_setup(constraints)
  assert tall_gram_defect(model.conv.kernel[...]) < 1e-5  # project_params took effect

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(STEPS)]
  final = float(loss_fn(model))
  assert final < 0.1 * losses[0], (losses[0], final)
  assert int(optimizer.step[...]) == STEPS
  assert int(optimizer.opt_state.count[...]) == STEPS
  nnx_residuals_ok(model, optimizer)


@pytest.mark.extended  # quick: test_linen_apply_gradients_is_update_then_apply_updates
def test_nnx_optimizer_update_is_update_then_apply_updates():
  model, optimizer, loss_fn = nnx_setup()

  @nnx.jit
  def train_step(model, optimizer):
    optimizer.update(model, nnx.grad(loss_fn)(model))

  for _ in range(3):
    train_step(model, optimizer)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  opt_state = nnx.as_pure(optimizer.opt_state)

  graphdef, _, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def by_hand(params, opt_state):
    def loss_of(p):
      return loss_fn(nnx.merge(graphdef, p, rest))

    updates, opt_state = optimizer.tx.update(jax.grad(loss_of)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  expected_params, expected_state = by_hand(params, opt_state)
  train_step(model, optimizer)
  assert_trees_equal(nnx.as_pure(nnx.state(model, nnx.Param)), expected_params)
  assert_trees_equal(nnx.as_pure(optimizer.opt_state), expected_state)
  nnx_residuals_ok(model, optimizer)


def test_a_dict_prefix_does_not_match_nnx_state():
  model = NnxCNN(nnx.Rngs(1))
  tx = cola_tx(
    {"conv": {"kernel": cola.Orthogonal(), "bias": None}, "dense": {"kernel": cola.Circle(RADIUS), "bias": None}}
  )
  with pytest.raises(ValueError, match="pytree prefix of the parameters"):
    nnx.Optimizer(model, tx, wrt=nnx.Param)
