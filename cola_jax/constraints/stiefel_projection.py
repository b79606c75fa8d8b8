r"""Projections onto the Stiefel manifold along the start-of-step normal.

All functions solve the same problem as the paper's o-CoLA step (Appendix B of
Leimkuhler, Pouchon, Vlaar, Storkey, OPT2020): given ``Q_n`` of shape
``(r, s)``, ``r >= s``, with ``Q_n^T Q_n = I`` and the unconstrained point
``Q_bar = Q_n + D``, find the symmetric multiplier ``Lambda`` with

.. math::
  Q = \bar Q - Q_n \Lambda, \qquad Q^T Q = I_s,

the root closest to ``Lambda = 0``. The constraint force ``-Q_n Lambda`` lies in
the normal space at ``Q_n`` (SHAKE). They differ only in how the root is found.

With ``B = Q_bar^T Q_bar``, ``C = Q_n^T Q_bar`` and ``Q_n^T Q_n = I`` the defect
of ``Q`` is an ``s x s`` function of the multiplier alone,

.. math::
  F(\Lambda) = Q^T Q - I = X^T X - K,
  \qquad X = C - \Lambda = Q_n^T Q, \qquad K = I + C^T C - B,

where ``K = I - D_\perp^T D_\perp`` (``D_perp`` the part of the step outside
the span of ``Q_n``; ``K = I`` for square matrices). A rounding defect
``G = Q_n^T Q_n - I`` of the anchor enters ``B - C^T C`` and so is accounted for,
up to ``O(|Lambda| |G|)``. Iterating on ``X`` costs ``O(s^3)`` per step instead
of ``O(r s^2)``; only forming ``B``, ``C``, the result and its final defect
touches the ``(r, s)`` matrices. Since ``Lambda`` is symmetric, the skew part
of ``X`` is fixed, ``skew(X) = A = (C - C^T) / 2``, and only ``S = sym(X)`` is
unknown: ``(S - A)(S + A) = K``.

* :func:`quasi_newton_projection`: the paper's iteration
  ``Q <- Q - 1/2 Q_n (Q^T Q - I)`` on the ``(r, s)`` matrix, i.e. the chord
  method ``Lambda <- Lambda + F(Lambda) / 2``. Its linear rate is about the
  spectral norm of ``A`` (the tangential part of the step), which grows like
  ``|D_ij| sqrt(s)``.
* :func:`newton_multiplier_projection`: Newton's method on ``Lambda`` in
  multiplier space. The Newton correction ``E`` solves the Lyapunov equation
  ``X^T E + E X = F``; with ``X = I + Delta`` it is solved by the sweeps
  ``E <- (F - E Delta - (E Delta)^T) / 2`` (one ``s^3`` product each, rate
  ``|Delta|``), stopped by a quadratic forcing term.
* :func:`square_root_projection`: the closed form of the commuting part,
  then the chord method in multiplier space. If ``K`` commutes with ``A`` (it
  is ``I`` for square matrices) the root is exactly
  ``S = (K + A^2)^{1/2} = (I - P)^{1/2}``, ``P = I - K + A^T A``, because any
  function of ``A^2`` commutes with ``A``; the binomial series
  ``sum_k binom(1/2, k) (-P)^k`` converges at the rate ``|P| ~ |A|^2``, twice
  the quasi-Newton's per product. For tall matrices the commutator
  ``[K, A]`` is left over and removed by the chord steps
  ``X <- X - F(X) / 2``, then the ``(r, s)`` defect is checked and, if
  rounding left it above the tolerance, finished by quasi-Newton steps.

Each returns :class:`Projection`: the point, the iterations used and whether
the defect ``|Q^T Q - I|`` (Frobenius norm, or the largest entry with
``norm='max'``) met the tolerance, measured on the returned matrix with
:func:`~cola_jax._numerics.max_abs` (NaN-safe), so ``converged`` is False for
any non-finite result; loops stop as soon as an iterate is not finite. None of
them falls back on its own: a caller that needs the constraint to hold takes
the polar factor when ``converged`` is False.

When there is no root. ``X = Q_n^T Q`` has spectral norm at most
``|Q_n|_2 |Q|_2 = 1``, and so has its skew part ``A``, which the multiplier
does not change: a step with ``|A|_2 > 1`` has no point of the manifold along
the normal space at ``Q_n`` (for any shape; all three solvers then diverge or
stall). :func:`tangential_norm_bound` gives a cheap lower bound of ``|A|_2``
to detect it before iterating.

Loops. By default (``fixed=False``) each loop is a ``lax.while_loop`` that
stops as soon as its test says so: the least work, but on a GPU each
iteration's test is read by the host before the next one starts. With
``fixed=True`` each loop runs its bound (``max_iterations``, ``max_sweeps``) as
a ``lax.fori_loop`` of static length whose iterations leave the carry as it is
once the test fails: the same iterates, counts and flags (the same arithmetic,
selected), no test read by the host, at the price of always doing the bound's
work (see :class:`~cola_jax.Orthogonal`'s ``loop`` for what it costs on a GPU).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax._numerics import bounded_while_loop, explicit_sharding, max_abs

_HIGHEST = jax.lax.Precision.HIGHEST


class Projection(NamedTuple):
  matrix: jax.Array  # Q, (r, s), Q^T Q = I to the tolerance when converged
  iterations: jax.Array  # loop iterations used (all loops together)
  converged: jax.Array  # whether the (r, s) defect met the tolerance


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HIGHEST)


def replicated(x):
  """``out_sharding`` for a small product reduced over ``x``'s sharded rows.

  Under explicit sharding (the default axis type of ``jax.make_mesh``) a
  contraction over a sharded axis needs its output sharding; the Gram-sized
  results here are replicated. Elsewhere (no mesh, auto axes) None: XLA decides.
  """
  sharding = explicit_sharding(x)
  return None if sharding is None else sharding.update(spec=jax.sharding.PartitionSpec())


def gram(a, b):
  """``a^T b``: an ``(s, s)`` product over rows at full float32 precision on
  every backend, replicated under explicit sharding (an all-reduce of the
  per-shard products)."""
  return jnp.matmul(a.T, b, precision=_HIGHEST, out_sharding=replicated(a))


def _size(m, norm):
  if norm == "fro":
    return jnp.sqrt(jnp.sum(m * m))
  if norm == "max":
    return max_abs(m)
  raise ValueError(f"norm must be 'fro' or 'max', got {norm!r}")


def _pending(size, bound, k, max_iterations):
  """Whether a loop goes on: ``size`` above ``bound`` and finite, fewer than ``max_iterations`` done.

  A diverged iterate (``inf`` or NaN, which :func:`_size` reports as ``inf``)
  stops the loop at once; the caller's final check flags it.
  """
  return (size > bound) & jnp.isfinite(size) & (k < max_iterations)


def _sym(m):
  return 0.5 * (m + m.T)


def defect(q, norm="fro"):
  """``|Q^T Q - I|`` in the given norm, products at full float32 precision."""
  return _size(gram(q, q) - jnp.eye(q.shape[1], dtype=q.dtype), norm)


def _finish(q_n, q, tolerance, max_iterations, norm, used, fixed):
  """Quasi-Newton steps on the ``(r, s)`` matrix until the tolerance is met."""
  eye = jnp.eye(q.shape[1], dtype=q.dtype)

  def not_done(carry):
    _, f, k = carry
    return _pending(_size(f, norm), tolerance, k, max_iterations)

  def step(carry):
    q, f, k = carry
    q = q - 0.5 * _mm(q_n, f)
    return q, gram(q, q) - eye, k + 1

  q, f, k = bounded_while_loop(not_done, step, (q, gram(q, q) - eye, used), max_iterations, fixed)
  return Projection(q, k, _size(f, norm) <= tolerance)


def tangential_norm_bound(q_n, q_bar):
  r"""A lower bound of ``|A|_2``, ``A = skew(Q_n^T Q_bar)``: the step has no root if it exceeds 1.

  Two power steps from a fixed probe ``v``: the bound is
  ``max(|A v| / |v|, |A^2 v| / |A v|)`` (the second, a Rayleigh quotient of
  ``A^T A`` one step further, is the larger by Cauchy-Schwarz). ``A`` is
  applied as ``(Q_n^T (Q_bar x) - Q_bar^T (Q_n x)) / 2``: eight matrix-vector
  products, ``O(r s)``, negligible beside a projection's ``O(r s^2)``. NaN or
  ``inf`` in the input gives a non-finite bound.
  """
  s = q_n.shape[1]
  probe = jnp.asarray(np.random.default_rng(0).standard_normal((s, 1)), q_n.dtype)

  def apply_a(x):
    return 0.5 * (gram(q_n, _mm(q_bar, x)) - gram(q_bar, _mm(q_n, x)))

  av = apply_a(probe)
  aav = apply_a(av)
  v2, av2, aav2 = (jnp.sum(x * x) for x in (probe, av, aav))
  return jnp.sqrt(jnp.maximum(av2 / v2, aav2 / jnp.where(av2 > 0, av2, 1)))


def quasi_newton_projection(q_n, q_bar, tolerance=1e-5, max_iterations=100, norm="fro", fixed=False):
  r"""The paper's iteration ``Q <- Q - 1/2 Q_n (Q^T Q - I)`` from ``Q = Q_bar``.

  Two ``(r, s) x (s, s)`` products per iteration; stops once
  ``|Q^T Q - I| <= tolerance`` or after ``max_iterations``.
  """
  return _finish(q_n, q_bar, tolerance, max_iterations, norm, jnp.zeros((), jnp.int32), fixed)


def _reduce(q_n, q_bar):
  """``C = Q_n^T Q_bar`` and ``K = I + C^T C - Q_bar^T Q_bar``."""
  c = gram(q_n, q_bar)
  k = jnp.eye(c.shape[0], dtype=c.dtype) + _sym(_mm(c.T, c) - gram(q_bar, q_bar))
  return c, k


def newton_multiplier_projection(
  q_n, q_bar, tolerance=1e-5, max_iterations=100, norm="fro", max_sweeps=30, fixed=False
):
  r"""Newton's method for the symmetric multiplier, in ``s x s`` space.

  From ``X = C`` (``Lambda = 0``, the paper's starting point) each step solves
  ``X^T E + E X = F(X)`` for the symmetric ``E`` by sweeps
  ``E <- (F - E Delta - (E Delta)^T) / 2``, ``Delta = X - I``, until a sweep
  changes ``E`` by less than ``min(1, |F|) |F| / 10`` (which keeps Newton's
  quadratic convergence) or ``tolerance / 8``, at most ``max_sweeps``; then
  ``X <- X - E``. It stops once ``|F| <= tolerance / 2``; ``Q = Q_bar - Q_n
  Lambda`` is then checked on the ``(r, s)`` matrix and finished by
  quasi-Newton steps if rounding left it above the tolerance. ``iterations``
  counts Newton steps plus those; the sweeps are not counted.
  """
  c, k_mat = _reduce(q_n, q_bar)
  eye = jnp.eye(c.shape[0], dtype=c.dtype)
  residual = lambda x: _sym(_mm(x.T, x)) - k_mat

  def lyapunov(x, f):
    delta = x - eye
    f_size = _size(f, "fro")
    target = jnp.maximum(jnp.minimum(f_size, 1.0) * f_size / 10, tolerance / 8)

    def not_done(carry):
      _, change, j = carry
      return (change > target) & (j < max_sweeps)

    def sweep(carry):
      e, _, j = carry
      m = _mm(e, delta)
      new = 0.5 * (f - m - m.T)
      return new, _size(new - e, "fro"), j + 1

    e, _, _ = bounded_while_loop(not_done, sweep, (0.5 * f, jnp.inf, jnp.zeros((), jnp.int32)), max_sweeps, fixed)
    return e

  def not_done(carry):
    _, f, k = carry
    return _pending(_size(f, norm), tolerance / 2, k, max_iterations)

  def newton(carry):
    x, f, k = carry
    x = x - lyapunov(x, f)
    return x, residual(x), k + 1

  x, _, k = bounded_while_loop(not_done, newton, (c, residual(c), jnp.zeros((), jnp.int32)), max_iterations, fixed)
  multiplier = _sym(c - x)
  return _finish(q_n, q_bar - _mm(q_n, multiplier), tolerance, max_iterations, norm, k, fixed)


def square_root_projection(q_n, q_bar, tolerance=1e-5, max_iterations=100, norm="fro", fixed=False):
  r"""The commuting closed form ``X = A + (I - P)^{1/2}``, then chord steps.

  ``A = skew(C)``, ``P = I - K + A^T A``. The series
  ``S = sum_k c_k P^k``, ``c_0 = 1``, ``c_k = c_{k-1} (k - 3/2) / k``, is summed
  until the geometric estimate of its tail, ``|T_k| q / (1 - q)`` with
  ``q = |T_k| / |T_{k-1}|`` (Frobenius), is below ``tolerance / 8``: the root
  for square matrices. For tall ones ``X <- X - (X^T X - K) / 2`` follows while
  ``|X^T X - K| > tolerance / 2``. Then ``Lambda = sym(C) - S``,
  ``Q = Q_bar - Q_n Lambda``, and the ``(r, s)`` defect is checked
  (quasi-Newton steps if it is above the tolerance). ``iterations`` counts
  series terms, chord steps and those.
  """
  c, k_mat = _reduce(q_n, q_bar)
  eye = jnp.eye(c.shape[0], dtype=c.dtype)
  a = 0.5 * (c - c.T)
  p = eye - k_mat + _sym(_mm(a.T, a))

  def more_terms(carry):
    _, _, size, ratio, k = carry
    tail = jnp.where(ratio < 1, size * ratio / (1 - ratio), jnp.inf)
    return (tail > tolerance / 8) & jnp.isfinite(size) & (k < max_iterations)

  def add_term(carry):
    s, term, size, _, k = carry
    k = k + 1
    term = _mm(term, p) * ((k - 1.5) / k).astype(p.dtype)
    new_size = _size(term, "fro")
    return s + term, term, new_size, new_size / size, k

  one = jnp.ones((), p.dtype)
  start = (eye, eye, one, one, jnp.zeros((), jnp.int32))
  s, _, _, _, k = bounded_while_loop(more_terms, add_term, start, max_iterations, fixed)
  s = _sym(s)
  if q_n.shape[0] > q_n.shape[1]:  # square: K = I up to the anchor's rounding, nothing left
    residual = lambda s: _sym(_mm(s - a, s + a)) - k_mat

    def not_done(carry):
      _, f, k = carry
      return _pending(_size(f, norm), tolerance / 2, k, max_iterations)

    def chord(carry):
      s, f, k = carry
      s = s - 0.5 * f
      return s, residual(s), k + 1

    s, _, k = bounded_while_loop(not_done, chord, (s, residual(s), k), max_iterations, fixed)
  multiplier = _sym(c) - s
  return _finish(q_n, q_bar - _mm(q_n, multiplier), tolerance, max_iterations, norm, k, fixed)
