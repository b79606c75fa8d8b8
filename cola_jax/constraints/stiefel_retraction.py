r"""Retractions onto the Stiefel manifold, and the matrix sign function.

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

:func:`matrix_sign` is the polar factor ``U V^T`` of an arbitrary matrix
``U S V^T`` by the Polar Express (per-step optimal odd polynomials).

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
  Amsel, Persson, Musco, Gower, *The Polar Express: Optimal Matrix Sign
  Methods and Their Application to the Muon Algorithm*, arXiv:2505.16932.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax._numerics import bounded_while_loop, max_abs, power_of_two_scale
from cola_jax._platform import one_matrix_at_a_time
from cola_jax.constraints import stiefel_projection

_HIGHEST = jax.lax.Precision.HIGHEST

# (a, b, c) of p(x) = a x + b x^3 + c x^5, per step, from Algorithm 1 of Amsel et al.: optimal for
# singular values in [1e-3, 1]; the last repeats (it is the degree-5 Newton-Schulz polynomial).
_POLAR_EXPRESS = (
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


def polar_express_coefficients(steps: int) -> tuple[tuple[float, float, float], ...]:
  """The ``(a, b, c)`` of each of ``steps`` Polar Express steps, safety factor included."""
  if isinstance(steps, bool) or not isinstance(steps, int):
    raise TypeError(f"matrix_sign: steps must be an int, got {steps!r}.")
  if steps < 1:
    raise ValueError(f"matrix_sign: steps must be positive, got {steps}.")
  cushioned = [(a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5) for a, b, c in _POLAR_EXPRESS[:-1]]
  table = cushioned + [_POLAR_EXPRESS[-1]]
  return tuple(table[min(k, len(table) - 1)] for k in range(steps))


def _quintic_step(x: jax.Array, defect: jax.Array, a, b, c) -> jax.Array:
  """``a X + b X A + c X A^2`` for ``A = X^T X = I + defect``: the odd polynomial ``a x + b x^3 + c x^5`` of
  each singular value of the tall ``X``, written as ``X + X (k_0 I + k_1 D + c D^2)`` (``D`` the defect),
  which near convergence adds a small correction to ``X`` instead of cancelling terms of order one."""
  correction = (b + 2 * c) * defect + c * jnp.matmul(defect, defect, precision=_HIGHEST)
  correction = correction + (a + b + c - 1) * jnp.eye(defect.shape[-1], dtype=defect.dtype)
  return x + jnp.matmul(x, correction.astype(x.dtype), precision=_HIGHEST)


def _gram_defect(x: jax.Array) -> jax.Array:
  """``X^T X - I`` over the last two axes at full precision."""
  gram = jnp.matmul(jnp.swapaxes(x, -1, -2), x, precision=_HIGHEST)
  return gram - jnp.eye(x.shape[-1], dtype=x.dtype)


def matrix_sign(x: jax.Array, *, steps: int = 8, compute_dtype=None) -> jax.Array:
  r"""The polar factor ``U V^T`` of ``x = U S V^T`` (the matrix sign), by the Polar Express.

  ``x`` is scaled to Frobenius norm ``1/1.01`` (after an exact power-of-two
  scaling, so that no norm overflows), which puts every singular value in
  ``(0, 1)``; then each step applies an odd quintic to every singular value,

  .. math::
    X \leftarrow a_t X + b_t X (X^T X) + c_t X (X^T X)^2,

  with the per-step coefficients of Amsel et al. (Algorithm 1, safety
  factor 1.01 included), chosen so that the composition is the best uniform
  approximation of ``sign`` on ``[1e-3, 1]``; steps past the eighth repeat
  the degree-5 Newton-Schulz polynomial ``(15 x - 10 x^3 + 3 x^5)/8``. The
  products are taken over the short side (``X^T X`` is ``min(m, n)``
  square). In exact arithmetic the largest error ``max_i |p(sigma_i) - 1|``
  over singular values ``sigma_i >= 1e-3 |x|_F`` is 0.16 after 5 steps,
  6.5e-3 after 6, 1.1e-5 after 7 and below float64 rounding after 8 (the
  default): then the result is ``U V^T`` to the rounding of
  ``compute_dtype``. Singular values below ``1e-3 |x|_F`` need more steps
  (``1e-4 |x|_F``: 11); zero ones stay zero (``sign(0) = 0``), so the result
  of a rank-deficient ``x`` is a partial isometry.

  Args:
    x: a matrix ``(..., m, n)`` of float32 or bfloat16; leading axes are a
      batch, each matrix scaled on its own.
    steps: the number of polynomial steps (a positive int).
    compute_dtype: the dtype of the products (None: ``x``'s dtype). The
      norm is taken in at least float32.

  Returns:
    ``U V^T`` in ``x``'s dtype and shape. Every matrix with a non-finite
    entry gives a matrix of NaN; a zero matrix gives zero.

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.constraints.stiefel_retraction import matrix_sign
    >>> matrix_sign(jnp.array([[3.0, 0.0], [0.0, -0.5], [0.0, 0.0]]))
    Array([[ 1., 0.], [ 0., -1.], [ 0., 0.]], dtype=float32)

  References:
    Amsel, Persson, Musco, Gower, *The Polar Express: Optimal Matrix Sign
    Methods and Their Application to the Muon Algorithm*, arXiv:2505.16932.
  """
  coefficients = polar_express_coefficients(steps)
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"matrix_sign: x must have at least two axes (a matrix), got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"matrix_sign: x must be a float array, got dtype {x.dtype}.")
  dtype = jnp.dtype(x.dtype if compute_dtype is None else compute_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"matrix_sign: compute_dtype must be a float dtype, got {compute_dtype!r}.")
  wide = x.shape[-2] < x.shape[-1]
  tall = jnp.swapaxes(x, -1, -2) if wide else x
  norm_dtype = jnp.promote_types(x.dtype, jnp.float32)
  scaled = tall.astype(norm_dtype)
  scaled = scaled * power_of_two_scale(max_abs(scaled, axis=(-2, -1), keepdims=True))
  # A non-zero scaled matrix has an entry in [1, 4), so norm >= 1; a zero one stays zero.
  norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=(-2, -1), keepdims=True))
  q = (scaled / (_SAFETY * jnp.maximum(norm, 1))).astype(dtype)
  for a, b, c in coefficients:
    q = _quintic_step(q, _gram_defect(q), a, b, c)
  return (jnp.swapaxes(q, -1, -2) if wide else q).astype(x.dtype)


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
  convergence; the limit of the Polar Express coefficients of
  :func:`matrix_sign`). For ``M = Q + xi`` with ``xi`` tangent the start
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
    return measured(_quintic_step(x, defect, 15 / 8, -10 / 8, 3 / 8), iterations + 1, size)

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
