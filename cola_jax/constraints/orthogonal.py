r"""Orthogonality constraint: orthonormal columns (tall) or rows (wide).

A leaf of shape ``(..., n)`` is viewed as the matrix ``W`` of shape
``(prod(shape[:-1]), n)``: for Flax's ``Dense`` kernel ``(in, out)`` and conv
kernel ``(kh, kw, in, out)`` the output units or filters are the columns. With
``s = min(rows, cols)`` the constraint is ``W^T W = I_s`` for a tall matrix and
``W W^T = I_s`` for a wide one. Internally both are the tall matrix
``Q`` (``W`` or ``W^T``) of shape ``(r, s)``, ``r >= s``, with ``Q^T Q = I_s``.

Projection onto the manifold after a step ``Q_bar = Q_n + D`` is the paper's
quasi-Newton iteration, which keeps ``Q_n`` as the direction of the constraint
force (so that it solves ``Q_{n+1} = Q_bar - Q_n Lambda`` with ``Lambda``
symmetric):

.. math::
  Q^{(k+1)} = Q^{(k)} - \tfrac12 Q_n \big(Q^{(k)T} Q^{(k)} - I_s\big),

run until ``max |Q^T Q - I| <= tolerance`` or ``max_iterations`` is reached.
It converges linearly, at a rate about the spectral norm of the tangential part
of the step, so a fixed iteration count has no error bound. Two faster solvers
of the same equation (same multiplier, same point, same dynamics) are options
(``projection=``, see :mod:`cola_jax.constraints.stiefel_projection`): Newton's
method for ``Lambda`` and a closed-form square root, both working on ``s x s``
matrices. A step that does not converge is flagged in the leaf's
:class:`ProjectionInfo` and finished with the polar projection (the nearest
orthonormal matrix), so the constraint holds after every update.

Extreme input. Steps of any finite size end on the manifold or flagged: a
projection that diverges is replaced by the polar factor of the unprojected
point, computed after an exact power-of-two scaling (``polar(c Q) =
polar(Q)``), so entries from ``1e-30`` to ``3e38`` are fine. An ``inf`` or NaN
in the gradient or the parameter gives a leaf of NaN with
``ProjectionInfo.converged`` False, without calling the SVD (LAPACK's would
not return). At ``h = 0`` the RATTLE impulse is 0: nothing moves.

The cotangent projection is
``Pi_Q P = P - 1/2 Q (P^T Q + Q^T P)``, and the A step is RATTLE: the position
is projected as above and the momentum is corrected by the same multiplier and
then projected onto the cotangent space at the new point.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Appendix B (o-CoLA-od, o-CoLA-ud).
  Leimkuhler and Reich, *Simulating Hamiltonian Dynamics*, 2004, ch. 7
  (RATTLE).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cola_jax import _noise
from cola_jax._hyperparameters import check_positive, check_positive_integer
from cola_jax._numerics import explicit_sharding, power_of_two_scale
from cola_jax.constraints import stiefel_projection
from cola_jax.constraints.base import Constraint

_HIGHEST = jax.lax.Precision.HIGHEST


def tall_view(w: jax.Array) -> jax.Array:
  """The ``(r, s)`` matrix, ``r >= s``, with orthonormal columns on the manifold."""
  matrix = w.reshape(-1, w.shape[-1])
  return matrix if matrix.shape[0] >= matrix.shape[1] else matrix.T


def from_tall_view(q: jax.Array, like: jax.Array) -> jax.Array:
  """Inverse of :func:`tall_view` for a leaf shaped like ``like``."""
  rows = like.size // like.shape[-1]
  matrix = q if rows >= like.shape[-1] else q.T
  return matrix.reshape(like.shape)


def gram_defect(q: jax.Array) -> jax.Array:
  """``Q^T Q - I`` at full float32 precision on every backend."""
  return stiefel_projection.gram(q, q) - jnp.eye(q.shape[1], dtype=q.dtype)


def polar_factor(q: jax.Array) -> jax.Array:
  """The nearest matrix with orthonormal columns, ``U V^T`` from ``Q = U S V^T``.

  ``Q`` is scaled by an exact power of two first (``polar(c Q) = polar(Q)``
  for ``c > 0``), so that the SVD sees entries of order one whatever their
  size (``1e-30`` to ``3e38``). A ``Q`` with an ``inf`` or NaN entry gives a
  matrix of NaN without calling the SVD, whose LAPACK iteration would not
  return on CPU.
  """
  sharding = jax.typeof(q).sharding
  replicated = stiefel_projection.replicated(q)
  if replicated is not None:  # explicit sharding: the SVD needs the whole matrix
    q = jax.sharding.reshard(q, replicated)
  finite = jnp.all(jnp.isfinite(q))
  scale = power_of_two_scale(jnp.max(jnp.abs(q)))
  # Eye in place of a non-finite matrix: the SVD always gets finite input.
  q = jnp.where(finite, q * scale, jnp.eye(*q.shape, dtype=q.dtype))
  u, _, vt = jnp.linalg.svd(q, full_matrices=False)
  polar = jnp.where(finite, jnp.matmul(u, vt, precision=_HIGHEST), jnp.nan)
  return polar if replicated is None else jax.sharding.reshard(polar, sharding)


def _polar_where(q: jax.Array, needed: jax.Array) -> jax.Array:
  """``polar_factor(q)`` where ``needed``, else ``q``; costs nothing when not needed.

  A ``lax.cond`` with a batched predicate becomes a select under ``vmap`` and
  would run the SVD for every seed at every step; a while loop of at most one
  iteration runs it only while some member of the batch needs it.
  """
  q, _ = jax.lax.while_loop(
      lambda carry: carry[1], lambda carry: (polar_factor(carry[0]), jnp.array(False)),
      (q, needed))
  return q


_SOLVERS = {
    "quasi_newton": stiefel_projection.quasi_newton_projection,
    "newton": stiefel_projection.newton_multiplier_projection,
    "square_root": stiefel_projection.square_root_projection,
}


class ProjectionInfo(NamedTuple):
  """Diagnostics of a leaf's last projection onto the orthogonal manifold."""

  iterations: jax.Array  # quasi-Newton iterations used
  converged: jax.Array  # False: the tolerance was not met and the polar factor was used

  def residual(self, param: jax.Array) -> jax.Array:
    """``max |Q^T Q - I|`` of the leaf, computed in at least float32."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    return jnp.max(jnp.abs(gram_defect(tall_view(param.astype(dtype)))))


class StiefelPoint(NamedTuple):
  matrix: jax.Array  # Q, (r, s) with r >= s
  info: ProjectionInfo


@dataclasses.dataclass(frozen=True)
class Orthogonal(Constraint):
  """Orthonormal columns (tall) or rows (wide) of the leaf viewed as a matrix.

  Args:
    tolerance: the projection stops once ``max |Q^T Q - I| <= tolerance``.
    max_iterations: the bound on quasi-Newton iterations per projection;
      a projection that reaches it without meeting the tolerance is finished
      with the polar factor and flagged (``ProjectionInfo.converged``).
    reproject_above: a parameter whose ``max |Q^T Q - I|`` exceeds this at the
      start of a step (it started off the manifold, or was changed outside the
      optimizer) is first replaced by its polar factor, the nearest orthonormal
      matrix. Rounding from ``params + updates`` stays far below it and is
      absorbed by the step's own projection.
    projection: how the multiplier of the constraint force ``-Q_n Lambda`` is
      found: ``"quasi_newton"`` (the paper's iteration), ``"newton"`` (Newton's
      method in ``s x s`` space, fastest for tall matrices) or ``"square_root"``
      (a closed form, exact for square matrices, then chord steps; fastest for
      large square steps). All three reach the same point. With the latter two
      ``ProjectionInfo.iterations`` counts Newton steps or series terms.

  Example:
    >>> import cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints={'kernel': cola.Orthogonal(), 'bias': None})
  """

  tolerance: float = 1e-6
  max_iterations: int = 20
  reproject_above: float = 1e-3
  projection: str = "quasi_newton"

  stack_same_shape = True

  def __post_init__(self):
    check_positive("Orthogonal", "tolerance", self.tolerance)
    check_positive("Orthogonal", "reproject_above", self.reproject_above)
    if self.projection not in _SOLVERS:
      raise ValueError(
          f"Orthogonal: projection must be one of {tuple(_SOLVERS)}, got {self.projection!r}.")
    check_positive_integer("Orthogonal", "max_iterations", self.max_iterations)

  def validate(self, param, path):
    if param.ndim < 2:
      raise ValueError(
          f"Orthogonal constraint on the leaf at {path}, of shape {param.shape}: "
          "it needs a matrix or a kernel (ndim >= 2). Leave biases and scales "
          "unconstrained (None).")

  def nearest(self, param):
    """The polar factor: the closest matrix with orthonormal columns (or rows)."""
    return from_tall_view(polar_factor(tall_view(param)), param)

  def init(self, param):
    return ProjectionInfo(iterations=jnp.zeros((), jnp.int32), converged=jnp.array(True))

  def point(self, param, aux):
    q = tall_view(param)
    # NaN and overflow count as off: the polar factor then shows them as NaN
    # (non-finite) or puts the parameter on the manifold (finite).
    off = ~(jnp.max(jnp.abs(gram_defect(q))) <= self.reproject_above)
    return StiefelPoint(_polar_where(q, off), aux)

  def unpack(self, point, param):
    return from_tall_view(point.matrix, param), point.info

  def ambient_gradient(self, point, grad):
    return tall_view(grad)

  def ambient_normal(self, key, point):
    return _noise.normal(key, point.matrix.shape, point.matrix.dtype,
                         out_sharding=explicit_sharding(point.matrix))

  def project(self, anchor, step):
    moved = anchor.matrix + step
    solve = _SOLVERS[self.projection]
    q, k, converged = solve(anchor.matrix, moved, self.tolerance, self.max_iterations, norm="max")
    # A diverged iteration is not finite: fall back from the unprojected point.
    q = jnp.where(jnp.all(jnp.isfinite(q)), q, moved)
    return StiefelPoint(_polar_where(q, ~converged), ProjectionInfo(k, converged))

  def cotangent(self, point, vector):
    q = point.matrix
    sym = stiefel_projection.gram(vector, q)
    return vector - 0.5 * jnp.matmul(q, sym + sym.T, precision=_HIGHEST)

  def cotangent_normal(self, key, point):
    return self.cotangent(point, self.ambient_normal(key, point))

  def load_momentum(self, stored):
    return tall_view(stored)

  def store_momentum(self, momentum, param):
    return from_tall_view(momentum, param)

  def a_step(self, point, momentum, h):
    step = h * momentum
    new = self.project(point, step)
    # RATTLE: the momentum takes the same constraint impulse as the position,
    # (Q_{n+1} - (Q_n + h P)) / h, then is projected onto the new cotangent
    # space. At h = 0 nothing moves and the impulse is 0.
    impulse = new.matrix - point.matrix - step
    moving = h != 0
    corrected = momentum + jnp.where(moving, impulse * (1 / jnp.where(moving, h, 1)), 0)
    return new, self.cotangent(new, corrected)
