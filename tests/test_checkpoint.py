"""Saving and restoring CoLA optimizer states with orbax.

The whole state (PRNG key, slack variables, momenta, counters, ProjectionInfo)
goes through ``orbax.checkpoint.StandardCheckpointer``; a run stopped and
resumed equals the uninterrupted run bit for bit. orbax (0.12.8 here) writes
typed PRNG keys (``jax.random.key``) directly, with their implementation;
``jax.random.key_data`` / ``jax.random.wrap_key_data`` is the portable recipe
for checkpointers that do not, and is tested too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

# The presets' default choice of leaves is used on purpose here (the layers' kernels, biases free); that choice
# and the warning naming it are tested in test_validation.
pytestmark = pytest.mark.filterwarnings("ignore:.*not told which leaves to constrain:UserWarning")

ocp = pytest.importorskip("orbax.checkpoint")

STOP, TOTAL = 4, 9

TRANSFORMS = {
  "c_cola_ud": lambda: cola.c_cola_ud(0.3, friction=1.0, radius=0.3, temperature=1e-3, key=jax.random.key(1)),
  "o_cola_ud": lambda: cola.o_cola_ud(0.1, friction=1.0, temperature=1e-4, key=jax.random.key(2)),
  # free=: Adam's moments for the biases, optax.MaskedNode where the momenta and the moments have no leaf.
  "c_cola_ud_free_adam": lambda: cola.c_cola_ud(
    0.3, friction=1.0, radius=0.3, temperature=1e-3, key=jax.random.key(1), free=optax.adam(1e-2)
  ),
  # A chain inside inject_hyperparams: nested states, a schedule, no key (tau = 0).
  "chained_c_cola_od": lambda: optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(cola.c_cola_od)(learning_rate=optax.exponential_decay(0.1, 3, 0.5), radius=0.3),
  ),
}


def is_key(x):
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert is_key(x) == is_key(y)
    if is_key(x):
      assert jax.random.key_impl(x) == jax.random.key_impl(y)
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def make_step(tx, loss):

  @jax.jit
  def step(params, state, i):
    updates, state = tx.update(jax.grad(loss)(params, i), state, params)
    return optax.apply_updates(params, updates), state

  return step


def train(step, params, state, start, stop):
  for i in range(start, stop):
    params, state = step(params, state, i)
  return params, state


def save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  checkpointer.close()


def restore(path, like):
  """Restores into the structure (NamedTuples, key types) of ``like``."""
  checkpointer = ocp.StandardCheckpointer()
  restored = checkpointer.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
  checkpointer.close()
  return restored


# Quick: the chain, nested states; test_restored_state_keeps_every_part restores cola_ud's ProjectionInfo and
# momenta. Extended: free=, and the key-data recipe resumes c_cola_ud. The plain presets under slow.
RESUMED_MARKS = {
  "c_cola_ud": pytest.mark.slow,
  "o_cola_ud": pytest.mark.slow,
  "c_cola_ud_free_adam": pytest.mark.extended,
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=RESUMED_MARKS.get(name, ())) for name in sorted(TRANSFORMS)])
def test_stopped_and_resumed_run_equals_the_uninterrupted_run(name, mlp_problem, tmp_path):
  params, loss = mlp_problem
  tx = TRANSFORMS[name]()
  step = make_step(tx, loss)
  uninterrupted = train(step, params, tx.init(params), 0, TOTAL)

  stopped = train(step, params, tx.init(params), 0, STOP)
  save(tmp_path / "checkpoint", {"params": stopped[0], "opt_state": stopped[1]})
  # A fresh process would rebuild the transform and its initial state for the structure.
  fresh_tx = TRANSFORMS[name]()
  like = {"params": params, "opt_state": fresh_tx.init(params)}
  restored = restore(tmp_path / "checkpoint", like)
  assert_trees_equal(restored["params"], stopped[0])
  assert_trees_equal(restored["opt_state"], stopped[1])

  resumed = train(make_step(fresh_tx, loss), restored["params"], restored["opt_state"], STOP, TOTAL)
  assert_trees_equal(resumed[0], uninterrupted[0])
  assert_trees_equal(resumed[1], uninterrupted[1])
  residuals = cola.constraint_residuals(*resumed)
  assert max(float(r) for r in jax.tree.leaves(residuals)) <= 1e-5


def test_restored_state_keeps_every_part(mlp_problem, tmp_path):
  params, loss = mlp_problem
  tx = cola.cola_ud(
    0.1,
    friction=1.0,
    temperature=1e-4,
    key=jax.random.key(7, impl="rbg"),
    constraints={
      "layer0": {"w": cola.Circle(0.3), "b": None},
      "layer1": {"w": cola.Orthogonal(), "b": None},
      "layer2": None,
    },
  )
  params, state = train(make_step(tx, loss), params, tx.init(params), 0, 3)
  save(tmp_path / "state", state)
  restored = restore(tmp_path / "state", tx.init(params))
  assert_trees_equal(restored, state)
  assert isinstance(restored, cola.UnderdampedState)
  assert jax.random.key_impl(restored.key) == jax.random.key_impl(jax.random.key(0, impl="rbg"))
  assert int(restored.count) == 3
  circle = restored.constraint_states["layer0"]["w"]
  assert isinstance(circle, cola.CircleState) and float(circle.radius) == pytest.approx(0.3)
  info = restored.constraint_states["layer1"]["w"]
  assert isinstance(info, cola.ProjectionInfo) and info.converged.dtype == jnp.bool_
  assert int(info.iterations) == int(state.constraint_states["layer1"]["w"].iterations)
  assert restored.constraint_states["layer2"]["w"] is None
  assert float(jnp.max(jnp.abs(restored.momentum["layer2"]["w"]))) > 0


@pytest.mark.extended  # quick: typed keys through orbax in test_stopped_and_resumed_run_equals_the_uninterrupted_run
def test_key_data_recipe_for_checkpointers_without_typed_keys(mlp_problem, tmp_path):
  params, loss = mlp_problem
  tx = TRANSFORMS["c_cola_ud"]()
  step = make_step(tx, loss)
  uninterrupted = train(step, params, tx.init(params), 0, TOTAL)
  params_n, state_n = train(step, params, tx.init(params), 0, STOP)

  raw = state_n._replace(key=jax.random.key_data(state_n.key))  # uint32[2]
  save(tmp_path / "raw", raw)
  restored = restore(tmp_path / "raw", raw)
  assert restored.key.dtype == jnp.uint32
  restored = restored._replace(key=jax.random.wrap_key_data(restored.key))
  resumed = train(step, params_n, restored, STOP, TOTAL)
  assert_trees_equal(resumed[0], uninterrupted[0])
  assert_trees_equal(resumed[1], uninterrupted[1])


def test_checkpoint_of_another_transform_is_refused(mlp_problem, tmp_path):
  params, _ = mlp_problem
  o_tx = TRANSFORMS["o_cola_ud"]()
  c_tx = TRANSFORMS["c_cola_ud"]()
  save(tmp_path / "o_state", o_tx.init(params))
  # Restored into the other transform's structure: orbax refuses, naming the leaves.
  with pytest.raises(ValueError, match=r"(?s)do not match.*constraint_states\.layer0\.w\.slack"):
    restore(tmp_path / "o_state", c_tx.init(params))
  # Restored as what it is and handed to the other transform: the first update
  # names the leaf and the mismatch.
  o_state = restore(tmp_path / "o_state", o_tx.init(params))
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"\['layer0'\]\['w'\].*does not match its constraint Circle.*ProjectionInfo"):
    c_tx.update(grads, o_state, params)


def test_state_restored_without_a_target_gives_a_clear_error(mlp_problem, tmp_path):
  params, _ = mlp_problem
  tx = TRANSFORMS["c_cola_ud"]()
  save(tmp_path / "state", tx.init(params))
  checkpointer = ocp.StandardCheckpointer()
  as_dicts = checkpointer.restore(tmp_path / "state")
  checkpointer.close()
  assert isinstance(as_dicts, dict) and set(as_dicts) == {"count", "key", "constraint_states", "momentum", "free_state"}
  with pytest.raises(TypeError, match="UnderdampedState"):
    tx.update(jax.tree.map(jnp.zeros_like, params), as_dicts, params)
