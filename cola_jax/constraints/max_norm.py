r"""Max-norm constraint: the ball ``|w_j| <= r`` for every unit, through one slack each (Keras ``MaxNorm``).

The incoming weights ``w_j in R^n`` of unit ``j`` get one slack ``xi_j`` with

.. math::
  g(w_j, \xi_j) = |w_j|^2 + \xi_j^2 - r^2 = 0,

so ``q_j = (w_j, xi_j)`` moves on the sphere ``S^n`` of radius ``r`` in
``R^{n+1}`` and the max-norm bound ``|w_j| <= r`` holds without clipping. For a
Flax ``Dense`` kernel ``(in, out)`` the unit is the column ``kernel[:, j]``
(the norm is over every axis but the last); a conv kernel ``(kh, kw, in, out)``
gets one slack per output filter. For an Equinox ``Linear`` weight
``(out, in)`` it is the row ``weight[j]`` (every axis but the first, told by
the module that holds the leaf). ``axis`` chooses other axes (``"all"``: the
whole leaf is one unit, ``|W|_F <= r``). With one weight per unit (``n = 1``)
this is exactly :class:`~cola_jax.Circle`. The sphere ``|w_j| = r`` itself,
without a slack, is :class:`~cola_jax.UnitNorm`.

Momentum. The cotangent space at ``q_j`` has dimension ``n``, as many as the
unit has weights, so the momentum is stored shaped like the leaf, as the
coordinates ``u_j in R^n`` of ``p_j`` in a frame that depends on the point:
with ``e = (0, ..., 0, 1)`` (the pole ``w = 0, xi = r``, whose tangent space is
the ``w`` space) and ``x = q_j / r``,

.. math::
  p_j = R_x (u_j, 0), \qquad
  R_x = I - \frac{(e + x)(e + x)^T}{1 + e \cdot x} + 2 x e^T,

the rotation in the plane of ``e`` and ``x`` that takes ``e`` to ``x``
(parallel transport along the great circle from the pole). It is an isometry
onto the cotangent space, so the projected noise is one standard normal per
weight and ``|p_j| = |u_j|``. Explicitly, with ``k = 1 / (r (r + xi))``,

.. math::
  p^w = u - k (w \cdot u)\, w, \qquad p^\xi = -(w \cdot u) / r,

and the coordinates of the projection ``Pi_q v`` of an ambient vector
``v = (v^w, v^xi)`` are ``v^w - (v^xi / r + k\, w \cdot v^w)\, w``. For
``n = 1`` this is the circle's ``p = u (xi, -theta) / r``. The frame is smooth
except at the antipodal pole ``w = 0, xi = -r`` (a sphere ``S^n``, ``n >= 2``,
has no smooth frame everywhere); for ``xi < 0`` the coefficient is evaluated
as ``k = (r - xi) / (r |w|^2)``, equal on the sphere and well conditioned up to
that single point, where any frame serves (``w = 0`` there).

The A step is the exact geodesic (great-circle) flow: with ``|p| = |u|`` and
``phi = h |p| / r``,

.. math::
  q(h) = \cos\phi\, q + \sin\phi\, r\, p / |p|, \qquad
  p(h) = \cos\phi\, p - \sin\phi\, |p|\, q / r,

and ``p(h)`` is stored in the frame at ``q(h)``. The overdamped projection is
the orthogonal (radial) one, ``r q / |q|``; the ambient gradient is ``(g, 0)``
and the ambient noise independent normals on ``w`` and ``xi``.

Extreme input: norms are taken after an exact power-of-two scaling of each
unit (of the momentum, in the A step), so units and steps of any finite size
are projected in their own direction; the great-circle angle is reduced
exactly (:func:`~cola_jax._numerics.with_sincos`); ``h = 0`` moves nothing;
an ``inf`` or NaN gives NaN. A gradient within a factor ``n`` of the largest
float overflows in the projection onto the cotangent space (NaN, visible).

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020 (the max-norm constraint, mentioned there and
  not worked out).
  Leimkuhler and Matthews, *Efficient molecular dynamics using geodesic
  integration and solvent-solute splitting*, Proc. R. Soc. A, 2016.
  Keras ``keras.constraints.MaxNorm`` (the same bound, by rescaling after each
  update).
"""

