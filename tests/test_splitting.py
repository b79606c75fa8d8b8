"""The BAOAB splitting of the underdamped transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

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


@pytest.mark.parametrize(
  "constraints", [cola.circle_constraints(0.1), cola.orthogonal_constraints()], ids=["circle", "orthogonal"]
)
def test_baoab_keeps_the_constraints(constraints, mlp_problem):
  params, loss = mlp_problem
  tx = cola.cola_ud(
    0.1, friction=1.0, constraints=constraints, temperature=1e-5, key=jax.random.key(0), splitting="BAOAB"
  )

  def step(carry, i):
    p, s = carry
    updates, s = tx.update(jax.grad(loss)(p, i), s, p)
    return (optax.apply_updates(p, updates), s), None

  (params, state), _ = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(300)))((params, tx.init(params)))
  assert max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(params, state))) <= 1e-5


def test_unknown_splitting_is_an_error():
  with pytest.raises(ValueError, match="splitting"):
    cola.cola_ud(0.1, friction=1.0, splitting="ABO")
