r"""Orthogonality constraint: orthonormal columns (tall) or rows (wide).

A leaf of shape ``(..., n)`` is viewed as the matrix ``W`` of shape
``(prod(shape[:-1]), n)``: for Flax's ``Dense`` kernel ``(in, out)`` and conv
kernel ``(kh, kw, in, out)`` the output units or filters are the columns. With
``s = min(rows, cols)`` the constraint is ``W^T W = I_s`` for a tall matrix and
``W W^T = I_s`` for a wide one (``s^2 I_s`` with ``scale=s``: the same
geometry for ``W / s``, see :class:`Orthogonal`). Internally both are the tall matrix
``Q`` (``W`` or ``W^T``) of shape ``(r, s)``, ``r >= s``, with ``Q^T Q = I_s``.
``row_axes`` and ``column_axes`` choose other views: the named axes index the
rows and the columns, every other axis is a batch axis, and the leaf holds one
matrix per batch index, each on its own manifold (a conv kernel
``(kh, kw, in, out)`` with ``row_axes=2, column_axes=3`` is ``kh kw``
orthonormal ``in x out`` matrices). ``blocks=(m, n)`` splits each matrix of
the view into an ``m x n`` grid of equal blocks, each a matrix of its own (an
Equinox attention projection ``(heads * head_dim, in)`` with ``blocks=(heads,
1)`` is ``heads`` matrices ``(head_dim, in)``, each with orthonormal rows, the
heads not mutually orthogonal). Everything below then applies to each matrix,
``jax.vmap``-ed over the stack ``(b, r, s)``.

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
matrices. ``ProjectionInfo.converged`` is a promise: True means the point is
that root, with ``max |Q^T Q - I| <= tolerance`` (checked NaN-safely, see
:func:`~cola_jax._numerics.max_abs`). A step that does not converge is flagged
and finished with the polar projection (the nearest orthonormal matrix), so
the constraint holds after every update, and the RATTLE momentum is made
cotangent at the point reached.

No root. The multiplier leaves the skew part ``A`` of ``Q_n^T Q_bar``
unchanged and ``|Q_n^T Q|_2 <= 1`` on the manifold, so a step with
``|A|_2 > 1`` (a large tangential move, for any shape) has no root. A cheap
lower bound of ``|A|_2`` skips the solver for such steps (flagged at once);
near the limit the solvers slow down and are flagged when they run out of
iterations. Smaller steps (``h``) or gradient clipping avoid both.

Extreme input. Steps of any finite size end on the manifold or flagged: a
projection that diverges is replaced by the polar factor of the unprojected
point (of the last iterate if it stalled within 1/2 of the manifold),
computed after an exact power-of-two scaling (``polar(c Q) =
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
import functools
import math
from typing import NamedTuple, TypeGuard

import jax
import jax.numpy as jnp

from cola_jax import _compiled, _noise
from cola_jax._hyperparameters import check_loop, check_positive, check_positive_integer, check_static_positive
from cola_jax._numerics import (
  bounded_while_loop,
  explicit_sharding,
  max_abs,
  power_of_two_scale,
)
from cola_jax._platform import one_matrix_at_a_time
from cola_jax.constraints import _axes, stiefel_projection, stiefel_retraction
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.stiefel_retraction import gram_defect, polar_of_tangent_step

_HIGHEST = jax.lax.Precision.HIGHEST


def _view_axes(ndim, row_axes, column_axes):
  """(batch, rows, columns) axes of a rank-``ndim`` leaf, non-negative and sorted."""
  if row_axes is None:
    return (), tuple(range(ndim - 1)), (ndim - 1,)
  rows = tuple(sorted(a % ndim for a in _axes.normalize("tall_view", "row_axes", row_axes) or ()))
  columns = tuple(sorted(a % ndim for a in _axes.normalize("tall_view", "column_axes", column_axes) or ()))
  return _axes.others(ndim, rows, columns), rows, columns


def _split(stack: jax.Array, blocks: tuple[int, int]) -> jax.Array:
  """A stack ``(b, r, c)`` of matrices as the stack of their ``(r / m, c / n)`` blocks, ``blocks = (m, n)``.

  Each matrix's blocks in row-major order, one after another.
  """
  b, r, c = stack.shape
  m, n = blocks
  return _axes.to_parts(stack.reshape(b, m, r // m, n, c // n), (0, 1, 3), (2, 4))


def _join(parts: jax.Array, shape: tuple[int, int, int], blocks: tuple[int, int]) -> jax.Array:
  """Inverse of :func:`_split` for a stack of ``shape``."""
  b, r, c = shape
  m, n = blocks
  return _axes.from_parts(parts, (b, m, r // m, n, c // n), (0, 1, 3), (2, 4)).reshape(shape)


def _is_split(blocks) -> TypeGuard[tuple[int, int]]:
  return blocks is not None and blocks != (1, 1)


def tall_view(w: jax.Array, row_axes=None, column_axes=None, blocks=None) -> jax.Array:
  """The ``(r, s)`` matrix, ``r >= s``, with orthonormal columns on the manifold.

  ``row_axes``, ``column_axes`` and ``blocks`` as for :class:`Orthogonal`;
  with batch axes or blocks the result is the stack ``(b, r, s)`` of the
  leaf's ``b`` matrices.

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.constraints import tall_view, from_tall_view
    >>> w = jnp.arange(6.0).reshape(2, 3)  # a wide kernel: viewed as its (3, 2) transpose
    >>> tall_view(w).shape, bool((from_tall_view(tall_view(w), w) == w).all())
    ((3, 2), True)
  """
  blocks = _axes.blocks("tall_view", blocks)
  if row_axes is None and not _is_split(blocks):
    matrix = w.reshape(-1, w.shape[-1])
  else:
    batch, rows, columns = _view_axes(w.ndim, row_axes, column_axes)
    sizes = (math.prod(w.shape[a] for a in rows), math.prod(w.shape[a] for a in columns))
    matrix = _axes.to_parts(w, batch, rows + columns).reshape(
      (math.prod(w.shape[a] for a in batch),) * (bool(batch) or _is_split(blocks)) + sizes
    )
    if _is_split(blocks):
      matrix = _split(matrix, blocks)
  return matrix if matrix.shape[-2] >= matrix.shape[-1] else jnp.swapaxes(matrix, -1, -2)


def from_tall_view(q: jax.Array, like: jax.Array, row_axes=None, column_axes=None, blocks=None) -> jax.Array:
  """Inverse of :func:`tall_view` for a leaf shaped like ``like``."""
  blocks = _axes.blocks("from_tall_view", blocks)
  if row_axes is None and not _is_split(blocks):
    rows = like.size // like.shape[-1]
    matrix = q if rows >= like.shape[-1] else q.T
    return matrix.reshape(like.shape)
  batch, rows, columns = _view_axes(like.ndim, row_axes, column_axes)
  r, c = math.prod(like.shape[a] for a in rows), math.prod(like.shape[a] for a in columns)
  m, n = blocks if _is_split(blocks) else (1, 1)
  matrix = jnp.swapaxes(q, -1, -2) if r // m < c // n else q
  if _is_split(blocks):
    matrix = _join(matrix, (math.prod(like.shape[a] for a in batch), r, c), (m, n))
  return _axes.from_parts(matrix, like.shape, batch, rows + columns)


def _each(fn, matrices: jax.Array) -> jax.Array:
  """``fn`` of one matrix, mapped over a stack of them."""
  return fn(matrices) if matrices.ndim == 2 else jax.vmap(fn)(matrices)


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
  scale = power_of_two_scale(max_abs(q))
  # Eye in place of a non-finite matrix: the SVD always gets finite input.
  q = jnp.where(finite, q * scale, jnp.eye(*q.shape, dtype=q.dtype))
  u, _, vt = one_matrix_at_a_time(functools.partial(jnp.linalg.svd, full_matrices=False))(q)
  polar = jnp.where(finite, jnp.matmul(u, vt, precision=_HIGHEST), jnp.nan)
  return polar if replicated is None else jax.sharding.reshard(polar, sharding)


def _times(x: jax.Array, scale: float) -> jax.Array:
  """``scale x``; ``x`` itself, bit for bit, at scale 1 (the default, which the unscaled manifold keeps)."""
  return x if scale == 1 else x * scale


def _over(x: jax.Array, scale: float) -> jax.Array:
  """``x / scale``; ``x`` itself at scale 1."""
  return x if scale == 1 else x / scale


def _polar_where(
  q: jax.Array, needed: jax.Array, moved: jax.Array | None = None, fixed: bool = False, scale: float = 1.0
) -> jax.Array:
  """``scale polar_factor(q)`` where ``needed``, else ``q``.

  With ``moved`` (the unprojected point of a projection that ended as ``q``)
  the polar factor is taken of :func:`_fallback_start`. A ``lax.cond`` with a
  batched predicate becomes a select under ``vmap`` and would run the SVD for
  every seed at every step; a while loop of at most one iteration runs it only
  while some member of the batch needs it. With ``fixed`` (no host round
  trip) the SVD always runs and is selected.
  """
  start = (lambda q: q) if moved is None else (lambda q: _fallback_start(q, moved))
  polar = lambda carry: (_times(polar_factor(start(carry[0])), scale), jnp.array(False))
  q, _ = bounded_while_loop(lambda carry: carry[1], polar, (q, needed), 1, fixed)
  return q


def _fallback_start(q: jax.Array, moved: jax.Array) -> jax.Array:
  """The matrix whose polar factor ends an unconverged projection.

  The last iterate where it is finite and within 1/2 of the manifold (the
  iteration stalled near the root, whose polar factor it then approximates),
  else the unprojected point ``Q_n + D`` (no root, divergence, non-finite
  input). Only read where the projection did not converge.
  """
  near = max_abs(gram_defect(q)) <= 0.5  # NaN-safe: False for a non-finite q
  return jnp.where(near, q, moved)


_RETRACTIONS = ("newton_schulz", "qr", "polar")

_SOLVERS = {
  "quasi_newton": stiefel_projection.quasi_newton_projection,
  "newton": stiefel_projection.newton_multiplier_projection,
  "square_root": stiefel_projection.square_root_projection,
}


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["iterations", "converged"],
  meta_fields=["row_axes", "column_axes", "scale", "blocks"],
)
@dataclasses.dataclass(frozen=True)
class ProjectionInfo:
  """Diagnostics of a leaf's last projection onto the orthogonal manifold.

  For a leaf of several matrices (``Orthogonal`` with batch axes) they are
  aggregated: the most iterations any matrix used, and converged only if every
  matrix converged. ``row_axes``, ``column_axes`` and ``blocks`` (static) are
  the leaf's view, so that the residual can form its matrices, and ``scale`` (static)
  the constraint's ``W^T W = scale^2 I``. After a retraction
  (:func:`~cola_jax.constrained`) they describe it instead: see
  ``Orthogonal``'s ``retraction``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.o_cola_od(0.1)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> info = state.constraint_states['w']  # the step's projection
    >>> bool(info.converged), int(info.iterations) > 0
    (True, True)
  """

  iterations: jax.Array  # solver iterations used (0: the step has no root, detected before iterating)
  # True: the point is the root along the start's normal space, max |Q^T Q - I| <= tolerance.
  # False: no root, not reached in max_iterations, or non-finite; the polar factor was used.
  converged: jax.Array
  row_axes: tuple[int, ...] | None = None
  column_axes: tuple[int, ...] | None = None
  scale: float = 1.0
  blocks: tuple[int, int] | None = None

  def residual(self, param: jax.Array) -> jax.Array:
    """``max |Q^T Q / scale^2 - I|`` over the leaf's matrices, computed in at least float32."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    q = tall_view(param.astype(dtype), self.row_axes, self.column_axes, self.blocks)
    return max_abs(_each(gram_defect, _over(q, self.scale)))


