"""The splittings of the underdamped transforms: BAOAB, OBA, and any scheme of A, B and O steps."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended

import cola_jax as cola
from cola_jax import langevin
from cola_jax.constraints import Euclidean

# The presets' default choice of leaves is used on purpose here (the layers' kernels, biases free); that choice
# and the warning naming it are tested in test_validation.
pytestmark = pytest.mark.filterwarnings("ignore:.*not told which leaves to constrain:UserWarning")

# A quadratic potential V = k/2 (theta - c)^2 on the circle |theta| <= r.
R, TAU, K, C = 0.5, 0.25, 4.0, 0.25


def exact_mean():
  """E[theta] under exp(-V/tau) on the circle: a smooth periodic integral in the angle."""
  angle = np.linspace(0, 2 * np.pi, 10_000, endpoint=False)
  theta = R * np.cos(angle)
  weight = np.exp(-K / 2 * (theta - C) ** 2 / TAU)
  return np.sum(theta * weight) / np.sum(weight)


def sampled_mean(splitting, h, gamma, *, chains=100_000, burn_in=400, kept=400):
  """Mean of theta over independent chains and the kept steps, and its standard error."""
  tx = cola.cola_ud(
    h, friction=gamma, constraints=cola.Circle(R), temperature=TAU, key=jax.random.key(0), splitting=splitting
  )

  def step(carry, _):
    theta, state = carry
    updates, state = tx.update(K * (theta - C), state, theta)
    theta = optax.apply_updates(theta, updates)
    return (theta, state), jnp.mean(theta)

  theta = jnp.zeros(chains)
  _, means = jax.jit(lambda c: jax.lax.scan(step, c, None, length=burn_in + kept))((theta, tx.init(theta)))
  blocks = np.asarray(means)[burn_in:].reshape(8, -1).mean(axis=1)  # 8 blocks of 50 time units / 8
  return blocks.mean(), blocks.std(ddof=1) / np.sqrt(len(blocks))


@pytest.mark.slow  # a long run: the quick suite keeps within its time
def test_baoab_samples_configurations_more_accurately_than_oba():
  # h = 0.2, gamma = 2: OBA's bias in E[theta] is linear in gamma h (measured +0.0118);
  # BAOAB's is below the sampling error (measured 6e-5, standard error 8e-5).
  exact = exact_mean()
  oba, oba_se = sampled_mean("OBA", 0.2, 2.0)
  baoab, baoab_se = sampled_mean("BAOAB", 0.2, 2.0)
  assert abs(oba - exact) > 20 * oba_se  # the test has power: OBA's bias is visible
  assert abs(baoab - exact) < 5 * baoab_se
  assert abs(baoab - exact) < abs(oba - exact) / 10


def test_baoab_without_noise_or_friction_is_velocity_verlet():
  # gamma = 0, tau = 0, no constraint: B(h/2) A(h) B(h/2), i.e. velocity Verlet.
  h, omega2 = 0.1, 3.0
  tx = cola.cola_ud(h, friction=0.0, splitting="BAOAB")
  q = jnp.array([1.0, -0.5])
  state = tx.init(q)
  q_ref, p_ref = np.array([1.0, -0.5]), np.zeros(2)
  for _ in range(20):
    updates, state = tx.update(omega2 * q, state, q)
    q = optax.apply_updates(q, updates)
    p_half = p_ref - h / 2 * omega2 * q_ref
    q_ref = q_ref + h * p_half
    p_ref = p_half - h / 2 * omega2 * q_ref
  np.testing.assert_allclose(q, q_ref, rtol=1e-5)
  # The stored momentum is the one before the closing half kick.
  np.testing.assert_allclose(state.momentum - h / 2 * omega2 * q, p_ref, rtol=1e-4, atol=1e-6)


SPLITTINGS = {"BAOAB": "BAOAB", "OBABO": cola.Splitting("OBABO")}
MLP_CONSTRAINTS = {"circle": cola.circle_constraints(0.1), "orthogonal": cola.orthogonal_constraints()}


@pytest.mark.parametrize(
  "constraint_name, splitting_name",
  quick_or_extended(  # quick: the circle; with the extended tier each splitting and each constraint once
    [(c, s) for c in MLP_CONSTRAINTS for s in SPLITTINGS],
    {("circle", "BAOAB")},
    ids=lambda c, s: f"{c}-{s}",
    extended={("orthogonal", "OBABO")},
  ),
)
def test_splittings_keep_the_constraints(constraint_name, splitting_name, mlp_problem):
  params, loss = mlp_problem
  constraints, splitting = MLP_CONSTRAINTS[constraint_name], SPLITTINGS[splitting_name]
  tx = cola.cola_ud(
    0.1, friction=1.0, constraints=constraints, temperature=1e-5, key=jax.random.key(0), splitting=splitting
  )

  def step(carry, i):
    p, s = carry
    updates, s = tx.update(jax.grad(loss)(p, i), s, p)
    return (optax.apply_updates(p, updates), s), None

  (params, state), _ = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(300)))((params, tx.init(params)))
  assert max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(params, state))) <= 1e-5


def test_unknown_splitting_is_an_error():
  with pytest.raises(ValueError, match="splitting must be one of .'OBA', 'BAOAB'. or a cola.Splitting"):
    cola.cola_ud(0.1, friction=1.0, splitting="ABO")


@pytest.mark.parametrize(
  ("steps", "message"),
  [
    ("OBAX", "steps are A, B or O"),
    ("ABOAB", "every B step must come before the first A step or after the last one"),
    ([("O", 1.0), ("B", 0.5), ("A", 1.0)], "the fractions of the B steps must sum to 1"),
    ("OB", "the fractions of the A steps must sum to 1"),
    ([("O", 1.0), ("B", 1.0), ("A", 0.0), ("A", 1.0)], "the fraction of every step must be positive"),
    ([("O",)], "the steps must be a string of A, B, O or .letter, fraction. pairs"),
  ],
)
def test_a_splitting_that_is_no_step_is_an_error_naming_splitting(steps, message):
  with pytest.raises(ValueError, match=f"splitting: {message}"):
    cola.Splitting(steps)


def stationary_covariance(splitting: cola.Splitting, h: float, omega2: float, gamma: float, tau: float):
  """The stationary covariance of ``(q, p)`` between calls of ``splitting`` on ``V = omega2 q^2 / 2``, exactly.

  One call is affine, ``x <- M x + N r`` with ``r`` its standard normal draws: ``M`` and ``N`` are the
  Jacobian of the library's step, and the covariance solves ``S = M S M^T + N N^T``. Returned with the
  condition number of that linear system (which bounds how its rounding grows).
  """
  draws = splitting.draws

  def call(x):
    q, p, r = x[0], x[1], x[2:]
    noises = tuple(r[j] for j in range(draws))
    q, p = splitting.step(Euclidean(), q, p, omega2 * q, h, jnp.exp(-gamma * h), temperature=tau, noises=noises)
    return jnp.stack([q, p])

  jacobian = np.asarray(jax.jacobian(call)(jnp.zeros(2 + draws, jnp.float64)))
  m, n = jacobian[:, :2], jacobian[:, 2:]
  system = np.eye(4) - np.kron(m, m)
  return np.linalg.solve(system, (n @ n.T).reshape(-1)).reshape(2, 2), np.linalg.cond(system)


@pytest.mark.skipif(not hasattr(jax, "enable_x64"), reason="the jax.enable_x64 context manager needs jax >= 0.8")
@pytest.mark.parametrize("h", [0.4, 0.2, 0.1])
def test_obabo_agrees_with_baoab_to_second_order_on_a_gaussian(h):
  # On V = omega^2 q^2 / 2, BAOAB samples q exactly (variance tau / omega^2 at every h < 2 / omega) and
  # OBABO with the error (h omega / 2)^2 / (1 - (h omega / 2)^2): the two agree to second order in h.
  omega2, gamma, tau = 2.0, 1.0, 0.5
  with jax.enable_x64(True):
    baoab, baoab_cond = stationary_covariance(cola.Splitting("BAOAB"), h, omega2, gamma, tau)
    obabo, obabo_cond = stationary_covariance(cola.Splitting("OBABO"), h, omega2, gamma, tau)
  exact = tau / omega2
  half_step2 = h * h * omega2 / 4
  tolerance = 64 * max(baoab_cond, obabo_cond) * np.finfo(np.float64).eps / 2  # the solve's rounding, grown
  np.testing.assert_allclose(baoab[0, 0], exact, rtol=tolerance)
  np.testing.assert_allclose(obabo[0, 0], exact / (1 - half_step2), rtol=tolerance)
  assert obabo[0, 0] / baoab[0, 0] - 1 <= 2 * half_step2  # second order: O(h^2) as h -> 0


@pytest.mark.parametrize(  # quick: the circle with first=True; the other cases extended
  "constraint",
  [cola.Circle(1.0), pytest.param(cola.Orthogonal(), marks=pytest.mark.extended)],
  ids=["circle", "orthogonal"],
)  # noise drawn in cotangent coordinates; noise projected with the force
@pytest.mark.parametrize("first", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_the_named_splittings_are_the_reference_steps_bit_for_bit(constraint, first):
  w = jax.random.normal(jax.random.key(1), (4, 3)) * 0.3
  w = constraint.nearest(w)
  grad = jax.random.normal(jax.random.key(2), w.shape)
  key, h, decay, tau = jax.random.key(3), 0.1, jnp.exp(-0.1), 1e-2
  scale = jnp.sqrt(tau * (1 - decay * decay))

  @jax.jit
  def steps(w):
    point = constraint.point(w, constraint.init(w))
    momentum = constraint.load_momentum(constraint.zero_momentum(w) + 0.1)
    oba, baoab = cola.Splitting("OBA"), cola.Splitting("BAOAB")
    kick = jnp.where(first, h / 2, h)
    return (
      oba.step(constraint, point, momentum, grad, h, decay, temperature=tau, noises=oba.draw(constraint, key, point)),
      langevin.oba_step(
        constraint, point, momentum, grad, h, decay, scale, langevin.draw_noise(constraint, key, point, "OBA")
      ),
      baoab.step(
        constraint,
        point,
        momentum,
        grad,
        h,
        decay,
        first=first,
        temperature=tau,
        noises=baoab.draw(constraint, key, point),
      ),
      langevin.baoab_step(
        constraint, point, momentum, grad, h, kick, decay, scale, langevin.draw_noise(constraint, key, point, "BAOAB")
      ),
    )

  oba, oba_reference, baoab, baoab_reference = steps(w)
  for got, want in [(oba, oba_reference), (baoab, baoab_reference)]:
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_splitting_of_several_o_steps_draws_each_from_its_own_key():
  point, key = jnp.zeros(1000), jax.random.key(0)
  draws = cola.Splitting("OBABO").draw(Euclidean(), key, point)
  wants = [Euclidean().cotangent_draw(k, point) for k in jax.random.split(key, 2)]
  assert len(draws) == 2
  for draw, want in zip(draws, wants):
    np.testing.assert_array_equal(draw, want)
  assert abs(float(jnp.corrcoef(draws[0], draws[1])[0, 1])) < 5 / np.sqrt(point.size)  # independent


def test_a_users_scheme_needs_no_library_edit():
  # Velocity Verlet then friction, B(h/2) A(h) B(h/2) O(h), from (letter, fraction) pairs: at tau = 0 on a
  # free leaf, the positions are those of the recursion written out.
  h, gamma, omega2 = 0.1, 0.5, 3.0
  scheme = cola.Splitting([("B", 0.5), ("A", 1.0), ("B", 0.5), ("O", 1.0)])
  tx = cola.cola_ud(h, friction=gamma, splitting=scheme)
  q: Any = jnp.array([1.0, -0.5])
  state = tx.init(q)
  q_ref, p_ref = np.array([1.0, -0.5]), np.zeros(2)
  for _ in range(20):
    updates, state = tx.update(omega2 * q, state, q)
    q = optax.apply_updates(q, updates)
    p_half = p_ref - h / 2 * omega2 * q_ref
    q_ref = q_ref + h * p_half
    p_ref = np.exp(-gamma * h) * (p_half - h / 2 * omega2 * q_ref)
  np.testing.assert_allclose(q, q_ref, rtol=1e-5)
