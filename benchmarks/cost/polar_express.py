r"""The matrix sign ``U V^T`` of ``U S V^T`` by the Polar Express, the reference of the retraction benchmark.

Muon and the modular-manifolds reference compute this polar factor of an
arbitrary matrix with a few odd matrix polynomials, matmuls only.
``cola_jax`` does not use it (its retractions start from ``Q + xi`` with
every singular value at least 1, ``cola_jax.constraints.stiefel_retraction``);
``benchmarks/cost/retractions.py`` times it beside them.

Reference:
  Amsel, Persson, Musco, Gower, *The Polar Express: Optimal Matrix Sign
  Methods and Their Application to the Muon Algorithm*, arXiv:2505.16932.
"""

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST

# (a, b, c) of p(x) = a x + b x^3 + c x^5, per step, from Algorithm 1 of Amsel et al.: optimal for
# singular values in [1e-3, 1]; the last repeats (it is the degree-5 Newton-Schulz polynomial).
_COEFFICIENTS = (
  (8.28721201814563, -23.595886519098837, 17.300387312530933),
  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
  (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
  (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
  (1.875, -1.25, 0.375),
)
# The paper's safety factor: every polynomial but the last is evaluated at x / 1.01, and the
# input is normalised to Frobenius norm 1 / 1.01, so that rounding cannot push a singular value
# past the interval the polynomials were optimised on.
_SAFETY = 1.01


def coefficients(steps: int) -> tuple[tuple[float, float, float], ...]:
  """The ``(a, b, c)`` of each of ``steps`` steps, safety factor included."""
  if isinstance(steps, bool) or not isinstance(steps, int):
    raise TypeError(f"matrix_sign: steps must be an int, got {steps!r}.")
  if steps < 1:
    raise ValueError(f"matrix_sign: steps must be positive, got {steps}.")
  table = [(a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5) for a, b, c in _COEFFICIENTS[:-1]] + [_COEFFICIENTS[-1]]
  return tuple(table[min(k, len(table) - 1)] for k in range(steps))


def matrix_sign(x: jax.Array, *, steps: int = 8, compute_dtype=None) -> jax.Array:
  r"""The polar factor ``U V^T`` of ``x = U S V^T`` (the matrix sign), by the Polar Express.

  ``x`` is scaled to Frobenius norm ``1/1.01``, which puts every singular
  value in ``(0, 1)``; then each step applies an odd quintic to every
  singular value, ``X <- a_t X + b_t X (X^T X) + c_t X (X^T X)^2``, with the
  per-step coefficients of Amsel et al. (Algorithm 1, safety factor
  included), whose composition is the best uniform approximation of
  ``sign`` on ``[1e-3, 1]``; steps past the eighth repeat
  ``(15 x - 10 x^3 + 3 x^5)/8``. The products are taken over the short side.
  In exact arithmetic the largest error ``max_i |p(sigma_i) - 1|`` over
  singular values ``sigma_i >= 1e-3 |x|_F`` is 0.16 after 5 steps, 6.5e-3
  after 6, 1.1e-5 after 7 and below float64 rounding after 8 (the default).
  Zero singular values stay zero.

  Args:
    x: a matrix ``(..., m, n)`` of float32 or bfloat16; leading axes are a
      batch, each matrix scaled on its own.
    steps: the number of polynomial steps (a positive int).
    compute_dtype: the dtype of the products (None: ``x``'s dtype). The
      norm is taken in at least float32.

  Returns:
    ``U V^T`` in ``x``'s dtype and shape; NaN for a matrix with a
    non-finite entry, zero for a zero matrix.
  """
  steps_coefficients = coefficients(steps)
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"matrix_sign: x must have at least two axes (a matrix), got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"matrix_sign: x must be a float array, got dtype {x.dtype}.")
  dtype = jnp.dtype(x.dtype if compute_dtype is None else compute_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"matrix_sign: compute_dtype must be a float dtype, got {compute_dtype!r}.")
  wide = x.shape[-2] < x.shape[-1]
  tall = (jnp.swapaxes(x, -1, -2) if wide else x).astype(jnp.promote_types(x.dtype, jnp.float32))
  finite = jnp.all(jnp.isfinite(tall), axis=(-2, -1), keepdims=True)
  largest = jnp.max(jnp.abs(jnp.where(finite, tall, 0)), axis=(-2, -1), keepdims=True)
  scaled = tall / jnp.where(largest > 0, largest, 1)  # entries at most 1: the norm cannot overflow
  norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=(-2, -1), keepdims=True))
  q = jnp.where(finite, scaled / (_SAFETY * jnp.where(norm > 0, norm, 1)), jnp.nan).astype(dtype)
  eye = jnp.eye(q.shape[-1], dtype=dtype)
  for a, b, c in steps_coefficients:
    gram = jnp.matmul(jnp.swapaxes(q, -1, -2), q, precision=_HIGHEST)
    # a I + b A + c A^2 = I + (a + b + c - 1) I + (b + 2 c) D + c D^2 for A = I + D: near convergence a small
    # correction to X rather than terms of order one that cancel.
    defect = gram - eye
    correction = (a + b + c - 1) * eye + (b + 2 * c) * defect + c * jnp.matmul(defect, defect, precision=_HIGHEST)
    q = q + jnp.matmul(q, correction, precision=_HIGHEST)
  return (jnp.swapaxes(q, -1, -2) if wide else q).astype(x.dtype)
