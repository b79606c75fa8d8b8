r"""Spectral-norm ball: ``sigma_max(W) <= r`` for the leaf viewed as a matrix, through a slack matrix.

The leaf is viewed as :class:`~cola_jax.Orthogonal` views it: the tall matrix
``W`` of shape ``(n, s)``, ``n >= s`` (a wide view transposed, which keeps its
singular values), or a stack of them with ``row_axes``/``column_axes``. The
ball is the shadow of a scaled Stiefel manifold, as the interval
``|theta| <= r`` is the shadow of the circle (:class:`~cola_jax.Circle`): with
a slack matrix ``S`` of shape ``(s, s)``,

.. math::
  g(W, S) = W^T W + S^T S - r^2 I_s = 0,
  \qquad Q = \begin{bmatrix} W \\ S \end{bmatrix}, \quad Q^T Q = r^2 I_s,

so ``Q`` moves on ``r V_s(R^{n+s})`` and ``W^T W = r^2 I - S^T S <= r^2 I``:
every singular value of ``W`` is at most ``r``, and every ``W`` of the ball
has such an ``S`` (``(r^2 I - W^T W)^{1/2}``; ``s`` rows are needed, since at
``W = 0`` the slack has rank ``s``). With ``s = 1`` this is
``MaxNorm(r, axis="all")`` on a vector, with ``n = s = 1`` the circle.

Everything after the stacking is :class:`~cola_jax.Orthogonal` with
``scale=r`` on the ``(n + s, s)`` matrix ``Q``: the SHAKE projection along the
normal space at ``Q_n`` (the paper's quasi-Newton iteration, flagged and
finished by the polar factor where it does not converge), the cotangent
projection, the RATTLE A step, the retraction of
:func:`~cola_jax.constrained`. The loss gradient is ``(dV/dW, 0)`` (zero on the
slack) and the noise is independent per entry of ``Q``, slack included, as
for the circle. The momentum of ``cola_ud`` (and what ``constrained``'s inner
optimizer sees) is the ambient ``(n + s, s)`` tangent matrix, stacked like
``Q`` (``(b, n + s, s)`` with batch axes): the tangent space has dimension
``n s + s (s - 1) / 2``, more than the leaf's ``n s`` entries.

Invariant law. With zero gradient the dynamics of ``Q`` is that of
``Orthogonal(scale=r)`` on ``(n + s) x s`` matrices, equivariant under
``Q -> U Q V`` (``U``, ``V`` orthogonal), so its invariant law is the uniform
(Haar) law of ``Q / r`` on ``V_s(R^{n+s})``, for every step size; at
temperature ``tau`` CoLA samples ``exp(-V(W) / tau)`` times that law (the
surface measure of the manifold), up to the discretisation bias. ``W / r`` is
then the top ``n x s`` block of the first ``s`` columns of a Haar matrix of
``O(n + s)``, whose density on ``{|W|_2 < r}`` (a truncated Haar matrix with
``p + q = N``: Collins 2005; Eaton, *Multivariate Statistics*, 1983, Prop. 7.3)
is, for ``W`` alone,

.. math::
  p(W) \propto \det\big(r^2 I_s - W^T W\big)^{-1/2}\, e^{-V(W)/\tau},

the matrix arcsine law (``n = s = 1``: the circle's ``(r^2 - theta^2)^{-1/2}``;
``s = 1``: the max-norm ball's ``(r^2 - |w|^2)^{-1/2}``), which piles up at the
boundary ``sigma_max = r``. In singular values ``sigma_i`` of ``W``:
``prod_i sigma_i^{n-s} (r^2 - sigma_i^2)^{-1/2} prod_{i<j} |sigma_i^2 - sigma_j^2|``.

Start. The slack starts at ``S = V diag(xi_i) V^T`` from the eigendecomposition
``W^T W = V diag(sigma_i^2) V^T``, with each singular value's slack as the
circle's (:func:`~cola_jax.constraints.circle.start_slack`):
``xi_i = sqrt(r^2 - sigma_i^2)``, but at least ``sigma_i tan(phi)``,
``cos(phi) = 0.99``. A ``W`` with ``sigma_max <= 0.99 r`` is then on the
manifold with its slack and is left as it is (bit for bit); otherwise ``Q`` is
replaced by ``r`` times its polar factor, which is exactly ``W`` with every
singular value above ``0.99 r`` clipped to ``0.99 r`` (the nearest point of
the ball ``sigma_max <= 0.99 r``), and the same slack. At the boundary
``sigma_max = r`` itself the slack is singular, and the direction that lowers
``sigma_max`` is not tangent (``S v = 0`` for the top right singular vector
``v``): a point put there would barely move, as for the circle and
:class:`~cola_jax.MaxNorm`.

Cost. The stacked matrix adds ``s`` rows to ``W``'s ``n``, so a step costs what
an ``Orthogonal`` step on an ``(n + s) x s`` matrix costs (at most twice the
rows of ``W``'s own), and the start an ``s x s`` eigendecomposition.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020 (the circle's slack; o-CoLA).
  Collins, *Product of random projections, Jacobi ensembles and universality
  problems arising from free probability*, PTRF 133, 2005 (truncated Haar
  matrices).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cola_jax._hyperparameters import check_static_positive
from cola_jax._platform import one_matrix_at_a_time
from cola_jax.constraints import _axes, stiefel_projection
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.circle import start_slack
from cola_jax.constraints.orthogonal import Orthogonal, ProjectionInfo, StiefelPoint, from_tall_view, tall_view

_HIGHEST = jax.lax.Precision.HIGHEST


def _largest(x: jax.Array) -> jax.Array:
  """``max |x|``, ``inf`` where an entry is NaN (XLA:CPU's vectorised ``max`` drops NaN)."""
  return jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), initial=0)


