"""float64: parameters, updates and state stay float64; constraints hold to float64 precision.

Runs under ``jax.enable_x64(True)`` (a context manager in JAX >= 0.8; the
``jax.experimental.enable_x64`` of older versions is gone), which covers
tracing, compilation and execution of everything created inside it.
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

STEPS = 100


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def problem():
  """Float64 MLP parameters and a loss; call inside the x64 context."""
  key = jax.random.key(0)
  sizes = (6, 12, 8, 3)
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, k = jax.random.split(key)
    bound = 1 / np.sqrt(fan_in)
    params[f"layer{i}"] = {
      "w": jax.random.uniform(k, (fan_in, fan_out), jnp.float64, -bound, bound),
      "b": jnp.zeros(fan_out, jnp.float64),
    }
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (32, sizes[0]), jnp.float64)
  y = jnp.sin(x @ jax.random.normal(kw, (sizes[0], sizes[-1]), jnp.float64))

  def loss(p):
    h = x
    for i in range(len(sizes) - 1):
      h = h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
      h = jnp.tanh(h) if i < len(sizes) - 2 else h
    return jnp.mean((h - y) ** 2)

  return params, loss


def train(tx, params, loss):
  @jax.jit
  def run(params):
    def step(carry, _):
      p, s = carry
      updates, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, updates), s), updates

    (p, s), updates = jax.lax.scan(step, (params, tx.init(params)), None, length=STEPS)
    return p, s, updates

  return run(params)


def assert_float64(tree):
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float64, leaf.dtype


def tall(w):
  return w if w.shape[0] >= w.shape[1] else w.T


def test_x64_context_is_on(x64):
  assert jnp.zeros(1, jnp.float64).dtype == jnp.float64
  assert jnp.asarray(1.0).dtype == jnp.float64


def test_circle_constraint_holds_to_float64_precision(x64):
  params, loss = problem()
  radius = 0.2
  tx = cola.c_cola_ud(0.3, friction=1.0, radius=radius, temperature=1e-4, key=jax.random.key(1))
  trained, state, updates = train(tx, params, loss)
  assert_float64(trained)
  assert_float64(updates)
  assert_float64(state)
  assert float(jnp.max(jnp.abs(trained["layer1"]["w"] - params["layer1"]["w"]))) > 1e-3  # it moved
  for name in params:
    theta = trained[name]["w"]
    xi = state.constraint_states[name]["w"].slack
    residual = float(jnp.max(jnp.abs(theta**2 + xi**2 - radius**2)) / radius**2)
    assert residual <= 1e-12, (name, residual)
    assert float(jnp.max(jnp.abs(theta))) <= radius


# Extended: o_cola_od (the float64 of the underdamped step is the circle test's); o_cola_ud under slow.
@pytest.mark.parametrize(
  "method", [pytest.param("o_cola_od", marks=pytest.mark.extended), pytest.param("o_cola_ud", marks=pytest.mark.slow)]
)
def test_orthogonal_constraint_holds_to_float64_precision(x64, method):
  params, loss = problem()
  if method == "o_cola_od":
    tx = cola.o_cola_od(0.05, temperature=1e-4, key=jax.random.key(1), tolerance=1e-13, max_iterations=50)
  else:
    tx = cola.o_cola_ud(0.1, friction=1.0, temperature=1e-4, key=jax.random.key(1), tolerance=1e-13, max_iterations=50)
  trained, state, updates = train(tx, params, loss)
  assert_float64(trained)
  assert_float64(updates)
  assert_float64(state)
  for name in params:
    q = tall(trained[name]["w"])
    defect = float(jnp.max(jnp.abs(q.T @ q - jnp.eye(q.shape[1], dtype=q.dtype))))
    assert defect <= 1e-12, (name, defect)
    info = state.constraint_states[name]["w"]
    # The quasi-Newton iteration itself met 1e-13 (no polar fallback).
    assert bool(info.converged), (name, info)


def test_float32_parameters_stay_float32_with_x64_on(x64):
  params, loss = problem()
  params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  loss32 = lambda p: loss(jax.tree.map(lambda a: a.astype(jnp.float64), p)).astype(jnp.float32)
  trained, state, updates = train(cola.c_cola_ud(0.3, friction=1.0, radius=0.2), params32, loss32)
  for leaf in jax.tree.leaves((trained, updates, state.momentum)):
    assert leaf.dtype == jnp.float32


@pytest.mark.extended  # quick: test_conformance.py's float64 check (constraint_residuals to float64's bound)
def test_constraint_residuals_report_float64_precision(x64):
  params, loss = problem()
  tx = cola.o_cola_od(0.05, key=jax.random.key(1), tolerance=1e-13, max_iterations=50)
  trained, state, _ = train(tx, params, loss)
  residuals = cola.constraint_residuals(trained, state)
  for leaf in jax.tree.leaves(residuals):
    assert leaf.dtype == jnp.float64