import dataclasses
import operator
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from cola_jax import _noise
from cola_jax._hyperparameters import check_positive
from cola_jax._numerics import (
  explicit_sharding,
  max_abs,
  power_of_two_scale,
  with_sincos,
)
from cola_jax.constraints import _axes
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.circle import start_slack

# Unpack keeps |w_j|^2 <= r^2 (1 - _MARGIN eps) so that norms recomputed in
# another summation order (or in float64) do not exceed r: a relative change of
# at most _MARGIN / 2 ulp, on units whose slack is below ~sqrt(_MARGIN eps) r.
_MARGIN = 4


class MaxNormState(NamedTuple):
  """Auxiliary state of a max-norm leaf: one slack per unit, and the radius.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.MaxNorm(1.0))
    >>> tx.init({'kernel': jnp.array([[0.6, 0.0], [0.0, 0.5]])}).constraint_states  # |column|**2 + slack**2 = 1
    {'kernel': MaxNormState(slack=Array([[0.8 , 0.8660254]], dtype=float32), radius=Array(1., dtype=float32))}
  """

  # xi, shaped like the weight with the reduced axes kept as size 1: (1, out)
  # for a Dense kernel (in, out), (1, 1, 1, out) for a conv kernel.
  slack: jax.Array
  radius: jax.Array  # r, a scalar

  def residual(self, param: jax.Array) -> jax.Array:
    """``max_j ||w_j|^2 + xi_j^2 - r^2| / r^2`` and ``max_j max(|w_j| - r, 0) / r``."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    w = param.astype(dtype)
    xi = self.slack.astype(dtype)
    r = self.radius.astype(dtype)
    # The reduced axes are those of size 1 in the slack (summing over an axis
    # of size 1 in both changes nothing).
    axes = tuple(i for i, size in enumerate(xi.shape) if size == 1)
    norm2 = jnp.sum(w * w, axis=axes, keepdims=True)
    on_sphere = max_abs(norm2 + xi * xi - r * r) / (r * r)
    outside = max_abs(jnp.maximum(jnp.sqrt(norm2) - r, 0.0)) / r
    return jnp.maximum(on_sphere, outside)


Axis = tuple[int, ...] | Literal["all"] | None  # the normed axes, as stored


def _normalize_axis(axis, owner: str = "MaxNorm") -> Axis:
  """``None``, ``"all"``, or ``axis`` (an int or a sequence of ints) as a tuple."""
  if axis is None:
    return None
  if isinstance(axis, str):
    if axis == "all":
      return "all"
    raise ValueError(f"{owner}: axis must be None, an int or a tuple of ints, or 'all', got {axis!r}.")
  if isinstance(axis, (list, tuple)):
    items = tuple(axis)
  else:
    items = (axis,)
  out = []
  for a in items:
    if isinstance(a, bool):
      raise TypeError(f"{owner}: axis must be None, an int or a tuple of ints, or 'all', got {axis!r}.")
    try:
      out.append(operator.index(a))
    except TypeError:
      raise TypeError(f"{owner}: axis must be None, an int or a tuple of ints, or 'all', got {axis!r}.") from None
  return tuple(out)


def _check_axis(owner: str, axis, param, path: str) -> None:
  """Raises ValueError naming the leaf if ``axis`` does not fit it."""
  if axis is None or axis == "all":
    return
  ndim = param.ndim
  bad = [a for a in axis if not -ndim <= a < ndim]
  if bad:
    raise ValueError(
      f"{owner} constraint on the leaf at {path}, of shape {param.shape}: "
      f"axis {bad[0] if len(bad) == 1 else tuple(bad)} is out of range for a leaf "
      f"of rank {ndim} (axis={axis})."
    )
  if len({a % ndim for a in axis}) != len(axis):
    raise ValueError(
      f"{owner} constraint on the leaf at {path}, of shape {param.shape}: axis {axis!r} names the same axis twice."
    )


@dataclasses.dataclass(frozen=True)
class MaxNorm(Constraint):
  """``|w_j| <= radius`` for every unit ``j`` (Keras ``MaxNorm``), as ``|w_j|^2 + xi_j^2 = radius^2``.

  The max-norm ball, held exactly through one slack ``xi_j`` per unit (the
  unit and its slack move on the sphere ``S^n``), not by rescaling after each
  step. For the sphere ``|w_j| = radius`` use :class:`~cola_jax.UnitNorm`.

  Args:
    radius: the bound ``r > 0`` on the Euclidean norm of each unit's weights.
    axis: the axes of the leaf that the norm is taken over (an int or a tuple,
      negative values count from the end), or ``"all"``: every axis, the whole
      leaf one unit (``|W|_F <= r`` for a matrix). ``None`` (default): each
      output unit's incoming weights, read in the layer that holds the leaf:
      every axis but the last of a Flax kernel (a Dense kernel ``(in, out)``
      has one unit per column, a conv kernel ``(kh, kw, in, out)`` one per
      output filter), every axis but the first of an Equinox ``Linear``,
      ``Conv`` or ``ConvTranspose`` weight ``(out, in, ...)`` (one unit per
      row). A leaf in no such layer (a bare array, a leaf not named
      ``kernel``, an embedding table) is read as a Flax kernel, and a matrix
      among them is named in a warning when the transforms or
      :func:`~cola_jax.project_params` meet it; the constraint's own methods
      (:meth:`nearest`) see a leaf alone and read it as a Flax kernel.
      For a 1-d leaf the default reduces nothing (every entry its own unit:
      the circle); pass ``axis=0`` or ``"all"`` to bound the norm of the whole
      vector. A 3-D leaf whose path does not say conv (a Flax
      query, key or value kernel, a stack of layers) meets the default with a warning
      naming it and the axes to give; an attention output kernel ``(heads, head_dim,
      features)`` is the layer's matrix as it stands, quietly (docs/guides/declared_constraints.md,
      "Attention").

  The slack starts at ``xi_j = +sqrt(r^2 - |w_j|^2)``, except that a unit
  that starts beyond the ball, on its boundary or within 1 % of it starts at
  ``|w_j| = 0.99 r`` in its own direction (on the boundary
  the slack is 0 and the gradient has no component along the tangent that
  leaves it, as for :class:`Circle`). The slack (``MaxNormState.slack``) keeps the
  reduced axes with size 1, e.g. ``(1, out)`` for a Dense kernel. The momentum
  of ``cola_ud`` is stored shaped like the leaf, as coordinates in a frame
  transported from the pole (see the module docstring).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> kernel = jnp.array([[3.0, 0.3], [4.0, 0.4]])  # columns of norm 5 and 0.5
    >>> cola.MaxNorm(1.0).nearest(kernel).round(3)  # where the first update starts: 0.99 inside
    Array([[0.594..., 0.3 ...], [0.792..., 0.4 ...]], dtype=float32)
    >>> tx = cola.cola_ud(0.3, friction=1.0,
    ...                   constraints={'kernel': cola.MaxNorm(1.0), 'bias': None})

    The whole matrix as one unit, ``|W|_F <= 1``:

    >>> w = jnp.array([[3.0, 0.0], [0.0, 4.0]])  # Frobenius norm 5
    >>> cola.MaxNorm(1.0, axis="all").nearest(w).round(3)  # to 0.99 of the bound
    Array([[0.594..., 0. ...], [0. ..., 0.792...]], dtype=float32)
  """

  radius: float
  # An int or a list is accepted and stored as a tuple; "all" is kept as is.
  axis: tuple[int, ...] | Literal["all"] | None = None

  momentum_coordinates = "frame"  # the frame transported from the pole

  def __post_init__(self):
    check_positive("MaxNorm", "radius", self.radius)
    axis = _normalize_axis(self.axis)
    if isinstance(axis, tuple) and len(set(axis)) != len(axis):
      raise ValueError(f"MaxNorm: axis {self.axis!r} repeats an axis.")
    object.__setattr__(self, "axis", axis)  # lists become tuples: hashable

  # Axes.

  def _axes(self, ndim: int) -> tuple[int, ...]:
    """The reduced axes, non-negative and sorted, for a leaf of rank ``ndim``."""
    if self.axis is None:
      return tuple(range(ndim - 1))
    if self.axis == "all":
      return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in self.axis))

  def validate(self, param, path):
    _check_axis("MaxNorm", self.axis, param, path)
    if self.axis is None:
      spell = lambda axis: f"MaxNorm({self.radius!r}, axis={axis})"
      _axes.warn_if_ambiguous("MaxNorm constraint", param.shape, path, spell, units=True)

  def _dot(self, a, b):
    """Per-unit inner product, reduced axes kept with size 1."""
    return jnp.sum(a * b, axis=self._axes(a.ndim), keepdims=True)

  # The manifold.

  def _unit_max(self, x):
    """Per-unit ``max |x_i|``, reduced axes kept with size 1."""
    return max_abs(x, axis=self._axes(x.ndim), keepdims=True)

  def init(self, param):
    r = jnp.asarray(self.radius, param.dtype)
    w = self._into_ball(param, r)
    norm2 = self._dot(w, w)
    return MaxNormState(slack=start_slack(r, norm2), radius=r)

  def _into_ball(self, w, r):
    """Units with ``|w_j| > r`` scaled radially onto ``|w_j| = r``.

    Overflow-safe: each unit is measured after an exact power-of-two scaling
    (:func:`~cola_jax._numerics.power_of_two_scale` of its largest entry), so
    units of any finite size are scaled in their own direction; a unit with
    an ``inf`` or NaN entry becomes NaN.
    """
    s = power_of_two_scale(self._unit_max(w))
    ws = w * s
    norm2 = self._dot(ws, ws)  # |w_j|^2 s^2, in [1, 16 n) unless w_j is (flushed to) 0
    inverse_norm = jax.lax.rsqrt(jnp.where(norm2 > 0, norm2, jnp.ones_like(norm2)))
    # r s may underflow (then w_j is far outside); NaN (inf or NaN in w_j) too.
    outside = ~((r * s) * inverse_norm >= 1)
    return jnp.where(outside, ws * (r * inverse_norm), w)

  def point(self, param, aux):
    r = jnp.asarray(self.radius, param.dtype)
    # As the circle clips: the slack is kept from the state, then the pair is
    # normalised, so that rounding in params + updates moves nothing. Both are
    # bounded by r, so the fixed scale 1/r cannot overflow.
    xi = jnp.clip(aux.slack.astype(param.dtype), -r, r)
    return self._onto_sphere(self._into_ball(param, r), xi, 1 / r)

  def _onto_sphere(self, w, xi, scale=None):
    """Radial projection ``r (w, xi) / |(w, xi)|`` per unit; ``(0, r)`` at the origin.

    Overflow-safe: each unit is multiplied by ``scale`` first (by default the
    exact power of two of :func:`~cola_jax._numerics.power_of_two_scale` of
    its largest entry), so units of any finite size land on the sphere in
    their own direction; a unit with an ``inf`` or NaN gives NaN. A unit
    counts as the origin where its entries are below the smallest normal
    number (zero or subnormal: compiled code flushes subnormals to zero,
    XLA's constant folder does not), or, with a given ``scale``, where its
    scaled squared norm is.
    """
    r = jnp.asarray(self.radius, w.dtype)
    tiny = jnp.finfo(w.dtype).tiny
    if scale is None:
      largest = jnp.maximum(self._unit_max(w), jnp.abs(xi))
      degenerate = largest < tiny
      scale = power_of_two_scale(largest)
      # Selected before squaring: for a constant a, XLA reassociates (a s) (a s) into (a a) (s s), and s s overflows.
      w = jnp.where(degenerate, jnp.zeros_like(w), w * scale)
      xi = jnp.where(degenerate, jnp.ones_like(xi), xi * scale)
      z = self._dot(w, w) + xi * xi
    else:
      w, xi = w * scale, xi * scale
      z = self._dot(w, w) + xi * xi
      degenerate = z < tiny
      xi = jnp.where(degenerate, jnp.ones_like(xi), xi)
      w = jnp.where(degenerate, jnp.zeros_like(w), w)
      z = jnp.where(degenerate, jnp.ones_like(z), z)
    norm = r * jax.lax.rsqrt(z)
    return w * norm, xi * norm

  def unpack(self, point, param):
    w, xi = point
    r = jnp.asarray(self.radius, w.dtype)
    # Rounding in the normalisation can leave |w_j| an ulp above r.
    limit = r * r * (1 - _MARGIN * jnp.finfo(w.dtype).eps)
    norm2 = self._dot(w, w)
    above = norm2 > limit
    scale = jnp.sqrt(limit) * jax.lax.rsqrt(jnp.where(above, norm2, jnp.ones_like(norm2)))
    w = jnp.where(above, w * scale, w)
    return w, MaxNormState(slack=xi, radius=r)

  def residual(self, param, aux):
    """:meth:`MaxNormState.residual`."""
    return aux.residual(param)

  def ambient_gradient(self, point, grad):
    _, xi = point
    return grad, jnp.zeros_like(xi)

  def ambient_normal(self, key, point):
    w, xi = point
    # The slacks' key folded in written out: jax.random.split compiles, on CPU, to a loop of its own per leaf.
    return (
      _noise.normal_paired(key, w.shape, w.dtype, out_sharding=explicit_sharding(w)),
      _noise.normal(_noise.fold_in(key, 1), xi.shape, xi.dtype, out_sharding=explicit_sharding(xi)),
    )

  def project(self, anchor, step):
    return self._onto_sphere(anchor[0] + step[0], anchor[1] + step[1])

  # The frame: momentum coordinates u (shaped like w) <-> cotangent vectors.

  def _frame_coefficient(self, w, xi):
    """``k = 1 / (r (r + xi))``, as ``(r - xi) / (r |w|^2)`` when ``xi < 0``."""
    r = jnp.asarray(self.radius, w.dtype)
    norm2 = self._dot(w, w)
    north = 1 / (r * (r + jnp.maximum(xi, 0)))
    # At the antipodal pole w = 0 the coefficient multiplies w: any finite value.
    south_ok = norm2 > jnp.finfo(w.dtype).tiny * (r * r)
    south = (r - xi) / (r * jnp.where(south_ok, norm2, jnp.ones_like(norm2)))
    return jnp.where(xi >= 0, north, jnp.where(south_ok, south, jnp.zeros_like(south)))

  def _to_vector(self, point, u, k=None):
    """The cotangent vector ``(p^w, p^xi)`` with coordinates ``u`` at ``point``."""
    w, xi = point
    k = self._frame_coefficient(w, xi) if k is None else k
    a = self._dot(w, u)
    return u - (k * a) * w, -a * (1 / jnp.asarray(self.radius, w.dtype))

  def _coordinates(self, point, vector, k=None):
    """The coordinates of ``Pi_q vector`` (the orthogonal projection) at ``point``."""
    w, xi = point
    v_w, v_xi = vector
    k = self._frame_coefficient(w, xi) if k is None else k
    r = jnp.asarray(self.radius, w.dtype)
    return v_w - (v_xi * (1 / r) + k * self._dot(w, v_w)) * w

  def cotangent(self, point, vector):
    return self._coordinates(point, vector)

  def cotangent_draw(self, key, point):
    """The cotangent noise's coordinates, shaped like ``w``."""
    w, _ = point
    return _noise.normal_paired(key, w.shape, w.dtype, out_sharding=explicit_sharding(w))

  def cotangent_normal(self, point, draw):
    return draw

  def momentum_vector(self, point, momentum):
    """The cotangent vector ``(p^w, p^xi)`` of a momentum in stored coordinates."""
    return self._to_vector(point, momentum)

  def a_step(self, point, momentum, h):
    """The great-circle flow for time ``h``, exact for every finite momentum.

    ``|u|`` is computed after an exact power-of-two scaling (no overflow or
    underflow of ``|u|^2``) and the angle is reduced exactly
    (:func:`~cola_jax._numerics.with_sincos`); ``h = 0`` moves nothing.
    """
    w, xi = point
    r = jnp.asarray(self.radius, w.dtype)
    p_w, p_xi = self._to_vector(point, momentum)
    largest = self._unit_max(momentum)
    s = power_of_two_scale(largest)
    # Zero and subnormal (read as zero by compiled code) momenta selected before squaring: for a constant a,
    # XLA reassociates (a s) (a s) into (a a) (s s), and s s overflows.
    us = jnp.where(largest < jnp.finfo(w.dtype).tiny, jnp.zeros_like(momentum), momentum * s)
    speed_s = jnp.sqrt(self._dot(us, us))  # |p| s = |u| s: the frame is an isometry
    inverse_s = jnp.where(speed_s > 0, 1 / s, jnp.zeros_like(s))  # u = 0: s is huge
    phi = speed_s * (h * (1 / r)) * inverse_s
    sin, cos = with_sincos(lambda sincos, phi: sincos(phi), phi)
    moving = phi > 0
    sinc = jnp.where(moving, sin / jnp.where(moving, phi, jnp.ones_like(phi)), jnp.ones_like(phi))
    along = h * sinc  # sin(phi) r / |p|
    back = (speed_s * inverse_s) * sin * (1 / r)  # sin(phi) |p| / r
    new_point = (cos * w + along * p_w, cos * xi + along * p_xi)
    new_vector = (cos * p_w - back * w, cos * p_xi - back * xi)
    return new_point, self._coordinates(new_point, new_vector)
