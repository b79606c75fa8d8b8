r"""Retractions onto the Stiefel manifold.

A retraction takes a tangent step ``xi`` at ``Q`` (``Q^T Q = I_s``, ``Q`` of
shape ``(r, s)``, ``r >= s``, ``Q^T xi`` skew) to a point of the manifold. All
three here start from ``M = Q + xi``:

* the polar factor ``M (M^T M)^{-1/2}`` (the nearest orthonormal matrix, a
  second-order retraction), by an ``s x s`` eigendecomposition
  (:func:`polar_of_tangent_step`) or by Newton-Schulz iterations
  (:func:`newton_schulz_polar`), which only multiply matrices;
* ``qf(M)``, the Q factor of a QR decomposition with the diagonal of ``R``
  positive (:func:`qr_retraction`, geoopt's choice): a first-order
  retraction, ``qf(Q + t xi) = polar(Q + t xi) + O(t^2)``.

Tangent steps make the polar iteration easy: ``M^T M = I_s + xi^T xi`` (``Q^T
xi`` is skew), so every singular value of ``M`` is at least 1 and the
iteration starts close to its fixed point for the small steps of training.

Verification. The retractions compute in at least float32 (a bfloat16 point
is ``2^-9`` off the manifold by its own rounding) and report
``max |Q^T Q - I| <= tolerance`` as ``converged``, the tolerance raised to
:func:`rounding_floor` (what float32 rounding of an exactly orthonormal
matrix leaves). A non-finite ``M`` gives NaN and False, without calling
LAPACK (whose iterations would not return on CPU).

References:
  Absil, Mahony, Sepulchre, *Optimization Algorithms on Matrix Manifolds*,
  2008, sections 4.1.1 and 4.8 (retractions; the QR and polar retractions).
  Higham, *Functions of Matrices*, 2008, sections 8.3 and 8.8 (Newton-Schulz
  and the Pade family of polar iterations).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax._numerics import bounded_while_loop, max_abs, power_of_two_scale
from cola_jax._platform import one_matrix_at_a_time
from cola_jax.constraints import stiefel_projection

_HIGHEST = jax.lax.Precision.HIGHEST


def _newton_schulz_step(x: jax.Array, defect: jax.Array) -> jax.Array:
  """``X (15 I - 10 A + 3 A^2) / 8`` for ``A = X^T X = I + D``, written as ``X + X (3 D^2 / 8 - D / 2)``: near
  convergence a small correction to ``X`` rather than terms of order one that cancel."""
  correction = 0.375 * jnp.matmul(defect, defect, precision=_HIGHEST) - 0.5 * defect
  return x + jnp.matmul(x, correction.astype(x.dtype), precision=_HIGHEST)


def gram_defect(q: jax.Array) -> jax.Array:
  """``Q^T Q - I`` at full float32 precision on every backend."""
  return stiefel_projection.gram(q, q) - jnp.eye(q.shape[1], dtype=q.dtype)


def rounding_floor(rows: int, dtype=jnp.float32) -> float:
  r"""``2 sqrt(r) eps``: a bound on ``max |Q^T Q - I|`` of an orthonormal ``(r, s)`` matrix rounded to ``dtype``.

  Rounding each entry of ``Q`` and each product of ``Q^T Q`` leaves errors of
  order ``eps`` per term, which add up like a random walk over the ``r``
  terms of an entry of ``Q^T Q``. Measured on CPU in float32 for the
  converged results of the retractions here, the largest entry is at most
  ``1.1 sqrt(r) eps`` (8 x 8; 0.4 at 512 x 512, 0.06 at 4096 x 1024).
  """
  return float(2 * math.sqrt(rows) * np.finfo(dtype).eps)


def _working(m: jax.Array) -> jax.Array:
  return m.astype(jnp.promote_types(m.dtype, jnp.float32))


def _tolerance(m: jax.Array, tolerance: float) -> float:
  return max(tolerance, rounding_floor(m.shape[0], m.dtype))


def polar_of_tangent_step(m: jax.Array) -> jax.Array:
  """The polar factor ``M (M^T M)^{-1/2}`` of ``M = Q + xi``, ``xi`` tangent, by an ``s x s`` eigendecomposition.

  ``M^T M = I + xi^T xi`` has every eigenvalue at least 1, so the inverse square
  root is well conditioned for every finite step: no SVD of the ``r x s``
  matrix is needed (an SVD of a 512 x 64 matrix costs several times more on CPU). ``M`` is scaled by
  an exact power of two first (no overflow of ``M^T M``); a non-finite ``M``
  gives NaN without calling ``eigh``. Computed in at least float32.
  """
  m = _working(m)
  finite = jnp.all(jnp.isfinite(m))
  m = jnp.where(finite, m * power_of_two_scale(max_abs(m)), jnp.eye(*m.shape, dtype=m.dtype))
  eigenvalues, vectors = one_matrix_at_a_time(jnp.linalg.eigh)(stiefel_projection.gram(m, m))
  inverse_sqrt = jax.lax.rsqrt(jnp.maximum(eigenvalues, jnp.finfo(m.dtype).tiny))
  root = jnp.matmul(vectors * inverse_sqrt, vectors.T, precision=_HIGHEST)
  q = jnp.matmul(m, root, precision=_HIGHEST)
  # One step of the polar (Newton-Schulz) iteration takes the rounding of eigh (~ 1e-6 in float32) to ~ eps.
  q = q - 0.5 * jnp.matmul(q, gram_defect(q), precision=_HIGHEST)
  return jnp.where(finite, q, jnp.nan)


def qr_retraction(m: jax.Array, *, tolerance: float = 1e-6) -> tuple[jax.Array, jax.Array]:
  r"""``qf(M)``: the Q factor of ``M = Q R`` with ``diag(R) > 0``, and whether it is orthonormal.

  For ``M = Q_n + xi`` (``xi`` tangent at ``Q_n``) this is the QR retraction,
  first order: ``qf(Q_n + t xi) = Q_n + t xi + O(t^2)``, and it differs
  from the polar factor at second order. Householder QR (LAPACK) costs
  ``2 r s^2 - 2/3 s^3`` flops for the factorization and about as many to
  form ``Q``, against the polar factor's ``s x s`` eigendecomposition
  (about ``9 s^3``) and products. The signs of ``R``'s diagonal are moved into
  ``Q`` (a zero pivot counts as positive), which makes ``qf`` a function of
  ``M``. ``M`` is scaled by an exact power of two first (``qf(c M) =
  qf(M)`` for ``c > 0``).

  Args:
    m: one matrix ``(r, s)``, ``r >= s`` (``jax.vmap`` for stacks).
    tolerance: the check ``max |Q^T Q - I| <= max(tolerance,``
      :func:`rounding_floor` ``)`` that sets the flag.

  Returns:
    ``(q, converged)``: ``q`` in at least float32; ``converged`` the check
    above (False with a ``q`` of NaN for a non-finite ``m``).

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.constraints.stiefel_retraction import qr_retraction
    >>> m = jnp.array([[2.0, 1.0], [0.0, -3.0], [0.0, 0.0]])
    >>> q, ok = qr_retraction(m)
    >>> q.T @ m, bool(ok)  # R, with a positive diagonal
    (Array([[2., 1.], [0., 3.]], dtype=float32), True)
  """
  m = _working(m)
  finite = jnp.all(jnp.isfinite(m))
  m = jnp.where(finite, m * power_of_two_scale(max_abs(m)), jnp.eye(*m.shape, dtype=m.dtype))
  q, r = one_matrix_at_a_time(jnp.linalg.qr)(m)
  q = q * jnp.where(jnp.diagonal(r) < 0, -1, 1).astype(q.dtype)
  converged = finite & (max_abs(gram_defect(q)) <= _tolerance(m, tolerance))
  return jnp.where(finite, q, jnp.nan), converged


def newton_schulz_polar(
  m: jax.Array, *, tolerance: float = 1e-6, max_iterations: int = 20, fixed: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""The polar factor ``M (M^T M)^{-1/2}`` by degree-5 Newton-Schulz iterations, and how they went.

  With ``G = X^T X`` (``s x s``) each iteration is

  .. math::
    X \leftarrow \tfrac18 X \big(15 I - 10 G + 3 G^2\big),

  the second-order Taylor polynomial of ``G^{-1/2}`` at ``I``: every
  eigenvalue ``1 + e`` of ``G`` becomes ``1 - 5 e^3/16 + O(e^4)`` (third-order
  convergence). For ``M = Q + xi`` with ``xi`` tangent the start
  ``X = M`` has ``e = sigma_i(xi)^2``, no scaling needed: a training step
  with ``|xi|_2 <= 0.1`` converges in one iteration (three ``r x s x s``
  products and one ``s x s x s``), one with ``|xi|_2 = 0.7`` in three. The
  Gram matrix of each iterate decides whether to go on: the loop stops once
  ``max |G - I| <= max(tolerance,`` :func:`rounding_floor` ``)`` (the
  result is verified), once ``|G - I|_F`` stops decreasing (a step too large
  for the polynomial, whose region is ``0 < e < 1.4`` about, or a floor of
  rounding), or after ``max_iterations``. Where the tolerance was not met,
  the polar factor is computed by :func:`polar_of_tangent_step` (an ``s x s``
  eigendecomposition, after a power-of-two scaling: any finite ``M``) in a
  loop of at most one iteration, which runs only when needed (under
  ``jax.vmap``: when some member needs it), and checked in the same way.

  Args:
    m: one matrix ``(r, s)``, ``r >= s`` (``jax.vmap`` for stacks).
    tolerance: the stopping test, raised to :func:`rounding_floor`.
    max_iterations: the bound on Newton-Schulz iterations.
    fixed: run every loop for its bound, iterations after the stop masked
      (no loop whose end the host must read; see
      :func:`~cola_jax._numerics.bounded_while_loop`).

  Returns:
    ``(q, iterations, converged)``: the polar factor in at least float32,
    the Newton-Schulz iterations run, and whether ``max |Q^T Q - I|`` meets
    the tolerance (after the eigendecomposition where it ran). A
    non-finite ``m`` gives NaN and False.

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.constraints.stiefel_retraction import newton_schulz_polar
    >>> m = jnp.array([[1.0, 0.1], [-0.1, 1.0], [0.0, 0.0]])  # I + xi, xi tangent at I
    >>> q, iterations, ok = newton_schulz_polar(m)
    >>> bool(jnp.allclose(1.01**0.5 * q, m, atol=1e-6)), int(iterations), bool(ok)  # m = sqrt(1.01) q
    (True, 1, True)
  """
  m = _working(m)
  tolerance = _tolerance(m, tolerance)

  def measured(x, iterations, previous):
    defect = gram_defect(x)
    return x, defect, iterations, previous, jnp.sqrt(jnp.sum(jnp.square(defect)))

  def not_done(carry):
    _, defect, iterations, previous, size = carry
    # NaN and inf fail `size < previous`: a non-finite start or overflow ends the loop at once.
    return ~(max_abs(defect) <= tolerance) & (size < previous) & (iterations < max_iterations)

  def step(carry):
    x, defect, iterations, _, size = carry
    return measured(_newton_schulz_step(x, defect), iterations + 1, size)

  start = measured(m, jnp.zeros((), jnp.int32), jnp.array(jnp.inf, m.dtype))
  x, defect, iterations, _, _ = bounded_while_loop(not_done, step, start, max_iterations, fixed)
  converged = max_abs(defect) <= tolerance

  def eigendecomposition(carry):
    q = polar_of_tangent_step(carry[0])
    return q, max_abs(gram_defect(q)) <= tolerance, jnp.array(False)

  # The carry holds M where it is needed: a body computed from M alone would be loop-invariant, and XLA would
  # hoist the eigendecomposition out of the loop and run it always.
  start = (jnp.where(converged, x, m), converged, ~converged)
  q, converged, _ = bounded_while_loop(lambda carry: carry[2], eigendecomposition, start, 1, fixed)
  return q, iterations, converged
