r"""Unit-norm constraint: ``|w_j| = r`` exactly for every unit (Keras ``UnitNorm``).

The incoming weights ``w_j in R^n`` of unit ``j`` (the entries along ``axis``,
as in :class:`~cola_jax.MaxNorm`: by default each output unit's, a column of a
Flax Dense kernel ``(in, out)``, a row of an Equinox Linear weight
``(out, in)``; ``"all"``: the whole leaf, ``|W|_F = r``)
move on the sphere

.. math::
  g(w_j) = |w_j|^2 - r^2 = 0, \qquad S^{n-1} \subset \mathbb{R}^n,

with no slack variable. Its cotangent space at ``w_j`` is the tangent plane
``{p : w_j . p = 0}``; the momentum is that tangent vector, stored shaped like
the leaf, and the projection of an ambient vector is

.. math::
  \Pi_w v = v - \frac{(w \cdot v)}{r^2}\, w.

A step. The exact geodesic (great-circle) flow: with ``phi = h |p| / r``,

.. math::
  w(h) = \cos\phi\, w + \sin\phi\, r\, p / |p|, \qquad
  p(h) = \cos\phi\, p - \sin\phi\, |p|\, w / r,

a rotation in the plane of ``w`` and ``p``. ``S^{n-1}`` is the equator
``xi = 0`` of the slack sphere ``S^n`` of :class:`~cola_jax.MaxNorm`, and a great
circle through a point of the equator with a velocity along it stays on it, so
the flow is :class:`~cola_jax.MaxNorm`'s A step at ``(w, 0)`` (whose momentum
frame is the identity there); its rounding in ``xi`` (``~ eps phi r``) is
dropped, which changes ``|w|`` by ``~ (eps phi)^2``. The overdamped step projects radially, ``r w / |w|`` (the
orthogonal projection); a zero unit has no direction and is put at
``r (1, ..., 1) / sqrt(n)``, as is a unit of subnormal numbers (which compiled
code reads as zeros).

Invariant measure: with zero gradient the dynamics commute with the rotations
of each unit (isotropic noise, radial projection, great-circle flow), so each
``w_j / r`` is uniform on ``S^{n-1}`` for every step size; one coordinate
``x`` of it has the density ``(1 - x^2)^{(n-3)/2}``, i.e. ``(x + 1) / 2`` is
``Beta((n-1)/2, (n-1)/2)`` (the arcsine law for ``n = 2``, the uniform one
for ``n = 3``).

References:
  Leimkuhler and Matthews, *Efficient molecular dynamics using geodesic
  integration and solvent-solute splitting*, Proc. R. Soc. A, 2016
  (geodesic integrators on the sphere).
  Keras ``keras.constraints.UnitNorm`` (the same constraint, by
  renormalisation after each update).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from cola_jax import _noise
from cola_jax._numerics import concrete_float, explicit_sharding, max_abs, power_of_two_scale
from cola_jax.constraints import _axes
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.max_norm import Axis, MaxNorm, _check_axis, _normalize_axis


@functools.partial(jax.tree_util.register_dataclass, data_fields=["radius"], meta_fields=["axes"])
@dataclasses.dataclass(frozen=True)
class UnitNormState:
  """Auxiliary state of a unit-norm leaf: nothing but what the residual needs.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.UnitNorm())
    >>> state = tx.init({'kernel': jnp.array([[0.6, 0.0], [0.8, 1.0]])}).constraint_states['kernel']
    >>> state
    UnitNormState(radius=Array(1., dtype=float32), axes=(0,))
    >>> float(state.residual(jnp.array([[0.6, 0.0], [0.8, 2.0]])))  # max |norm**2 - 1| over the columns
    3.0
  """

  radius: jax.Array  # r, a scalar
  axes: tuple[int, ...]  # the normed axes of the leaf, static

  def residual(self, param: jax.Array) -> jax.Array:
    """``max_j ||w_j|^2 - r^2| / r^2``, computed in at least float32."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    w = param.astype(dtype)
    r = self.radius.astype(dtype)
    norm2 = jnp.sum(w * w, axis=self.axes)
    return max_abs(norm2 - r * r) / (r * r)