def _each(fn, matrices: jax.Array) -> jax.Array:
  """``fn`` of one matrix, mapped over a stack ``(b, n, s)`` of them."""
  return fn(matrices) if matrices.ndim == 2 else jax.vmap(fn)(matrices)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["slack", "radius", "iterations", "converged"],
  meta_fields=["row_axes", "column_axes"],
)
@dataclasses.dataclass(frozen=True)
class MaxSpectralNormState:
  """Auxiliary state of a spectral-ball leaf: the slack matrix, the radius and the last projection's diagnostics.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.MaxSpectralNorm(1.0))
    >>> state = tx.init(jnp.array([[0.6, 0.0], [0.0, 0.8], [0.0, 0.0]])).constraint_states
    >>> import numpy as np
    >>> np.asarray(state.slack, np.float64).round(6).tolist()  # W^T W + S^T S = I
    [[0.8, 0.0], [0.0, 0.6]]
    >>> float(state.residual(jnp.array([[0.6, 0.0], [0.0, 0.8], [0.0, 0.0]])))
    0.0
  """

  slack: jax.Array  # S, (s, s); (b, s, s) for a leaf of b matrices
  radius: jax.Array  # r, a scalar (kept so that residuals need only the state)
  iterations: jax.Array  # the last projection's solver iterations (as ProjectionInfo's)
  converged: jax.Array  # whether it converged (False: finished by the polar factor)
  row_axes: tuple[int, ...] | None = None
  column_axes: tuple[int, ...] | None = None

  def residual(self, param: jax.Array) -> jax.Array:
    """``max |W^T W + S^T S - r^2 I| / r^2`` over the leaf's matrices, computed in at least float32.

    It bounds how far the ball is exceeded: ``sigma_max(W)^2 <= r^2 (1 + s residual)``.
    """
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    w = tall_view(param.astype(dtype), self.row_axes, self.column_axes)
    s = self.slack.astype(dtype)
    r = self.radius.astype(dtype)
    gram = lambda m: jnp.matmul(jnp.swapaxes(m, -1, -2), m, precision=_HIGHEST)
    eye = jnp.eye(s.shape[-1], dtype=dtype)
    return _largest(gram(w) + gram(s) - (r * r) * eye) / (r * r)


