"""A slack constraint written as docs/guides/custom_constraint.md says: a tuple point ``(x, s)``, no momentum methods.

The ball by slack, ``|x_j|^2 + s_j^2 = r^2`` for every row ``x_j`` of the leaf with one slack ``s_j`` per row
(shaped ``(rows, 1)``, not like the leaf): ``init``, ``point``, ``unpack`` and ``ambient_gradient`` beside the two
methods every constraint writes, and a residual. Every momentum default (``zero_momentum`` included) follows the
point's structure, so it passes ``check_constraint`` in float32 and float64, trains under ``cola_od``, ``cola_ud``
with noise and ``constrained(adam)`` with every row in the ball, samples the sphere's surface measure, and
``check_constraint`` names the method a broken slack constraint gets wrong. ``NonNegative``, a shipped slack
constraint, leaves a start below 0 (where no force reaches its slack) for a positive target.
"""

import dataclasses
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax import langevin
from cola_jax.testing import check_constraint

_TAN = math.sqrt(1 - 0.99**2) / 0.99  # a row at or beyond the bound starts at 0.99 r, as MaxNorm's


@dataclasses.dataclass(frozen=True)
class RowBall(cola.Constraint):
  """``|x_j| <= radius`` for every row ``x_j`` (last axis) of the leaf, as ``|x_j|^2 + s_j^2 = radius^2``."""

  radius: float = 1.0

  def init(self, param):
    squared = jnp.sum(param * param, axis=-1, keepdims=True)
    slack = jnp.sqrt(jnp.maximum(self.radius**2 - squared, _TAN**2 * squared))
    return cola.ConstraintState(slack=slack, constraint=self)

  def point(self, param, aux):
    return self.project((param, aux.slack), (jnp.zeros_like(param), jnp.zeros_like(aux.slack)))

  def unpack(self, point, param):
    x, s = point
    return x, cola.ConstraintState(slack=s, constraint=self)

  def ambient_gradient(self, point, grad):
    return grad, jnp.zeros_like(point[1])

  def project(self, anchor, step):
    x, s = anchor[0] + step[0], anchor[1] + step[1]
    scale = self.radius / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + s * s)
    return x * scale, s * scale

  def cotangent(self, point, vector):
    x, s = point
    radial = (jnp.sum(x * vector[0], axis=-1, keepdims=True) + s * vector[1]) / self.radius**2
    return vector[0] - radial * x, vector[1] - radial * s

  def residual(self, param, aux):
    squared = jnp.sum(param * param, axis=-1, keepdims=True) + aux.slack * aux.slack
    return jnp.max(jnp.abs(squared / self.radius**2 - 1))


BALL = RowBall(0.5)
TARGET = jnp.array([[0.3, -0.2, 0.1], [1.0, 1.0, -1.0], [0.0, 0.0, 0.0], [0.1, 0.1, 0.1]])  # row 1 outside


def test_the_momentum_defaults_follow_the_point():
  param = jnp.ones((4, 3))
  assert jax.tree.map(jnp.shape, BALL.zero_momentum(param)) == ((4, 3), (4, 1))
  point = BALL.point(param, BALL.init(param))
  noise = langevin.draw_noise(BALL, jax.random.key(0), point, "BAOAB")
  momentum = langevin.o_step(BALL, point, BALL.zero_momentum(param), 0.5, 1.0, noise)
  x, s = BALL.momentum_vector(point, momentum)
  radial = jnp.sum(x * point[0], axis=-1) + s[:, 0] * point[1][:, 0]
  np.testing.assert_allclose(radial, 0.0, atol=1e-6)  # the O step's momentum is tangent, row by row


# Extended; quick: test_a_state_of_any_pytree_reaches_constraint_residuals (the ball, its state a dict).
@pytest.mark.parametrize(
  "dtype", [pytest.param(jnp.float32, marks=pytest.mark.extended), pytest.param(jnp.float64, marks=pytest.mark.slow)]
)
def test_a_slack_constraint_with_a_tuple_point_conforms(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    check_constraint(BALL, (4, 3), dtype=dtype)


def _train(tx, steps=400):
  loss = lambda p: 0.5 * jnp.sum((p["w"] - TARGET) ** 2)
  params = {"w": jnp.zeros((4, 3))}

  def step(carry, _):
    params, state = carry
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, state), _ = jax.jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), length=steps))(params)
  return params["w"], cola.constraint_residuals(params, state)["w"]


@pytest.mark.parametrize(
  "tx",
  [
    cola.cola_od(0.05, constraints=BALL),
    pytest.param(
      cola.cola_ud(0.1, friction=1.0, temperature=1e-7, key=jax.random.key(1), constraints=BALL),
      marks=pytest.mark.extended,  # quick: test_a_state_of_any_pytree_reaches_constraint_residuals trains with cola_ud
    ),
    pytest.param(cola.constrained(optax.adam(2e-2), constraints=BALL), marks=pytest.mark.extended),
  ],
  ids=["cola_od", "cola_ud", "constrained_adam"],
)
def test_a_slack_constraint_trains_to_the_nearest_point_of_the_ball(tx):
  w, residual = _train(tx)
  norms = np.linalg.norm(np.asarray(TARGET), axis=-1, keepdims=True)
  nearest = np.asarray(TARGET) * np.minimum(1, 0.5 / norms.clip(1e-30))
  np.testing.assert_allclose(w, nearest, atol=3e-3)
  assert float(residual) <= 2 * (16 + 2) * float(jnp.finfo(jnp.float32).eps)  # every row on its sphere, to rounding


