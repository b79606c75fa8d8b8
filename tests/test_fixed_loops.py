"""Loops without host round trips: ``loop="fixed"`` gives the ``"while"`` form's results.

On a GPU or TPU the host reads the test of every ``while`` iteration; the
fixed form runs each loop for its bound with the iterations after convergence
masked. Both forms run here on CPU and must agree: the same point, iteration
counts and flags, for steps that converge, steps that run out of iterations
and steps that have no root. The fixed form's program must hold no ``while``. (Off CPU, c-CoLA's exact-angle
gate is a select: tested here with the backend faked.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax import langevin
from cola_jax.constraints import stiefel_projection
from cola_jax.constraints.orthogonal import StiefelPoint, gram_defect, tall_view

SOLVERS = ("quasi_newton", "newton", "square_root")
SIZES = (0.05, 0.5, 0.95, 3.0)  # spectral norm of the tangential step: fast, slow, stalls, no root


def _start_and_steps(shape):
  q_n = tall_view(cola.Orthogonal().nearest(jax.random.normal(jax.random.key(0), shape)))
  a = jax.random.normal(jax.random.key(1), (q_n.shape[1],) * 2)
  a = (a - a.T) / jnp.linalg.norm(a - a.T, 2)
  normal = 0.01 * jax.random.normal(jax.random.key(2), q_n.shape)
  return q_n, jnp.stack([s * q_n @ a + normal for s in SIZES])


@functools.partial(jax.jit, static_argnums=0)
def _a_steps(constraint, q_n, steps):
  point = StiefelPoint(q_n, constraint.init(q_n))
  return jax.vmap(lambda step: langevin.a_step(constraint, point, step, 1.0))(steps)


def _has_while(fn, *args):
  return "while[" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize(
  "solver", [pytest.param(s, marks=() if s == "quasi_newton" else pytest.mark.slow) for s in SOLVERS]
)
@pytest.mark.parametrize(  # quick: the square leaf
  "shape", [(24, 24), pytest.param((40, 16), marks=pytest.mark.extended)], ids=["square", "tall"]
)
def test_fixed_loops_reach_the_while_loops_point_iterations_and_flag(solver, shape):
  q_n, steps = _start_and_steps(shape)
  (while_point, while_p), (fixed_point, fixed_p) = (
    _a_steps(cola.Orthogonal(projection=solver, loop=loop), q_n, steps) for loop in ("while", "fixed")
  )
  np.testing.assert_array_equal(fixed_point.info.iterations, while_point.info.iterations)
  np.testing.assert_array_equal(fixed_point.info.converged, while_point.info.converged)
  np.testing.assert_allclose(fixed_point.matrix, while_point.matrix, rtol=0, atol=2e-6)
  np.testing.assert_allclose(fixed_p, while_p, rtol=0, atol=2e-5)
  # The sweep covers every case the loops end in.
  assert bool(while_point.info.converged[0]) and not bool(while_point.info.converged[-1])
  assert int(while_point.info.iterations[-1]) == 0  # no root: detected before iterating
  assert 0 < int(while_point.info.iterations[0]) <= int(while_point.info.iterations[1])


@pytest.mark.extended  # quick: test_fixed_loops_reach_the_while_loops_point_iterations_and_flag (a step that stalls)
def test_a_stalled_projection_ends_at_the_same_polar_factor_in_both_forms():
  q_n, steps = _start_and_steps((24, 24))
  (while_point, _), (fixed_point, _) = (
    _a_steps(cola.Orthogonal(max_iterations=2, loop=loop), q_n, steps[1:2]) for loop in ("while", "fixed")
  )
  assert not bool(while_point.info.converged[0])
  np.testing.assert_allclose(fixed_point.matrix, while_point.matrix, rtol=0, atol=2e-6)
  assert np.abs(np.asarray(gram_defect(fixed_point.matrix[0]))).max() < 1e-5


@pytest.mark.parametrize("loop, has_while", [("while", True), ("fixed", False)])
def test_the_fixed_form_has_no_while_loop_in_the_step(loop, has_while):
  params = {"w": cola.Orthogonal().nearest(jax.random.normal(jax.random.key(0), (16, 8)))}
  tx = cola.o_cola_ud(0.1, friction=1.0, temperature=1e-4, key=jax.random.key(1), loop=loop)
  state = tx.init(params)
  assert _has_while(tx.update, params, state, params) == has_while


@pytest.mark.extended  # quick: the fixed loops against the while loops, point by point
def test_o_cola_ud_with_noise_trains_the_same_in_both_forms():
  params = {
    "w": cola.Orthogonal().nearest(jax.random.normal(jax.random.key(0), (12, 12))),
    "b": jnp.zeros(12),
  }
  data = jax.random.normal(jax.random.key(3), (32, 12))
  loss = lambda p: jnp.mean(jnp.tanh(data @ p["w"] + p["b"]) ** 2)

  def train(loop):
    tx = cola.o_cola_ud(0.3, friction=1.0, temperature=1e-3, key=jax.random.key(4), loop=loop)

    @jax.jit
    def run(params):
      def step(carry, _):
        params, state = carry
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return (optax.apply_updates(params, updates), state), None

      return jax.lax.scan(step, (params, tx.init(params)), None, length=20)[0]

    return run(params)

  (while_params, _), (fixed_params, _) = train("while"), train("fixed")
  np.testing.assert_allclose(fixed_params["w"], while_params["w"], rtol=0, atol=1e-5)
  np.testing.assert_allclose(fixed_params["b"], while_params["b"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("quasi_newton", [False, pytest.param(True, marks=pytest.mark.extended)])  # quick: the default
def test_implicit_fixed_loops_match_while_loops(quasi_newton):
  unit_sphere = lambda w: jnp.sum(w**2) - 1
  params = jax.random.normal(jax.random.key(0), (6, 10))
  params = params / jnp.linalg.norm(params, axis=0)
  params = params.at[:, 3].multiply(1.5)  # one unit starts off the manifold: reprojected
  grad = jax.random.normal(jax.random.key(1), (6, 10))

  def step(loop):
    constraint = cola.Implicit(equality=unit_sphere, axis=0, quasi_newton=quasi_newton, loop=loop)
    tx = cola.cola_od(0.2, constraints=constraint)
    updates, state = jax.jit(tx.update)(grad, tx.init(params), params)
    return optax.apply_updates(params, updates), state

  (while_params, while_state), (fixed_params, fixed_state) = step("while"), step("fixed")
  np.testing.assert_allclose(fixed_params, while_params, rtol=0, atol=1e-6)
  for fixed_leaf, while_leaf in zip(jax.tree.leaves(fixed_state), jax.tree.leaves(while_state), strict=True):
    np.testing.assert_array_equal(fixed_leaf, while_leaf)
  np.testing.assert_allclose(jnp.sum(fixed_params**2, axis=0), 1.0, atol=1e-5)


def test_loop_is_validated():
  with pytest.raises(ValueError, match="Orthogonal: loop must be 'while' or 'fixed', got 'unrolled'"):
    cola.Orthogonal(loop="unrolled")
  with pytest.raises(ValueError, match="Implicit: loop must be"):
    cola.Implicit(equality=jnp.sum, loop=3)


def test_bounded_while_loop_is_exact_within_its_bound():
  not_done = lambda c: (c[1] > 1e-3) & (c[2] < 10)
  step = lambda c: (c[0] + 1.0, c[1] / 3, c[2] + 1)
  init = (jnp.float32(0), jnp.float32(1), jnp.int32(0))
  expected = jax.lax.while_loop(not_done, step, init)
  got = stiefel_projection.bounded_while_loop(not_done, step, init, 10, True)
  assert [float(v) for v in got] == [float(v) for v in expected]
  assert int(got[2]) == 7