def _start_slack(radius: float, w: jax.Array) -> jax.Array:
  """``S = V diag(xi) V^T`` for one ``(n, s)`` matrix: each singular value's slack as the circle's start.

  Computed for ``W / r`` in at least float32 after an exact power-of-two
  scaling of large matrices (no overflow of ``W^T W``); an ``inf`` or NaN gives
  NaN without calling ``eigh`` (LAPACK's iteration would not return).
  """
  x = w.astype(jnp.promote_types(w.dtype, jnp.float32)) / radius
  finite = jnp.all(jnp.isfinite(x))
  # The power of two 2^(1 - e) with 1 <= m 2^(1 - e) < 2 (m = 2^e f, f in [1/2, 1); at least the smallest normal
  # number): an exact scaling, applied only to matrices with entries >= 1 (a non-finite matrix is not read).
  _, exponent = jnp.frexp(_largest(x))
  c = jnp.minimum(jnp.ldexp(jnp.ones((), x.dtype), jnp.maximum(1 - exponent, jnp.finfo(x.dtype).minexp)), 1)
  xs = jnp.where(finite, x * c, 0)
  mu, v = one_matrix_at_a_time(jnp.linalg.eigh)(stiefel_projection.gram(xs, xs))  # c^2 sigma^2 / r^2
  mu = jnp.maximum(mu, 0)
  xi = start_slack(c, mu) / c  # xi / r
  slack = radius * jnp.matmul(v * xi, v.T, precision=_HIGHEST)
  return jnp.where(finite, slack, jnp.nan).astype(w.dtype)


