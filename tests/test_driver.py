"""The driver under every transform: constraint states of any shape report their residuals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola


class CountedSphere(cola.Constraint):
  """``|w| = 1``, whose state is a bare array (no ``residual`` of its own): ``init`` returns what it likes."""

  def init(self, param):
    return jnp.zeros((), param.dtype)

  def project(self, anchor, step):
    moved = anchor + step
    return moved / jnp.linalg.norm(moved)

  def cotangent(self, point, vector):
    return vector - jnp.vdot(point, vector) * point

  def residual(self, param, aux):
    return jnp.abs(jnp.linalg.norm(param) - 1) + aux

  def __eq__(self, other):
    return isinstance(other, CountedSphere)

  def __hash__(self):
    return hash(CountedSphere)


TRANSFORMS = {
  "cola_od": lambda c: cola.cola_od(0.1, constraints=c),
  "cola_ud": lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, temperature=1e-3, key=jax.random.key(0)),
  "constrained_adam": lambda c: cola.constrained(optax.adam(1e-2), constraints=c),
}


@pytest.mark.parametrize(
  "name",
  ["cola_od", pytest.param("cola_ud", marks=pytest.mark.extended), "constrained_adam"],  # quick: cola_od, one driver
)
def test_a_state_without_residual_reports_through_its_constraint(name):
  """Before, constraint_residuals failed on a state that was not a ConstraintState naming its constraint."""
  params = {"w": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}
  tx = TRANSFORMS[name]({"w": CountedSphere(), "b": None})
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.update({"w": jnp.array([1.0, -1.0]), "b": jnp.ones(2)}, s, p))
  for _ in range(3):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  residuals = cola.constraint_residuals(params, state)
  assert residuals["b"] is None
  assert float(residuals["w"]) < 1e-6
  np.testing.assert_allclose(float(jnp.linalg.norm(params["w"])), 1.0, rtol=1e-6)
