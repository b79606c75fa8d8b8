"""``cola.constrained`` on an Equinox model: arrays filtered by ``eqx.is_array``, constraints by path rules.

Equinox stores a Linear's weight as ``(out, in)``: a unit's incoming weights are
a row, and per-unit constraints without ``axis`` read them so where the tree
shows the ``eqx.nn.Linear`` that holds the weight; a bare array is read as
Flax's ``(in, out)`` kernel, a column per unit, with a warning.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

eqx = pytest.importorskip("equinox")


def test_per_unit_constraints_read_an_equinox_weight_by_rows():
  linear = eqx.filter(eqx.nn.Linear(5, 3, use_bias=False, key=jax.random.key(0)), eqx.is_array)  # (out, in) = (3, 5)
  rows = cola.project_params(linear, cola.UnitNorm()).weight  # in its Linear: one norm per output unit
  np.testing.assert_allclose(jnp.linalg.norm(rows, axis=1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(rows, cola.project_params(linear.weight, cola.UnitNorm(axis=-1)))
  with pytest.warns(UserWarning, match=r"of shape \(3, 5\): a matrix in no layer whose layout is known"):
    columns = cola.project_params(linear.weight, cola.UnitNorm())  # a bare array: the Flax reading, each input
  np.testing.assert_allclose(jnp.linalg.norm(columns, axis=0), 1.0, rtol=1e-6)
  assert not np.allclose(jnp.linalg.norm(columns, axis=1), 1.0)


@pytest.mark.extended  # quick: the next test updates an Equinox MLP; path rules in test_declared_constraints.py
def test_mlp_trains_on_the_manifolds_chosen_by_equinox_paths():
  model = eqx.nn.MLP(4, 2, 8, 2, activation=jnp.tanh, key=jax.random.key(1))
  params, static = eqx.partition(model, eqx.is_array)
  rules = cola.path_constraints(
    [
      (r"layers/0/weight$", cola.UnitNorm(axis=-1)),
      (r"layers/1/weight$", cola.Orthogonal()),
      (r"bias$", None),
    ]
  )
  params = cola.project_params(params, rules)
  x = jax.random.normal(jax.random.key(2), (32, 4))
  y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)

  def loss(params):
    return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)

  tx = cola.constrained(optax.adam(0.02), constraints=rules)
  state = tx.init(params)

  @eqx.filter_jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return eqx.apply_updates(params, updates), state

  start_loss = float(loss(params))
  for _ in range(60):
    params, state = step(params, state)
  assert float(loss(params)) < 0.5 * start_loss
  first, second = params.layers[0].weight, params.layers[1].weight
  np.testing.assert_allclose(jnp.linalg.norm(first, axis=-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(second.T @ second, jnp.eye(8), atol=1e-6)
  residuals = cola.constraint_residuals(params, state)
  assert residuals.layers[2].weight is None  # the last layer's weight is free
  assert max(float(r) for r in jax.tree.leaves(residuals)) <= 1e-6


def test_a_mask_or_radius_tree_built_over_an_equinox_model_is_read_as_a_tree():
  """Such a tree is an Equinox module, hence callable: it used to be called with the parameters as a function."""
  model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(3))
  params, _ = eqx.partition(model, eqx.is_array)
  mask = jax.tree.map(lambda x: x.ndim == 2, params)
  assert callable(mask)
  radius = jax.tree.map(lambda x: 0.05 if x.ndim == 2 else None, params)
  for tx in (
    cola.o_cola_od(0.1, mask=mask),
    cola.c_cola_od(0.1, radius=radius),
    cola.c_cola_od(0.1, radius=0.05, mask=mask),
  ):
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
    residuals = cola.constraint_residuals(eqx.apply_updates(params, updates), state)
    assert [(layer.weight is None, layer.bias is None) for layer in residuals.layers] == [(False, True)] * 3
    # params + updates rounds at the scale of the old weights (up to ~0.5, beyond the bound 0.05): a few ulps / r.
    assert max(float(r) for r in jax.tree.leaves(residuals)) <= 4e-6
