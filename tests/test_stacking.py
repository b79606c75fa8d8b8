"""Same-shape leaves stepped together under vmap give the leaf-by-leaf result."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax import transforms


def deep_params(key):
  shapes = [(6, 12), (12, 12), (12, 12), (12, 12), (3, 3, 2, 12), (12, 12), (12, 4)]
  keys = jax.random.split(key, len(shapes))
  params = {
    f"layer{i}": jax.random.normal(k, s) / np.sqrt(np.prod(s[:-1])) for i, (k, s) in enumerate(zip(keys, shapes))
  }
  return cola.project_params(params, cola.Orthogonal())


def run(tx, params, steps=20):
  def loss(p, x):
    return sum(jnp.sum(jnp.sin(x * w)) for w in jax.tree.leaves(p))

  @jax.jit
  def step(carry, x):
    params, state = carry
    updates, state = tx.update(jax.grad(loss)(params, x), state, params)
    return (optax.apply_updates(params, updates), state), None

  xs = jax.random.normal(jax.random.key(7), (steps,))
  (params, state), _ = jax.lax.scan(step, (params, tx.init(params)), xs)
  return params, state


@pytest.mark.parametrize(
  "make",
  [
    pytest.param(
      lambda: cola.cola_od(0.05, constraints=cola.Orthogonal(), temperature=1e-3, key=jax.random.key(1)),
      id="od",
      marks=pytest.mark.slow,
    ),
    pytest.param(  # quick: test_axes.py::test_same_shape_leaves_stepped_together_equal_leaf_by_leaf (od)
      lambda: cola.cola_ud(0.1, friction=1.0, constraints=cola.Orthogonal(), temperature=1e-3, key=jax.random.key(1)),
      id="ud",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_stacked_equals_leaf_by_leaf(make, monkeypatch):
  params = deep_params(jax.random.key(0))
  monkeypatch.setattr(transforms, "_stacking_pays", lambda: True)  # as on an accelerator
  stacked_params, stacked_state = run(make(), params)
  monkeypatch.setattr(transforms, "_stacking_pays", lambda: False)  # as on CPU
  single_params, single_state = run(make(), params)
  for path, a, b in zip(
    jax.tree_util.tree_flatten_with_path(stacked_params)[0],
    jax.tree.leaves(single_params),
    jax.tree.leaves(stacked_params),
  ):
    np.testing.assert_allclose(a, b, atol=2e-6, err_msg=jax.tree_util.keystr(path[0]))
  np.testing.assert_array_equal(  # iteration counts and convergence flags, leaf by leaf
    np.array(jax.tree.leaves(single_state.constraint_states)),
    np.array(jax.tree.leaves(stacked_state.constraint_states)),
  )
  residuals = cola.constraint_residuals(stacked_params, stacked_state)
  assert max(float(r) for r in jax.tree.leaves(residuals)) <= 1e-5


def test_stacking_batches_the_projection_loops(monkeypatch):
  params = deep_params(jax.random.key(0))
  tx = cola.cola_od(0.05, constraints=cola.Orthogonal())
  grads = jax.tree.map(jnp.ones_like, params)

  def loops(stacking):
    monkeypatch.setattr(transforms, "_stacking_pays", lambda: stacking)
    jaxpr = jax.make_jaxpr(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
    return str(jaxpr).count(" while[")

  # Four loops per leaf (start check, the solver behind its root check, the
  # solver's own loop, polar fallback): 7 leaves alone, or the four (12, 12)
  # ones as one stacked group.
  assert loops(False) == 4 * 7 and loops(True) == 4 * 4
