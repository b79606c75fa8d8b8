r"""The steepest tangent direction on the Stiefel manifold under the spectral norm (manifold Muon's direction).

For ``W`` with orthonormal columns (``W^T W = I``) and a gradient or momentum
``G``, the direction is

.. math::
  A = \arg\max_{A} \langle G, A \rangle \quad\text{subject to}\quad
  \|A\|_2 \le 1, \quad W^T A + A^T W = 0.

How ``A`` is found.

* Square ``W`` (``W^T W = W W^T = I``): every tangent vector is ``W Omega``
  with ``Omega`` skew and ``|W Omega|_2 = |Omega|_2``, so
  ``A = W msign(skew(W^T G))`` in closed form (the matrix sign of a skew
  matrix is skew).
* Tall ``W`` (``n x p``, ``n > p``): a tangent vector is
  ``W Omega + E B`` with ``E`` an orthonormal basis of the part of the
  complement of ``W`` that ``G`` reaches (``m = min(p, n - p)`` columns, from
  one QR factorisation of ``[W, G - W W^T G]``) and ``A^T A = Omega^T Omega +
  B^T B``. The problem is the same in these ``(p + m) x p`` coordinates, and is
  solved there by ADMM (Boyd et al., 2011): alternating projections onto the
  spectral-norm ball (singular values clipped at 1, from a ``p x p``
  eigendecomposition) and onto the tangent space (``Omega`` made skew),
  over-relaxed (the second projection's input ``1.8`` times the first's
  output less ``0.8`` times the last iterate), with the penalty balanced
  between the two residuals. Every ten iterations (and
  at the last) it certifies its iterate: the point ``X`` of the ball it
  holds, less the symmetric part of ``X[:p]``, is tangent, of spectral norm at
  most ``1 + |sym(X[:p])|_F``, and so feasible once divided by that; the
  symmetric multiplier ADMM holds bounds the best value from above (weak
  duality: ``<G, A> <= |G + W Lambda|_*`` for any symmetric ``Lambda``), so
  ``gap = 1 - <G, A> / bound`` is a proven bound on how far from the steepest
  direction that direction is. It stops when the gap is at most
  ``gap_tolerance`` (or at ``max_iterations``) and returns the certified
  direction, the iterations and the gap. In float32 the certificate itself is
  good to about ``1e-5``; on the gradients of a 784-128-64-10 MLP, a gap of
  ``1e-3`` took 20 to 100 iterations (``results/comparisons/muon_direction.json``).
  The reference's dual ascent on the multiplier ``Lambda`` (``A =
  msign(G + 2 W Lambda)``) solves the same problem: its objective is
  non-smooth wherever ``G + 2 W Lambda`` loses rank, and there it stalls.

On XLA:CPU, under ``jax.vmap`` :func:`steepest_tangent_direction` loops over
the batch, one matrix at a time
(:func:`~cola_jax._platform.one_matrix_at_a_time`): jaxlib's batched CPU
LAPACK kernels can block the pool threads their own tasks need, and a step of
:func:`~cola_jax.manifold_muon` over two seeds deadlocked so.

``A`` depends on the direction of ``G`` only (``A(c G) = A(G)`` for ``c >
0``): the learning rate alone sets the length of the step, ``eta`` in the
spectral norm.

References:
  Bernstein, *Modular Manifolds*, Thinking Machines Lab: Connectionism, 2025
  (manifold Muon).
  Boyd, Parikh, Chu, Peleato, Eckstein, *Distributed Optimization and
  Statistical Learning via the Alternating Direction Method of Multipliers*,
  2011 (ADMM; residual balancing, Sec. 3.4.1; over-relaxation, Sec. 3.4.3).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from cola_jax._numerics import max_abs, power_of_two_scale
from cola_jax._platform import one_matrix_at_a_time

_HIGHEST = jax.lax.Precision.HIGHEST
_INITIAL_PENALTY = 0.1  # rho for a gradient of unit Frobenius norm; balanced as the iteration goes
_RELAXATION = 1.8  # over-relaxation (Boyd et al., Sec. 3.4.3), at the top of its usual range 1.5-1.8
_CHECK_EVERY = 10  # ADMM iterations between two certificates (each the singular values of a (p + m) x p matrix)


class DirectionInfo(NamedTuple):
  """How the steepest tangent direction of a leaf's last step was found.

  ``gap`` certifies the direction: ``<G, A>`` is within the fraction ``gap``
  of the best value, by weak duality (any symmetric ``Lambda`` bounds it by
  ``|G + 2 W Lambda|_*``; ADMM's multiplier gives the bound). For a leaf of
  several matrices (``Orthogonal`` with batch axes): the most iterations any
  matrix used, converged only if every matrix converged, and the largest gap.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.manifold_muon(0.1)
    >>> params = {'w': jnp.eye(4, 2)}
    >>> _, state = tx.update({'w': jnp.ones((4, 2))}, tx.init(params), params)
    >>> info = state.direction_info['w']  # a cola.DirectionInfo
    >>> bool(info.converged), int(info.iterations) > 0, float(info.gap) <= 1e-3  # manifold_muon's gap_tolerance
    (True, True, True)
  """

  iterations: jax.Array  # ADMM iterations (0: closed form, or a zero gradient)
  converged: jax.Array  # the gap is at most gap_tolerance, and the direction is finite
  gap: jax.Array  # 1 - <G, A> / (an upper bound of its maximum): 0 for an exact direction


def _sym(x):
  return 0.5 * (x + jnp.swapaxes(x, -1, -2))


def _skew(x):
  return 0.5 * (x - jnp.swapaxes(x, -1, -2))


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HIGHEST)


def _clip_singular_values(m: jax.Array) -> jax.Array:
  """The nearest matrix of spectral norm at most 1: ``m``'s singular values above 1 set to 1."""
  eigenvalues, vectors = jnp.linalg.eigh(_mm(m.T, m))
  sigma = jnp.sqrt(jnp.maximum(eigenvalues, 0))
  factor = jnp.where(sigma > 1, 1 / jnp.maximum(sigma, 1), 1)
  return _mm(m, _mm(vectors * factor, vectors.T))


def _sign_of_skew(s: jax.Array) -> jax.Array:
  """``msign(S)`` of a skew matrix: its nonzero singular values set to 1, the others (odd size: one at least) to 0.

  From the SVD rather than the eigendecomposition of ``S^T S``, whose squaring
  loses the small singular values' digits. A zero singular value must map to 0
  for the result to be skew.
  """
  u, sigma, vt = jnp.linalg.svd(s)
  keep = sigma > jnp.finfo(s.dtype).eps * s.shape[0] * sigma[0]
  return _mm(u * keep, vt)


def _certificate(coordinates: jax.Array, p: int, a: jax.Array, multiplier: jax.Array):
  """A feasible direction from ``a`` (spectral norm at most 1) and its gap under the bound of ``multiplier``.

  ``a`` less ``sym(a[:p])`` is tangent, of spectral norm at most ``1 + |sym(a[:p])|_F``; the symmetric
  ``multiplier`` bounds the best value by ``|Gc + [multiplier; 0]|_*`` (weak duality).
  """
  top = _sym(a[:p])
  feasible = a.at[:p].add(-top) / (1 + jnp.linalg.norm(top))
  bound = jnp.sum(jnp.linalg.svd(coordinates.at[:p].add(multiplier), compute_uv=False))
  return feasible, jnp.maximum(1 - jnp.sum(coordinates * feasible) / bound, 0)


def _admm(coordinates: jax.Array, p: int, gap_tolerance: float, max_iterations: int, multiplier: jax.Array):
  """ADMM for ``max <Gc, A>`` over ``|A|_2 <= 1`` with ``A[:p]`` skew, in the ``(p + m) x p`` coordinates.

  Starts from the symmetric ``p x p`` ``multiplier`` (zero: cold; a neighbouring problem's: warm). Returns
  the direction, the iterations, its gap (at most ``gap_tolerance`` if it converged), certified every
  ``_CHECK_EVERY`` iterations and at the last, and the multiplier of that certificate.
  """

  def tangent(a):
    return a.at[:p].set(_skew(a[:p]))

  def step(_, carry):
    z, u, rho, _ = carry
    a = _clip_singular_values(z - u + coordinates / rho)
    relaxed = _RELAXATION * a + (1 - _RELAXATION) * z
    z_new = tangent(relaxed + u)
    u = u + relaxed - z_new
    primal = jnp.linalg.norm(a - z_new)
    dual = rho * jnp.linalg.norm(z_new - z)
    # Residual balancing: the scaled multiplier u = y / rho is rescaled with rho.
    factor = jnp.where(primal > 10 * dual, 2.0, jnp.where(dual > 10 * primal, 0.5, 1.0)).astype(z.dtype)
    return z_new, u / factor, rho * factor, a

  def not_done(carry):
    k, *_, gap = carry
    return (k < max_iterations) & (gap > gap_tolerance)

  def block(carry):
    k, z, u, rho, _, _ = carry
    iterations = jnp.minimum(_CHECK_EVERY, max_iterations - k)
    z, u, rho, a = jax.lax.fori_loop(0, iterations, step, (z, u, rho, z))
    direction, gap = _certificate(coordinates, p, a, -rho * _sym(u[:p]))
    return k + iterations, z, u, rho, direction, gap

  z = tangent(coordinates)
  rho = jnp.array(_INITIAL_PENALTY, z.dtype)
  u = jnp.zeros_like(z).at[:p].set(-multiplier / rho)  # the multiplier is -rho sym(u[:p])
  init = (jnp.zeros((), jnp.int32), z, u, rho, z, jnp.array(jnp.inf, z.dtype))
  k, _, u, rho, direction, gap = jax.lax.while_loop(not_done, block, init)
  return direction, k, gap, -rho * _sym(u[:p])


def _steepest_tangent_direction(w, g, gap_tolerance, max_iterations, multiplier):
  """:func:`steepest_tangent_direction` of one matrix, its ADMM started from ``multiplier`` (``p x p``,
  symmetric, in ``W``'s coordinates), and the multiplier it ended with (a warm start for the next step's)."""
  n, p = w.shape
  finite = jnp.all(jnp.isfinite(g))
  scaled = jnp.where(finite, g * power_of_two_scale(max_abs(g)), 0)  # entries of order one
  norm = jnp.linalg.norm(scaled)
  nonzero = norm > 0
  g = scaled / jnp.where(nonzero, norm, 1)
  k = _mm(w.T, g)
  if n == p:  # exact: the bound with Lambda = -sym(W^T G) / 2 is |skew(W^T G)|_*, the value reached
    a, iterations, converged = _mm(w, _sign_of_skew(_skew(k))), jnp.zeros((), jnp.int32), jnp.array(True)
    gap, multiplier = jnp.zeros((), g.dtype), -_sym(k)
  else:
    m = min(p, n - p)
    normal = g - _mm(w, k)
    basis = jnp.linalg.qr(jnp.concatenate([w, normal], axis=1))[0][:, p : p + m]
    coordinates = jnp.concatenate([k, _mm(basis.T, g)])
    solution, iterations, gap, multiplier = _admm(coordinates, p, gap_tolerance, max_iterations, multiplier)
    a, converged = _mm(w, solution[:p]) + _mm(basis, solution[p:]), gap <= gap_tolerance
  a = jnp.where(finite, jnp.where(nonzero, a, 0), jnp.nan)
  converged = finite & (converged | ~nonzero)
  gap = jnp.where(finite, jnp.where(nonzero, gap, 0), jnp.nan)
  multiplier = jnp.where(finite & nonzero, multiplier, 0)
  return a, DirectionInfo(jnp.where(nonzero, iterations, 0), converged, gap), multiplier


def steepest_tangent_direction(
  w: jax.Array, g: jax.Array, *, gap_tolerance: float = 1e-3, max_iterations: int = 300
) -> tuple[jax.Array, DirectionInfo]:
  r"""The unit-spectral-norm tangent vector ``A`` at ``W`` maximising ``<G, A>`` (manifold Muon's direction).

  Args:
    w: a tall matrix ``(n, p)``, ``n >= p``, with orthonormal columns.
    g: the gradient (or momentum) at ``w``, of the same shape.
    gap_tolerance: the relative duality gap (:class:`DirectionInfo`'s ``gap``) at which ADMM stops (tall
      ``w``; square ones are exact).
    max_iterations: the bound on ADMM iterations.

  Returns:
    ``A`` (a tangent vector with ``|A|_2 <= 1``, to rounding) and its
    :class:`DirectionInfo`. A zero ``g`` gives ``A = 0``; a non-finite one
    gives NaN, flagged.

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.stiefel_direction import steepest_tangent_direction
    >>> w = jnp.eye(3, 2)
    >>> a, info = steepest_tangent_direction(w, jnp.array([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]]), gap_tolerance=1e-6)
    >>> a  # x = 1/sqrt(5), y = 2/sqrt(5) maximise x + 2 y subject to x^2 + y^2 <= 1
    Array([[ 0.       ,  0.4472...], [-0.4472...,  0.       ], [ 0.8944...,  0.       ]], dtype=float32)
    >>> bool(info.converged)
    True
  """
  p = w.shape[-1]

  def direction(w, g):
    return _steepest_tangent_direction(w, g, gap_tolerance, max_iterations, jnp.zeros((p, p), g.dtype))[:2]

  return one_matrix_at_a_time(direction)(w, g)
