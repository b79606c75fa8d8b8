"""A step ``vmap``-ed over seeds calls every LAPACK factorisation on one matrix at a time (XLA:CPU).

jaxlib 0.10.2's CPU kernels split a batch of large matrices into tasks on the
intra-op pool and block the pool thread that runs them: with both threads of
two cores blocked so, the step deadlocks (``one_matrix_at_a_time`` in
``cola_jax/_numerics.py``). The matrices here are small (they would run in
place); the compiled program is what is checked.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="jaxlib's LAPACK kernels are the CPU backend's")

_X = jax.random.normal(jax.random.key(1), (16, 12))
_Y = jnp.arange(16) % 4
# Ten and nine components (above implicit._FEW_COMPONENTS): Cholesky and LU solves by LAPACK.
_ZERO_MEAN = cola.Implicit(equality=lambda w: w.sum(axis=0) / 3)
_PER_UNIT = cola.Implicit(equality=lambda w: w.reshape(9, 4).sum(axis=1) / 2, axis=0)


def _orthogonal(retraction):
  return {"w": cola.Orthogonal(retraction=retraction), "k": cola.Orthogonal(row_axes=2, column_axes=3), "v": None}


CASES = {  # name: (optimizer from a key, constraints, the LAPACK kernels expected; s: float32)
  "polar": (lambda key, c: cola.constrained(optax.adam(1e-2), constraints=c), _orthogonal("polar"), {"syevd", "gesdd"}),
  "qr": (lambda key, c: cola.constrained(optax.adam(1e-2), constraints=c), _orthogonal("qr"), {"geqrf", "orgqr"}),
  "implicit": (
    lambda key, c: cola.constrained(optax.sgd(0.05), constraints=c),
    {"w": _ZERO_MEAN, "k": None, "v": _PER_UNIT},
    {"potrf", "getrf"},
  ),
}


def _model(name):
  """``init(key)`` (each seed's parameters and state) and ``step(key, params, state)`` of a small model."""
  make_tx, constraints, _ = CASES[name]

  def loss(p):
    h = jnp.tanh(_X @ p["w"])  # (16, 10)
    h = jnp.tanh(h[:, :8] @ p["k"].sum(axis=(0, 1)))  # (16, 6)
    return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(jnp.pad(h, ((0, 0), (0, 30)))) @ p["v"], _Y).mean()

  def init(key):
    kw, kk, kv = jax.random.split(key, 3)
    params = {
      "w": jax.random.normal(kw, (12, 10)) / 4,
      "k": jax.random.normal(kk, (2, 2, 8, 6)) / 3,
      "v": jax.random.normal(kv, (36, 4)) / 6,
    }
    params = cola.project_params(params, constraints)
    return params, make_tx(key, constraints).init(params)

  def step(key, p, s):
    updates, s = make_tx(key, constraints).update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  return init, step


def _numbers(tree):
  """``tree`` with its PRNG keys as their data, for comparison."""
  as_data = lambda v: jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
  return jax.tree.map(as_data, tree)


@pytest.mark.parametrize(  # quick: the polar factor's eigh and SVD; the QR and the implicit solves under slow
  "name", [pytest.param(name, marks=() if name == "polar" else pytest.mark.slow) for name in CASES]
)
def test_a_vmapped_step_factors_one_matrix_at_a_time_and_is_each_seed_s_step(name):
  init, step = _model(name)
  keys = jax.random.split(jax.random.key(0), 2)
  batched = jax.jit(jax.vmap(init))(keys)
  vmapped = jax.jit(jax.vmap(step)).lower(keys, *batched).compile()
  calls = [line for line in vmapped.as_text().splitlines() if 'custom_call_target="lapack_' in line]
  assert {re.search(r'lapack_[sd](\w+)_ffi"', call).group(1) for call in calls} >= CASES[name][2]
  for call in calls:  # the result's first array: the matrix factored, (n, p) rather than (seeds, n, p)
    shape = re.search(r"\w+\[([\d,]*)\]", call.split(" = ", 1)[1]).group(1)
    assert shape.count(",") == 1 or shape.startswith("4,9,"), call  # the per-unit leaf's 4 units stay one call
  for _ in range(2):
    batched = vmapped(keys, *batched)
  single = jax.jit(step)
  for i, key in enumerate(keys):
    alone = jax.jit(init)(key)
    for _ in range(2):
      alone = single(key, *alone)
    seed = jax.tree.map(lambda v: v[i], batched)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), _numbers(seed), _numbers(alone))
