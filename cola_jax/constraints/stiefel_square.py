r"""Loop-free SHAKE and RATTLE steps for square orthogonal matrices, with a proved bound.

For a square ``Q_n`` (``r = s``) the constraint force of the paper's
projection (:mod:`cola_jax.constraints.stiefel_projection`) has a closed form
whose truncation after one term of the binomial series costs three ``s x s``
products and no loop, and whose constraint defect is bounded by quantities the
step computes anyway. A caller accepts the result when the bound meets its
tolerance and otherwise falls back to the iterative solvers.

Notation. ``G = Q_n^T Q_n - I`` is the anchor's defect (symmetric, known from
the start-of-step check, ``||G||_2 < 1``), ``D`` the step, ``Y = Q_n^T D`` with
skew part ``A`` and symmetric part ``T``, ``P = A^T A = -A^2`` (symmetric,
positive semidefinite, commuting with ``A``). For a matrix ``M``,
``c(M) = max_j ||M e_j||_2`` is its largest column norm. Two facts give every
bound below, entry by entry:

.. math::
  |(M N)_{ij}| \le c(M^T)\, c(N), \qquad |(M^T K N)_{ij}| \le \|K\|_2\, c(M)\, c(N),

and ``c(M^T) = c(M)`` for symmetric or skew ``M``. ``||G||_2`` is bounded by
``||G||_F`` and ``c(G)`` by ``||G||_2``.

SHAKE (:func:`shake`, the overdamped step). The multiplier is
``Lambda = T + (G + P_hat) / 2`` with ``P_hat = 0`` (no series term) or
``P_hat = P`` (one term); it is symmetric, so ``Q = Q_n + D - Q_n Lambda`` has
the paper's force direction exactly. Since ``D = Q_n (I + G)^{-1} Y`` for an
invertible ``Q_n``, ``D^T D = Y^T (I + G)^{-1} Y`` and, with
``C = Q_n^T (Q_n + D) = I + G + Y``,

.. math::
  F = Q^T Q - I = G + Y + Y^T + D^T D - C^T \Lambda - \Lambda C + \Lambda (I + G) \Lambda .

The first-order terms leave ``G + 2T - 2 Lambda = -P_hat``, and
``Y^T Y - Y^T Lambda - Lambda Y + Lambda^2 = (Y - Lambda)^T (Y - Lambda)``
with ``Y - Lambda = A - E``, ``E = (G + P_hat) / 2``, equals
``P + [A, E] + E^2``, where ``[A, P_hat] = 0``. Collecting,

.. math::
  F = (P - \hat P) + \tfrac14 \hat P^2 + \tfrac12 [A, G] - \tfrac34 G^2
      - \tfrac14 (G \hat P + \hat P G) - (G T + T G) + \Lambda G \Lambda
      - Y^T G (I + G)^{-1} Y ,

an identity (checked to 1e-15 in float64 by the tests). The series'
remainder is ``P`` itself without the term, whose entries are
``|a_i . a_j| <= c(A)^2``, and ``P^2 / 4`` with it, whose entries are at
most ``||P||_2^2 / 4 <= ||A||_F^4 / 4``
(``(I - P)^{1/2} = I - P/2 - P^2/8 - ...``). Every other term carries the
anchor's defect, which the ``G / 2`` in the multiplier removes to first order,
so defects do not accumulate from step to step. With ``gamma = c(G)``,
``g = ||G||_F``, ``alpha = ||A||_F``, ``tau = ||T||_F``, ``pi = ||A||_F^2`` with
the term (0 without), ``c(Lambda) <= tau + (gamma + pi) / 2`` and
``c(Y) <= alpha + tau``,

.. math::
  \max_{ij} |F_{ij}| \le \beta_{od} = \rho
    + \gamma \big(\alpha + \tfrac34 \gamma + \tfrac12 \pi + 2 \tau\big)
    + g \Big(c(\Lambda)^2 + \frac{c(Y)^2}{1 - g}\Big) ,

``rho = c(A)^2`` without the term and ``pi^2 / 4`` with it. The term (one
product more) is taken only when the bound without it exceeds the budget.

A step so small that ``Q_n + D`` itself meets the budget needs no force at all
(``Lambda = 0``, as the paper's iteration stops before its first correction):
``(Q_n + D)^T (Q_n + D) - I = G + Y + Y^T + D^T D`` exactly, so
``max |F_ij| <= max |G + 2T| + c(D)^2``, and :func:`shake` returns ``Q_n + D``
without the product ``Q_n Lambda`` when this bound meets the budget.

RATTLE (:func:`rattle`, the underdamped A step). With a momentum ``Q_n Omega``,
``Omega`` skew (the cotangent space of a square ``Q_n``), the step is
``D = h Q_n Omega`` and ``A = h Omega``. The same multiplier without ``T``,
``Lambda = (G + P_hat) / 2``, gives ``Q = Q_n X`` with ``X = I + A - Lambda``
(again ``Q - Q_n - D = -Q_n Lambda``). Writing ``X^T (I + G) X`` with
``Z = A - Lambda``,

.. math::
  F = (P - \hat P) + \tfrac14 \hat P^2 - \tfrac34 G^2 - \tfrac14 (G \hat P + \hat P G)
      + \tfrac12 [G, A] + Z^T G Z ,

so that ``max |F_ij| <= beta_ud = rho + gamma (alpha + 3 gamma / 4 + pi / 2)
+ g c(Z)^2`` with ``c(Z) <= alpha + (gamma + pi) / 2``. RATTLE's momentum at
the new point, the cotangent projection of ``(Q - Q_n) / h``, is
``Q Omega`` whenever ``Q_n`` and ``Q`` are orthogonal, whatever symmetric
``Lambda`` was used: ``Q^T (Q - Q_n) = I - X^T`` has skew part ``A``. So the
body-frame momentum ``Omega`` is unchanged by the free flight, and the
momentum costs one product.

Rounding. The bounds hold in exact arithmetic for the computed ``G``, ``Y``
and ``P``. Float32 rounding adds to the defect the error of the computed
``G`` (off the diagonal about ``sqrt(s)`` units of roundoff times the entries'
size, about 1e-7 for ``s <= 512``; the diagonal is summed accurately, see
:func:`cola_jax.constraints.stiefel_projection.gram_minus_identity`) and the
rounding of ``Q`` itself (about 2e-8). A caller should give a budget of half
its tolerance, leaving the other half to rounding.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Appendix B.
  Leimkuhler and Reich, *Simulating Hamiltonian Dynamics*, 2004, ch. 7.
"""