class StiefelPoint(NamedTuple):
  """The point of an :class:`Orthogonal` leaf: its tall matrix view and the diagnostics of its last projection.

  What :meth:`Orthogonal.point`, :meth:`~Orthogonal.project`,
  :meth:`~Orthogonal.a_step` and :meth:`~Orthogonal.retract` return, and
  what :meth:`~Orthogonal.unpack` turns back into the leaf; a constraint
  built on :class:`Orthogonal` (:class:`~cola_jax.MaxSpectralNorm`) reads its
  ``matrix``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> w = jnp.eye(3)[:, :2]
    >>> orthogonal = cola.Orthogonal()
    >>> point = orthogonal.point(w, orthogonal.init(w))
    >>> type(point).__name__, point.matrix.shape
    ('StiefelPoint', (3, 2))
  """

  matrix: jax.Array  # Q, (r, s) with r >= s; (b, r, s) for a leaf of b matrices
  info: ProjectionInfo


def _per_matrix(*in_axes):
  """Maps a method written for one ``(r, s)`` matrix over the matrices of a leaf.

  The method takes a :class:`StiefelPoint` and further arguments, stacked like
  the point's matrices where ``in_axes`` says 0 and shared where it says None.
  The :class:`ProjectionInfo` in its result is aggregated over the matrices and
  labelled with the constraint's view.
  """

  def decorate(method):
    @functools.wraps(method)
    def mapped(self, point, *args):
      if point.matrix.ndim == 2:
        out = method(self, point, *args)
      else:
        in_axes_of_point = StiefelPoint(0, None)  # pyright: ignore[reportArgumentType]
        out = jax.vmap(functools.partial(method, self), in_axes=(in_axes_of_point, *in_axes))(point, *args)
      return jax.tree.map(self._aggregate, out, is_leaf=lambda node: isinstance(node, ProjectionInfo))

    return mapped

  return decorate