class NoGradient(RowBall):
  ambient_gradient = cola.Constraint.ambient_gradient  # the default: the gradient itself, not shaped like (x, s)


class RaisesInProject(RowBall):
  def project(self, anchor, step):
    return super().project(anchor, (step[0], step[1].reshape(3, 4)))  # a raw JAX error (TypeError) inside project


class DictState(RowBall):
  """Its state a dict, not a ConstraintState: the transforms keep it beside the constraint."""

  def init(self, param):
    return {"slack": super().init(param).slack}

  def point(self, param, aux):
    return super().point(param, cola.ConstraintState(slack=aux["slack"], constraint=self))

  def unpack(self, point, param):
    return point[0], {"slack": point[1]}

  def residual(self, param, aux):
    return super().residual(param, cola.ConstraintState(slack=aux["slack"], constraint=self))


class BrokenStateResidual(NamedTuple):
  slack: jax.Array

  def residual(self):  # constraint_residuals calls residual(param)
    return jnp.zeros(())


class StateWithBrokenResidual(RowBall):
  def init(self, param):
    return BrokenStateResidual(super().init(param).slack)

  def point(self, param, aux):
    return super().point(param, cola.ConstraintState(slack=aux.slack, constraint=self))

  def unpack(self, point, param):
    return point[0], BrokenStateResidual(point[1])

  def residual(self, param, aux):
    return super().residual(param, cola.ConstraintState(slack=aux.slack, constraint=self))


def test_a_state_of_any_pytree_reaches_constraint_residuals():
  check_constraint(DictState(0.5), (4, 3))
  _, residual = _train(cola.cola_ud(0.1, friction=1.0, constraints=DictState(0.5)))
  assert float(residual) <= 2 * (16 + 2) * float(jnp.finfo(jnp.float32).eps)


@pytest.mark.parametrize(
  ("constraint", "message"),
  [
    (NoGradient(0.5), r"protocol shapes: ambient_gradient raised: TypeError: .*override ambient_gradient"),
    (RaisesInProject(0.5), r"protocol shapes: project raised \(called by point\): TypeError: cannot reshape"),
    pytest.param(
      StateWithBrokenResidual(0.5),
      r"invariant measure \(smoke\): .*state's residual\(param\) .*TypeError: BrokenStateResidual.residual\(\) takes",
      marks=pytest.mark.extended,  # quick: the methods named in the two cases above
    ),
  ],
  ids=["ambient_gradient", "project", "state"],
)
def test_check_constraint_names_the_method_at_fault(constraint, message):
  with pytest.raises(AssertionError, match=message):
    check_constraint(constraint, (4, 3))


class DefaultResidual(RowBall):
  residual = cola.Constraint.residual


@pytest.mark.extended  # check_constraint's other checks stay quick
def test_check_constraint_says_when_the_residual_is_the_default():
  with pytest.warns(UserWarning, match="keeps the default residual"):
    check_constraint(DefaultResidual(0.5), (4, 3))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    check_constraint(BALL, (2, 3))  # its own residual: no warning


@pytest.mark.parametrize(
  "tx",
  [
    cola.constrained(optax.adam(5e-2), constraints=cola.NonNegative()),
    pytest.param(cola.cola_ud(0.1, friction=1.0, constraints=cola.NonNegative()), marks=pytest.mark.extended),
  ],
  ids=["constrained_adam", "cola_ud"],
)
def test_non_negative_leaves_a_start_below_zero_for_a_positive_target(tx):
  """At ``w = 0`` the slack is 0 and no force reaches it: the negative entries start where one does."""
  target = jnp.array([1.0, 2.0, 0.5])
  loss = lambda w: 0.5 * jnp.sum((w - target) ** 2)

  def step(carry, _):
    w, state = carry
    updates, state = tx.update(jax.grad(loss)(w), state, w)
    return (optax.apply_updates(w, updates), state), None

  start = jnp.array([-1.0, 2.0, -0.3])
  (w, state), _ = jax.jit(lambda w: jax.lax.scan(step, (w, tx.init(w)), length=300))(start)
  np.testing.assert_allclose(w, target, atol=1e-3)
  assert float(cola.constraint_residuals(w, state)) <= 1e-6


def _share_within_half_radius(rows: int, steps: int) -> float:
  """P(|x| < r / 2) over a noisy run without a loss, one chain per row of a (rows, 1) leaf."""
  tx = cola.cola_ud(0.1, friction=1.0, temperature=1.0, key=jax.random.key(4), constraints=BALL, splitting="BAOAB")

  def step(carry, _):
    w, state = carry
    updates, state = tx.update(jnp.zeros_like(w), state, w)
    return (w + updates, state), w[:, 0]

  start = jnp.zeros((rows, 1))
  _, xs = jax.jit(lambda w: jax.lax.scan(step, (w, tx.init(w)), length=steps))(start)
  later = np.asarray(xs[steps // 5 :: 10])  # after a burn-in, one sample per unit of time
  return float(np.mean(np.abs(later) < 0.25))


@pytest.mark.parametrize(
  ("rows", "steps", "within"), [(500, 600, 0.03), pytest.param(4000, 1500, 0.01, marks=pytest.mark.slow)]
)
def test_the_tuple_point_samples_the_sphere_s_surface_measure(rows, steps, within):
  """Without a loss (x, s) is uniform on the circle of radius r: x has the arcsine law, P(|x| < r / 2) = 1/3."""
  assert abs(_share_within_half_radius(rows, steps) - 1 / 3) < within
