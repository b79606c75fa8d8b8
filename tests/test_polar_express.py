"""The matrix sign of Muon (``benchmarks/cost/polar_express.py``), the reference the retraction benchmark times."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.cost.polar_express import matrix_sign
from cola_jax.constraints import stiefel_retraction as sr

pytestmark = pytest.mark.integration


def _conditioned(seed, shape, condition):
  """A matrix of ``shape`` with singular values evenly from 1 to ``condition``, and its ``U V^T``."""
  key_u, key_v = jax.random.split(jax.random.key(seed))
  *batch, m, n = shape
  k = min(m, n)
  u, _ = jnp.linalg.qr(jax.random.normal(key_u, (*batch, m, k)))
  v, _ = jnp.linalg.qr(jax.random.normal(key_v, (*batch, n, k)))
  singular = jnp.linspace(1.0, condition, k)
  return (u * singular) @ jnp.swapaxes(v, -1, -2), u @ jnp.swapaxes(v, -1, -2)


def _residual(q):
  return float(jnp.max(jnp.abs(sr.gram_defect(q))))


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (3, 20, 12)])
def test_matrix_sign_is_u_v_transpose(shape):
  x, polar = _conditioned(5, shape, 20.0)
  sign = jax.jit(matrix_sign)(x)
  assert sign.dtype == jnp.float32 and sign.shape == shape
  assert float(jnp.max(jnp.abs(sign - polar))) <= 2e-6
  tall = sign if shape[-2] >= shape[-1] else jnp.swapaxes(sign, -1, -2)
  assert float(jnp.max(jnp.abs(jax.vmap(sr.gram_defect)(tall.reshape(-1, *tall.shape[-2:]))))) <= 2e-6


@pytest.mark.parametrize("compute_dtype", [None, jnp.float32])
def test_matrix_sign_in_bfloat16(compute_dtype):
  """Measured: max |S^T S - I| about 3e-3 for these sizes (bfloat16's eps is 7.8e-3); bound 1e-2."""
  x, polar = _conditioned(6, (64, 32), 20.0)
  sign = jax.jit(matrix_sign, static_argnames="compute_dtype")(x.astype(jnp.bfloat16), compute_dtype=compute_dtype)
  assert sign.dtype == jnp.bfloat16
  sign = sign.astype(jnp.float32)
  assert _residual(sign) <= 1e-2
  assert float(jnp.max(jnp.abs(sign - polar))) <= 2e-2


def test_matrix_sign_of_zero_is_zero_of_huge_entries_finite_and_of_non_finite_ones_nan():
  sign = jax.jit(matrix_sign)
  assert float(jnp.max(jnp.abs(sign(jnp.zeros((6, 4)))))) == 0
  x, polar = _conditioned(7, (6, 4), 2.0)
  np.testing.assert_allclose(sign(1e30 * x), polar, atol=2e-6)
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    signs = sign(jnp.stack([x, x.at[3, 2].set(bad)]))
    assert bool(jnp.all(jnp.isnan(signs[1]))) and bool(jnp.all(jnp.isfinite(signs[0])))


@pytest.mark.parametrize(
  ("x", "kwargs", "error", "message"),
  [
    (jnp.ones((3, 2)), {"steps": 0}, ValueError, "steps"),
    (jnp.ones((3, 2)), {"steps": 2.0}, TypeError, "steps"),
    (jnp.ones(3), {}, ValueError, "two axes"),
    (jnp.ones((3, 2), jnp.int32), {}, TypeError, "float"),
    (jnp.ones((3, 2)), {"compute_dtype": jnp.int32}, TypeError, "compute_dtype"),
  ],
)
def test_matrix_sign_checks_its_arguments(x, kwargs, error, message):
  with pytest.raises(error, match=message):
    matrix_sign(x, **kwargs)