@dataclasses.dataclass(frozen=True)
class Orthogonal(Constraint):
  """Orthonormal columns (tall) or rows (wide) of the leaf viewed as a matrix.

  Args:
    tolerance: the projection stops once ``max |Q^T Q - I| <= tolerance``;
      the ``"newton_schulz"`` and ``"qr"`` retractions check the same, with
      the tolerance raised to what float32 rounding leaves (``2 sqrt(r) eps``,
      :func:`~cola_jax.constraints.stiefel_retraction.rounding_floor`).
    max_iterations: the bound on quasi-Newton iterations per projection;
      a projection that reaches it without meeting the tolerance is finished
      with the polar factor and flagged (``ProjectionInfo.converged``). It
      bounds the Newton-Schulz iterations of a retraction too.
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
    row_axes: the axes of the leaf that index the matrix's rows (an int or a
      tuple; negative values count from the end), given together with
      ``column_axes``. Every axis named by neither is a batch axis: the leaf
      holds one matrix per index of the batch axes, each constrained on its
      own (as torch's ``orthogonal`` parametrization does with every axis but
      the last two: on a Flax conv kernel ``(kh, kw, in, out)`` its
      ``nn.Conv2d`` semantics are ``row_axes=0, column_axes=1``). ``None``
      (both, the default): the rows are every axis but the last, the columns
      the last.
      A 3-D leaf whose path does not say conv (a Flax
      query, key or value kernel, a stack of layers) meets the default with a warning
      naming it and the axes to give; an attention output kernel ``(heads, head_dim,
      features)`` is the layer's matrix as it stands, quietly (docs/guides/declared_constraints.md,
      "Attention").
    column_axes: the axes that index the columns, as ``row_axes``.
    loop: ``"while"`` (the default) stops each loop as soon as its test is
      met and runs the SVD of a fallback only when one is needed.
      ``"fixed"`` runs every loop for its bound, the iterations after
      convergence masked, and always computes the fallbacks (two SVDs per
      matrix and step), selected where needed: the same point, iterations and
      flag with no loop whose end the host must read (a GPU reads every
      ``while`` test before the next iteration). On a GPU it is the slower
      form by far; it is there for programs that must not synchronise with
      the host.
    retraction: how :meth:`retract` (the step of :func:`~cola_jax.constrained`;
      ``cola_od`` and ``cola_ud`` project instead) takes ``Q`` along a tangent
      step ``xi`` (see :mod:`~cola_jax.constraints.stiefel_retraction`):
      ``"newton_schulz"`` (the default) and ``"polar"`` give the polar factor
      of ``Q + xi``, the nearest orthonormal matrix, the first by degree-5
      Newton-Schulz iterations (matrix products; an ``s x s``
      eigendecomposition only for a step too large for them, ``|xi|_2``
      above about 1.2), the second by that eigendecomposition always;
      ``"qr"`` gives ``qf(Q + xi)`` (positive diagonal of ``R``), a
      first-order retraction, another point by ``O(|xi|^2)``.
      ``"newton_schulz"`` and ``"qr"`` flag in ``ProjectionInfo.converged`` a
      point that misses the tolerance (or is not finite), ``"polar"`` one
      that is not finite;
      ``ProjectionInfo.iterations`` counts Newton-Schulz iterations. Measured
      on CPU (``results/cost/retractions.json``, 2 cores shared with other
      jobs, medians of interleaved calls, a step ``|xi|_2 = 0.05``, float32),
      ms per retraction at 512 x 512, 1024 x 256 and 4096 x 1024:
      ``"newton_schulz"`` 12.7, 3.9 and 308; ``"qr"`` 14.5, 7.6 and 595;
      ``"polar"`` 28.3, 8.0 and 613. The step of Flax's LSTM seq2seq
      example (eight 512 x 512 kernels Orthogonal) under
      ``constrained(optax.adam)`` costs 2.38, 2.70 and 2.81 times Adam's
      (``results/cost/seq2seq.json``), where the seven ``s^3`` products per
      kernel that any verified Riemannian step by matrix products makes
      already cost 1.93 times.
    scale: ``s > 0``, the manifold ``W^T W = s^2 I`` (tall) or
      ``W W^T = s^2 I`` (wide): every singular value of each matrix is ``s``
      (the scaled Stiefel manifold). The projection, the cotangent space,
      the A step, the retractions and the noise are those of the unit
      manifold for ``W / s`` read in ``W``'s units (the normal space at
      ``s U`` is ``U``'s), so the dynamics is Langevin in ``W`` itself;
      ``tolerance`` and ``reproject_above`` bound ``max |W^T W / s^2 - I|``,
      and :meth:`nearest` is ``s`` times the polar factor. One number per
      constraint: for the ``sqrt(fan_out / fan_in)`` convention (modula's
      orthogonal atoms, unit RMS-to-RMS norm; a Dense kernel ``(in, out)``
      has ``fan_in = in``, ``fan_out = out``) give each leaf its own, as in
      the example below.
    blocks: ``(m, n)``, two positive ints: each matrix of the view split into
      an ``m x n`` grid of equal blocks, each block a matrix of its own, on
      its own manifold (as a batch axis makes them). ``(heads, 1)`` splits the
      rows: an Equinox attention projection ``(heads * head_dim, in)`` gets
      per-head orthonormal rows, ``B_h B_h^T = I`` for each head's block
      ``B_h``, and the heads are not orthogonal to each other (``Orthogonal()``
      would make all ``heads * head_dim`` rows orthonormal together).
      ``(1, heads)`` splits the columns, for a Flax ``(in, heads * head_dim)``
      kernel. The view's rows and columns must split evenly (a ValueError
      naming the leaf). ``None`` (the default) or ``(1, 1)``: the whole matrix.

  A leaf with batch axes steps its matrices independently (the geometry is
  ``jax.vmap``-ed over them; the noise is independent per entry, so per
  matrix); its :class:`ProjectionInfo` holds the most iterations any of them
  used and whether all converged. The momentum of ``cola_ud`` is stored shaped
  like the leaf.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> kernel = jnp.array([[2.0, 0.0], [0.0, 0.5], [0.0, 0.0]])
    >>> cola.Orthogonal().nearest(kernel)  # where the first update starts: the polar factor
    Array([[1., 0.], [0., 1.], [0., 0.]], dtype=float32)
    >>> tx = cola.cola_od(0.1, constraints={'kernel': cola.Orthogonal(), 'bias': None})
    >>> # A conv kernel (kh, kw, in, out) as kh * kw orthonormal (in, out) matrices.
    >>> per_tap = cola.Orthogonal(row_axes=2, column_axes=3)

    Scaled, ``W^T W = 4 I``; and ``sqrt(fan_out / fan_in)`` per Dense kernel:

    >>> cola.Orthogonal(scale=2.0).nearest(kernel)
    Array([[2., 0.], [0., 2.], [0., 0.]], dtype=float32)
    >>> import math, jax
    >>> by_fans = lambda params: jax.tree.map(
    ...     lambda p: cola.Orthogonal(scale=math.sqrt(p.shape[-1] / p.shape[0])) if p.ndim == 2 else None, params)
    >>> by_fans({'kernel': jnp.zeros((512, 128)), 'bias': jnp.zeros(128)})['kernel'].scale
    0.5
    >>> tx = cola.cola_od(0.1, constraints=by_fans)

    Per head, on an ``(heads * head_dim, in)`` weight (Equinox's layout):

    >>> q = cola.Orthogonal(blocks=(2, 1)).nearest(jnp.arange(24.0).reshape(4, 6) % 5)
    >>> bool(jnp.allclose(q[:2] @ q[:2].T, jnp.eye(2), atol=1e-6)), bool(jnp.allclose(q[:2] @ q[2:].T, 0))
    (True, False)
  """

  tolerance: float = 1e-6
  max_iterations: int = 20
  reproject_above: float = 1e-3
  projection: str = "quasi_newton"
  row_axes: tuple[int, ...] | None = None  # ints are accepted and stored as tuples
  column_axes: tuple[int, ...] | None = None
  loop: str = "while"
  retraction: str = "newton_schulz"
  scale: float = 1.0
  blocks: tuple[int, int] | None = None  # a list is accepted and stored as a tuple

  project_noise_with_force = True

  def __post_init__(self):
    check_positive("Orthogonal", "tolerance", self.tolerance)
    check_positive("Orthogonal", "reproject_above", self.reproject_above)
    if self.projection not in _SOLVERS:
      raise ValueError(f"Orthogonal: projection must be one of {tuple(_SOLVERS)}, got {self.projection!r}.")
    check_positive_integer("Orthogonal", "max_iterations", self.max_iterations)
    check_loop("Orthogonal", self.loop)
    if self.retraction not in _RETRACTIONS:
      raise ValueError(f"Orthogonal: retraction must be one of {_RETRACTIONS}, got {self.retraction!r}.")
    rows, columns = _axes.matrix_axes("Orthogonal", self.row_axes, self.column_axes)
    object.__setattr__(self, "row_axes", rows)  # lists become tuples: hashable
    object.__setattr__(self, "column_axes", columns)
    object.__setattr__(self, "scale", check_static_positive("Orthogonal", "scale", self.scale))
    object.__setattr__(self, "blocks", _axes.blocks("Orthogonal", self.blocks))

  def validate(self, param, path):
    if param.ndim < 2:
      raise ValueError(
        f"Orthogonal constraint on the leaf at {path}, of shape {param.shape}: "
        "it needs a matrix or a kernel (ndim >= 2). Leave biases and scales "
        "unconstrained (None)."
      )
    if self.row_axes is not None and self.column_axes is not None:
      _axes.resolve(
        f"Orthogonal constraint on the leaf at {path}, of shape {param.shape}",
        param.shape,
        row_axes=self.row_axes,
        column_axes=self.column_axes,
      )
    else:
      spell = lambda rows, columns: f"Orthogonal(row_axes={rows}, column_axes={columns})"
      _axes.warn_if_ambiguous("Orthogonal constraint", param.shape, path, spell)
    blocks = self.blocks
    if _is_split(blocks):
      self._check_blocks(blocks, param.shape, path)

  def _check_blocks(self, blocks: tuple[int, int], shape: tuple[int, ...], path: str) -> None:
    """Raises ValueError naming the leaf unless ``blocks`` splits the rows and the columns of its view evenly."""
    _, rows, columns = _view_axes(len(shape), self.row_axes, self.column_axes)
    r, c = math.prod(shape[a] for a in rows), math.prod(shape[a] for a in columns)
    for count, size, what in zip(blocks, (r, c), ("rows", "columns")):
      if size % count:
        raise ValueError(
          f"Orthogonal constraint on the leaf at {path}, of shape {shape}: blocks={self.blocks} splits the {size} "
          f"{what} of its ({r}, {c}) matrix into {count} blocks, and {size} is not a multiple of {count}."
        )

  # The view: the leaf as the tall matrix Q, or a stack of them.

  def _tall(self, w):
    return tall_view(w, self.row_axes, self.column_axes, self.blocks)

  def _untall(self, q, like):
    return from_tall_view(q, like, self.row_axes, self.column_axes, self.blocks)

  def _view_and_scale(self):
    return self.row_axes, self.column_axes, self.scale, self.blocks

  def _aggregate(self, node):
    """A matrix's or a stack's :class:`ProjectionInfo` as the leaf's; other nodes as they are."""
    if not isinstance(node, ProjectionInfo):
      return node
    return ProjectionInfo(jnp.max(node.iterations), jnp.all(node.converged), *self._view_and_scale())

  # The manifold.

  def nearest(self, param):
    """``scale`` times the polar factor: the closest matrix of the manifold."""
    return _compiled.call(_polar_factor_of_leaf, (self,), param)

  def init(self, param):
    return ProjectionInfo(
      iterations=jnp.zeros((), jnp.int32),
      converged=jnp.array(True),
      row_axes=self.row_axes,
      column_axes=self.column_axes,
      scale=self.scale,
      blocks=self.blocks,
    )

  def point(self, param, aux):
    return self._reproject(StiefelPoint(self._tall(param), aux))

  @_per_matrix()
  def _reproject(self, point):
    q = point.matrix
    # NaN and overflow count as off: the polar factor then shows them as NaN
    # (non-finite) or puts the parameter on the manifold (finite).
    off = ~(max_abs(gram_defect(_over(q, self.scale))) <= self.reproject_above)
    return StiefelPoint(_polar_where(q, off, fixed=self.loop == "fixed", scale=self.scale), point.info)

  def unpack(self, point, param):
    return self._untall(point.matrix, param), point.info

  def residual(self, param, aux):
    """:meth:`ProjectionInfo.residual`."""
    return aux.residual(param)

  def ambient_gradient(self, point, grad):
    return self._tall(grad)

  def ambient_normal(self, key, point):
    m = point.matrix
    return _noise.normal_paired(key, m.shape, m.dtype, out_sharding=explicit_sharding(m))

  def _has_root(self, q_n, step, fixed: bool):
    """False where the step provably has no root along the normal space at ``Q_n`` (or is not finite).

    A root ``Q`` has ``|A|_2 <= |Q_n|_2 |Q|_2`` (see
    :func:`~cola_jax.constraints.stiefel_projection.tangential_norm_bound`);
    the anchor's defect (at most ``reproject_above`` per entry) and the root's
    (``tolerance``) enter that product through ``|Q|_2^2 <= 1 + s |Q^T Q - I|_max``.
    A step ``D`` with ``|D|_F <= 1/2`` needs no bound: ``Q_n^T Q_n`` is
    symmetric, so ``|A|_2 = |skew(Q_n^T D)|_2 <= |Q_n|_2 |D|_F``, a quarter of
    the limit at most. Training steps are that small: one fused pass over the
    step then replaces the bound's eight matrix-vector products (with
    ``fixed``, no branch: the bound is always computed).
    """
    s = q_n.shape[1]
    bound = (1 + s * self.tolerance) * (1 + s * self.reproject_above)
    has_root = lambda: stiefel_projection.tangential_norm_bound(q_n, q_n + step) ** 2 <= bound
    if fixed:
      return has_root()
    small = jnp.sum(step * step) <= 0.25  # NaN and inf: False, and the bound shows them
    return jax.lax.cond(small, lambda: jnp.array(True), has_root)

  @_per_matrix(0)
  def project(self, anchor, step):
    # Solved for the unit matrices Q / scale: the normal space at Q_n is the same, and so is the root, scaled.
    q_n, step = _over(anchor.matrix, self.scale), _over(step, self.scale)
    moved = q_n + step
    fixed = self.loop == "fixed"
    solve = functools.partial(
      _SOLVERS[self.projection], tolerance=self.tolerance, max_iterations=self.max_iterations, norm="max", fixed=fixed
    )
    # The solver runs only where a root may exist: a while loop of at most one
    # iteration (under vmap it runs once if any member needs it).
    q, k, converged, _ = bounded_while_loop(
      lambda carry: carry[3],
      lambda carry: (*solve(q_n, moved), jnp.array(False)),
      (moved, jnp.zeros((), jnp.int32), jnp.array(False), self._has_root(q_n, step, fixed)),
      1,
      fixed,
    )
    return StiefelPoint(_times(_polar_where(q, ~converged, moved, fixed), self.scale), ProjectionInfo(k, converged))

  @_per_matrix(0)
  def cotangent(self, point, vector):
    q = _over(point.matrix, self.scale)  # Pi P = P - U sym(U^T P), U = Q / scale
    sym = stiefel_projection.gram(vector, q)
    return vector - 0.5 * jnp.matmul(q, sym + sym.T, precision=_HIGHEST)

  def load_momentum(self, stored):
    return self._tall(stored)

  def store_momentum(self, momentum, param):
    return self._untall(momentum, param)

  def retract(self, point, tangent):
    """The point reached from ``Q`` by the tangent step ``xi``, by the constraint's ``retraction``.

    Its :class:`ProjectionInfo`: with ``"polar"``
    (:func:`~cola_jax.constraints.stiefel_retraction.polar_of_tangent_step`)
    no iterations, converged where the result is finite; with
    ``"newton_schulz"`` the Newton-Schulz iterations and the check of
    ``max |Q^T Q - I|``; with ``"qr"`` no iterations and the same check.
    """
    if self.retraction == "polar":
      matrix = _times(_each(polar_of_tangent_step, point.matrix + tangent), self.scale)
      finite = jnp.all(jnp.isfinite(matrix))
      return StiefelPoint(matrix, ProjectionInfo(jnp.zeros((), jnp.int32), finite, *self._view_and_scale()))
    return self._verified_retract(point, tangent)

  @_per_matrix(0)
  def _verified_retract(self, point, tangent):
    """``polar(Q + xi)`` by Newton-Schulz iterations or ``qf(Q + xi)``, with ``max |Q^T Q - I|`` checked."""
    moved = _over(point.matrix + tangent, self.scale)
    if self.retraction == "qr":
      matrix, converged = stiefel_retraction.qr_retraction(moved, tolerance=self.tolerance)
      iterations = jnp.zeros((), jnp.int32)
    else:
      matrix, iterations, converged = stiefel_retraction.newton_schulz_polar(
        moved, tolerance=self.tolerance, max_iterations=self.max_iterations, fixed=self.loop == "fixed"
      )
    return StiefelPoint(_times(matrix.astype(moved.dtype), self.scale), ProjectionInfo(iterations, converged))

  @_per_matrix(0, None)
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


def _polar_factor_of_leaf(constraint: Orthogonal, param: jax.Array) -> jax.Array:
  return constraint._untall(_times(_each(polar_factor, constraint._tall(param)), constraint.scale), param)