from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from cola_jax.constraints.stiefel_projection import gram, gram_minus_identity

_HIGHEST = jax.lax.Precision.HIGHEST
Result = TypeVar("Result")


class AnchorDefect(NamedTuple):
  """``G = Q_n^T Q_n - I`` with the norms the bounds use."""

  matrix: jax.Array  # G
  largest_column: jax.Array  # c(G)
  frobenius: jax.Array  # ||G||_F if below 1, else inf (the bounds divide by 1 - ||G||_2)


class SquareStep(NamedTuple):
  matrix: jax.Array  # Q, (s, s)
  bound: jax.Array  # a proved bound on max |Q^T Q - I| in exact arithmetic


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HIGHEST)


def largest_column_norm(m: jax.Array) -> jax.Array:
  """``c(M) = max_j ||M e_j||_2``."""
  return jnp.sqrt(jnp.max(jnp.sum(m * m, axis=0)))


def unless(accepted: jax.Array, result: Result, fallback: Callable[[], Result]) -> Result:
  """``result`` if ``accepted``, else ``fallback()``: a while loop of at most one iteration.

  It skips the fallback when accepted (under ``vmap``: unless some member needs
  it), where ``lax.cond`` would become a select that always computes it.
  """
  result, _ = jax.lax.while_loop(lambda carry: carry[1], lambda _: (fallback(), jnp.array(False)), (result, ~accepted))
  return result


def anchor_defect(q_n: jax.Array) -> AnchorDefect:
  """``G`` of the anchor and its norms (one product, one reduction)."""
  g = gram_minus_identity(q_n)
  columns = jnp.sum(g * g, axis=0)
  frobenius = jnp.sqrt(jnp.sum(columns))
  return AnchorDefect(g, jnp.sqrt(jnp.max(columns)), jnp.where(frobenius < 1, frobenius, jnp.inf))


def _series_term(a, alpha, bound_without, budget):
  """``(P_hat, pi)``: ``P = A^T A`` and ``||A||_F^2`` if ``bound_without > budget``, else zeros."""
  zeros = (jnp.zeros_like(a), jnp.zeros((), a.dtype))
  return unless(bound_without <= budget, zeros, lambda: (_mm(a.T, a), alpha * alpha))