@dataclasses.dataclass(frozen=True)
class UnitNorm(Constraint):
  """``|w_j| = radius`` for every unit ``j`` (Keras ``UnitNorm``), on the exact sphere.

  Args:
    radius: the norm ``r > 0`` of each unit's weights (finite).
    axis: the axes of the leaf that the norm is taken over, as in
      :class:`~cola_jax.MaxNorm` (an int or a tuple; negative values count
      from the end), or ``"all"``: every axis, the whole leaf one unit
      (``|W|_F = r`` for a matrix). ``None`` (default): each output unit's
      incoming weights, read in the layer that holds the leaf, as for
      :class:`~cola_jax.MaxNorm`: one unit per column of a Flax Dense kernel
      ``(in, out)`` and per output filter of a conv kernel
      ``(kh, kw, in, out)`` (every axis but the last), one per row of an
      Equinox ``Linear`` weight ``(out, in)`` (every axis but the first; its
      ``Conv`` and ``ConvTranspose`` weights likewise). A matrix in no such
      layer (a bare array, a leaf not named ``kernel``, an embedding table)
      is read as a Flax kernel and named in a warning. Keras'
      ``UnitNorm(axis=0)`` on a Dense kernel is the default here. A 3-D leaf whose path does not say conv (a Flax
      query, key or value kernel, a stack of layers) meets the default with a warning
      naming it and the axes to give; an attention output kernel ``(heads, head_dim,
      features)`` is the layer's matrix as it stands, quietly (docs/guides/declared_constraints.md,
      "Attention").

  A unit needs at least two entries (with one, ``|w| = r`` leaves only
  ``+-r``): a leaf whose units have fewer is a ValueError naming it (for a
  vector pass ``axis=0`` or ``"all"`` to norm the whole of it). For the ball
  ``|w_j| <= r`` use :class:`~cola_jax.MaxNorm`. Units are put on the sphere
  radially by the first update. The momentum of ``cola_ud`` is the tangent
  vector, shaped like the leaf. See the module docstring for the geometry.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> kernel = jnp.array([[3.0, 0.3], [4.0, 0.4]])  # columns of norm 5 and 0.5
    >>> cola.UnitNorm().nearest(kernel).round(3)  # where the first update starts
    Array([[0.6, 0.6], [0.8, 0.8]], dtype=float32)
    >>> tx = cola.cola_ud(0.3, friction=1.0,
    ...                   constraints={'kernel': cola.UnitNorm(), 'bias': None})

    The whole matrix as one unit, ``|W|_F = 2``:

    >>> w = jnp.array([[3.0, 0.0], [0.0, 4.0]])  # Frobenius norm 5
    >>> cola.UnitNorm(2.0, axis="all").nearest(w)
    Array([[1.2, 0. ], [0. , 1.6]], dtype=float32)
  """

  radius: float = 1.0
  axis: Axis = None  # an int or a list is accepted and stored as a tuple; "all" is kept as is

  project_noise_with_force = True

  # The slack sphere S^n of MaxNorm, whose equator xi = 0 this is: its axes, products and A step.
  _sphere: MaxNorm = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    if isinstance(self.radius, (bool, str, bytes)) or self.radius is None:
      raise TypeError(f"UnitNorm: radius must be a number, got {self.radius!r}.")
    if jnp.ndim(self.radius) != 0:
      raise ValueError(f"UnitNorm: radius must be a scalar, got shape {jnp.shape(self.radius)}.")
    r = concrete_float(self.radius)
    if r is not None and not (math.isfinite(r) and r > 0):
      raise ValueError(f"UnitNorm: radius must be positive and finite, got {self.radius!r}.")
    axis = _normalize_axis(self.axis, "UnitNorm")
    if isinstance(axis, tuple) and len(set(axis)) != len(axis):
      raise ValueError(f"UnitNorm: axis {self.axis!r} repeats an axis.")
    object.__setattr__(self, "axis", axis)  # lists become tuples: hashable
    object.__setattr__(self, "_sphere", MaxNorm(self.radius, axis))

  def validate(self, param, path):
    _check_axis("UnitNorm", self.axis, param, path)
    if self.axis is None:
      spell = lambda axis: f"UnitNorm({self.radius!r}, axis={axis})"
      _axes.warn_if_ambiguous("UnitNorm constraint", param.shape, path, spell, units=True)
    axes = self._sphere._axes(param.ndim)
    n = math.prod(param.shape[a] for a in axes)
    if n < 2 and param.size > 0:
      raise ValueError(
        f"UnitNorm constraint on the leaf at {path}, of shape {param.shape}: each unit "
        f"has {n} entr{'y' if n == 1 else 'ies'} (the normed axes are {axes}), and "
        f"|w| = r leaves {'only +-r' if n == 1 else 'nothing'} to train; norm more axes "
        "(axis=0 for a vector) or leave the leaf free."
      )

  def _dot(self, a, b):
    return self._sphere._dot(a, b)

  def _slack_zeros(self, w):
    """A zero slack for each unit of ``w`` (the equator of the sphere)."""
    axes = self._sphere._axes(w.ndim)
    return jnp.zeros(tuple(1 if i in axes else d for i, d in enumerate(w.shape)), w.dtype)

  def _onto_norm(self, w):
    """``r w_j / |w_j|`` per unit; ``r (1, ..., 1) / sqrt(n)`` for a zero unit.

    Overflow-safe as :class:`~cola_jax.MaxNorm`'s radial projection: each unit is
    measured after an exact power-of-two scaling. A unit whose entries are
    below the smallest normal number (zero, or subnormal: compiled code
    flushes those to zero, XLA's constant folder does not) is normalised as
    ``(1, ..., 1)``.
    """
    largest = self._sphere._unit_max(w)
    zero = largest < jnp.finfo(w.dtype).tiny
    # Selected before squaring: for a constant a, XLA reassociates (a s) (a s) into (a a) (s s), and s s overflows.
    ws = jnp.where(zero, jnp.ones_like(w), w * power_of_two_scale(largest))
    return ws * (jnp.asarray(self.radius, w.dtype) * jax.lax.rsqrt(self._dot(ws, ws)))

  # The Constraint interface.

  def init(self, param):
    return UnitNormState(radius=jnp.asarray(self.radius, param.dtype), axes=self._sphere._axes(param.ndim))

  def point(self, param, aux):
    return self._onto_norm(param)

  def residual(self, param, aux):
    """:meth:`UnitNormState.residual`."""
    return aux.residual(param)

  def ambient_normal(self, key, point):
    return _noise.normal_paired(key, point.shape, point.dtype, out_sharding=explicit_sharding(point))

  def project(self, anchor, step):
    return self._onto_norm(anchor + step)

  def cotangent(self, point, vector):
    r = jnp.asarray(self.radius, point.dtype)
    return vector - self._dot(point, vector) * (1 / (r * r)) * point

  def retract(self, point, tangent):
    """The radial projection of ``w + v``, which exists for every finite step."""
    return self.project(point, tangent)

  def a_step(self, point, momentum, h):
    (w, _), coordinates = self._sphere.a_step((point, self._slack_zeros(point)), momentum, h)
    return w, self.cotangent(w, coordinates)