@dataclasses.dataclass(frozen=True)
class MaxSpectralNorm(Constraint):
  """``sigma_max(W) <= radius`` for the leaf viewed as a matrix, as ``W^T W + S^T S = radius^2 I``.

  The spectral-norm ball, held exactly through a slack matrix ``S`` (``[W; S]``
  moves on a scaled Stiefel manifold, see the module docstring), not by
  rescaling after each step. The matrix view is :class:`Orthogonal`'s.

  Args:
    radius: the bound ``r > 0`` on the largest singular value of each matrix
      (a number known at construction: it is the Stiefel manifold's scale).
    row_axes: the axes of the leaf that index the matrix's rows (an int or a
      tuple), given together with ``column_axes``; every other axis is a
      batch axis, each of its matrices in its own ball. ``None`` (both, the
      default): the rows are every axis but the last, the columns the last
      (a Dense kernel ``(in, out)`` is one matrix, a conv kernel
      ``(kh, kw, in, out)`` the ``(kh kw in, out)`` one). A 3-D leaf whose
      path does not say conv (but an attention output kernel) meets the
      default with a warning naming the axes to give, as for :class:`Orthogonal`.
    column_axes: the axes that index the columns, as ``row_axes``.

  A start beyond the ball, on its boundary or within 1 % of it starts with
  every singular value above ``0.99 r`` clipped to ``0.99 r`` (the rule of
  :class:`Circle` and :class:`MaxNorm`, which leaves the slack room to move);
  a matrix with ``sigma_max <= 0.99 r`` is left as it is (bit for bit; where
  some are clipped, the others keep their values to the polar factor's
  rounding, an ulp or so). The state
  (:class:`MaxSpectralNormState`) holds the slack ``(s, s)`` and the last
  projection's diagnostics; the momentum of ``cola_ud`` is stored as the
  ``(n + s, s)`` tangent matrix of ``[W; S]`` (not shaped like the leaf).
  :func:`~cola_jax.manifold_muon` steps only :class:`Orthogonal` leaves.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> w = jnp.array([[3.0, 0.0], [0.0, 0.5], [0.0, 0.0]])  # singular values 3 and 0.5
    >>> import numpy as np
    >>> near = cola.MaxSpectralNorm(1.0).nearest(w)  # where the first update starts: 3 clipped to 0.99
    >>> np.asarray(near, np.float64).round(6).tolist()
    [[0.99, 0.0], [0.0, 0.5], [0.0, 0.0]]
    >>> tx = cola.cola_ud(0.1, friction=1.0,
    ...                   constraints={'kernel': cola.MaxSpectralNorm(1.0), 'bias': None})
    >>> # A conv kernel (kh, kw, in, out) as kh * kw matrices (in, out), each in the ball.
    >>> per_tap = cola.MaxSpectralNorm(1.0, row_axes=2, column_axes=3)
  """

  radius: float
  row_axes: tuple[int, ...] | None = None  # ints are accepted and stored as tuples
  column_axes: tuple[int, ...] | None = None

  project_noise_with_force = True

  def __post_init__(self):
    object.__setattr__(self, "radius", check_static_positive("MaxSpectralNorm", "radius", self.radius))
    rows, columns = _axes.matrix_axes("MaxSpectralNorm", self.row_axes, self.column_axes)
    object.__setattr__(self, "row_axes", rows)
    object.__setattr__(self, "column_axes", columns)

  def validate(self, param, path):
    where = f"MaxSpectralNorm constraint on the leaf at {path}, of shape {param.shape}"
    if param.ndim < 2:
      raise ValueError(f"{where}: it needs a matrix or a kernel (ndim >= 2). Leave biases and scales unconstrained.")
    if self.row_axes is not None and self.column_axes is not None:
      _axes.resolve(where, param.shape, row_axes=self.row_axes, column_axes=self.column_axes)
    else:
      spell = lambda rows, columns: f"MaxSpectralNorm({self.radius!r}, row_axes={rows}, column_axes={columns})"
      _axes.warn_if_ambiguous("MaxSpectralNorm constraint", param.shape, path, spell)

  @property
  def tolerance(self) -> float:
    """The residual its projection may leave: :class:`~cola_jax.Orthogonal`'s ``tolerance``, on ``[W; S]``."""
    return self._stiefel.tolerance

  @property
  def _stiefel(self) -> Orthogonal:
    """The geometry of the stacked ``[W; S]``, ``(n + s, s)`` or ``(b, n + s, s)``: the scaled Stiefel manifold.

    Orthogonal's defaults, viewing the stack's last two axes as each matrix's rows and columns (the leading axis,
    if any, the batch): its view of the stack is the stack itself.
    """
    return Orthogonal(scale=self.radius, row_axes=(-2,), column_axes=(-1,))

  def _tall(self, w):
    return tall_view(w, self.row_axes, self.column_axes)

  def _state(self, slack, radius, info: ProjectionInfo) -> MaxSpectralNormState:
    return MaxSpectralNormState(slack, radius, info.iterations, info.converged, self.row_axes, self.column_axes)

  def init(self, param):
    slack = _each(functools.partial(_start_slack, self.radius), self._tall(param))
    info = self._stiefel.init(param)
    return self._state(slack, jnp.asarray(self.radius, param.dtype), info)

  def point(self, param, aux):
    q = jnp.concatenate([self._tall(param), aux.slack.astype(param.dtype)], axis=-2)
    # A point off the stacked manifold (a start in or beyond the 1 % margin, a parameter changed outside the
    # optimizer) is replaced by r times its polar factor; rounding from params + updates is left to the step.
    return self._stiefel.point(q, ProjectionInfo(aux.iterations, aux.converged))

  def unpack(self, point: StiefelPoint, param):
    q = point.matrix
    n = q.shape[-2] - q.shape[-1]
    w = from_tall_view(q[..., :n, :], param, self.row_axes, self.column_axes)
    return w, self._state(q[..., n:, :], jnp.asarray(self.radius, q.dtype), point.info)

  def residual(self, param, aux):
    """:meth:`MaxSpectralNormState.residual`."""
    return aux.residual(param)

  def ambient_gradient(self, point, grad):
    g = self._tall(grad).astype(point.matrix.dtype)
    return jnp.concatenate([g, jnp.zeros(g.shape[:-2] + (g.shape[-1],) * 2, g.dtype)], axis=-2)

  def ambient_normal(self, key, point):
    return self._stiefel.ambient_normal(key, point)

  def project(self, anchor, step):
    return self._stiefel.project(anchor, step)

  def cotangent(self, point, vector):
    return self._stiefel.cotangent(point, vector)

  def zero_momentum(self, param):
    """The momentum is stored as the ``(n + s, s)`` tangent matrix of ``[W; S]`` (stacked with batch axes)."""
    shape = jax.eval_shape(self._tall, param).shape
    return jnp.zeros(shape[:-2] + (shape[-2] + shape[-1], shape[-1]), param.dtype)

  def a_step(self, point, momentum, h):
    return self._stiefel.a_step(point, momentum, h)

  def retract(self, point, tangent):
    return self._stiefel.retract(point, tangent)