def shake(q_n: jax.Array, defect: AnchorDefect, step: jax.Array, budget, *, min_terms: int = -1) -> SquareStep:
  r"""``Q = Q_n + D - Q_n Lambda``, ``Lambda = T + (G + P_hat) / 2``, and its bound ``beta_od``.

  The cheapest of ``Lambda = 0``, ``P_hat = 0`` and ``P_hat = P`` whose bound
  meets ``budget`` (the last if none does).

  Args:
    q_n: the square anchor ``Q_n``.
    defect: its :class:`AnchorDefect`.
    step: the step ``D``.
    budget: a correction is added while the bound without it exceeds this.
    min_terms: -1 (``Lambda = 0`` allowed), 0 (at least ``T + G/2``) or 1 (the
      series term always), for tests of each bound.
  """
  y = gram(q_n, step)
  t = 0.5 * (y + y.T)
  moved = q_n + step
  unprojected = jnp.max(jnp.abs(defect.matrix + 2 * t)) + largest_column_norm(step) ** 2
  corrected = lambda: _shake(q_n, defect, y, t, moved, budget, min_terms)
  if min_terms < 0:
    return unless(unprojected <= budget, SquareStep(moved, unprojected), corrected)
  return corrected()


def _shake(q_n, defect, y, t, moved, budget, min_terms):
  a = 0.5 * (y - y.T)
  a_columns = jnp.sum(a * a, axis=0)
  alpha = jnp.sqrt(jnp.sum(a_columns))
  tau = jnp.sqrt(jnp.maximum(jnp.sum(y * y) - alpha * alpha, 0))
  gamma, g = defect.largest_column, defect.frobenius

  def bound(remainder, pi):
    c_multiplier = tau + 0.5 * (gamma + pi)
    return (
      remainder
      + gamma * (alpha + 0.75 * gamma + 0.5 * pi + 2 * tau)
      + g * (c_multiplier * c_multiplier + (alpha + tau) ** 2 / (1 - g))
    )

  p, pi = _series_term(a, alpha, bound(jnp.max(a_columns), 0) if min_terms < 1 else jnp.inf, budget)
  multiplier = t + 0.5 * (defect.matrix + p)
  q = moved - _mm(q_n, multiplier)
  return SquareStep(q, bound(jnp.where(pi > 0, 0.25 * pi * pi, jnp.max(a_columns)), pi))


def rattle(
  q_n: jax.Array, defect: AnchorDefect, vector: jax.Array, h, budget, *, min_terms: int = 0
) -> tuple[SquareStep, jax.Array]:
  r"""RATTLE's A step from the momentum ``Q_n Omega``, ``Omega = skew(Q_n^T v)``.

  ``Omega`` is the body-frame form of the cotangent projection of ``v``
  (exact for an orthogonal ``Q_n``), so ``v`` need not be cotangent. Returns
  ``Q = Q_n (I + h Omega - (G + P_hat) / 2)`` with its bound ``beta_ud``, and
  the momentum ``Q Omega`` at ``Q``.

  Args:
    q_n: the square anchor ``Q_n``.
    defect: its :class:`AnchorDefect`.
    vector: the ambient momentum ``v``.
    h: the time step.
    budget: the series term ``P`` is added when the bound without it exceeds this.
    min_terms: 0 (the term when needed) or 1 (always), for tests of each bound.
  """
  w = gram(q_n, vector)
  omega = 0.5 * (w - w.T)
  a = h * omega
  a_columns = jnp.sum(a * a, axis=0)
  alpha = jnp.sqrt(jnp.sum(a_columns))
  gamma, g = defect.largest_column, defect.frobenius

  def bound(remainder, pi):
    c_z = alpha + 0.5 * (gamma + pi)
    return remainder + gamma * (alpha + 0.75 * gamma + 0.5 * pi) + g * c_z * c_z

  p, pi = _series_term(a, alpha, bound(jnp.max(a_columns), 0) if min_terms < 1 else jnp.inf, budget)
  q = _mm(q_n, jnp.eye(a.shape[0], dtype=a.dtype) + a - 0.5 * (defect.matrix + p))
  step = SquareStep(q, bound(jnp.where(pi > 0, 0.25 * pi * pi, jnp.max(a_columns)), pi))
  return step, _mm(q, omega)
