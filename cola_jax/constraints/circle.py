r"""Circle constraint: ``|theta_i| <= r`` for every entry, through a slack variable.

Each constrained weight ``theta`` gets a slack ``xi`` with

.. math::
  g(\theta, \xi) = \theta^2 + \xi^2 - r^2 = 0,

so the pair moves on a circle of radius ``r`` and ``|theta| <= r`` holds
without clipping. The cotangent space at ``(theta, xi)`` is one-dimensional,
spanned by the unit tangent ``t = (xi, -theta) / r``; the momentum is stored as
its coordinate ``v`` along ``t`` (one array, shaped like the weight), and the
projected noise is one standard normal per weight.

Noise: two standard normal numbers per Threefry hash of the key
(:func:`cola_jax._noise.normal_pair`, Box-Muller), not ``jax.random.normal``'s
numbers: the overdamped step's pair ``(theta, xi)`` from one hash, the
underdamped momenta of neighbouring entries along the first even axis other
than the last from one hash (:func:`cola_jax._noise.normal_paired`; leaves
without such an axis draw ``jax.random.normal``'s numbers).

The A step is the exact geodesic flow: a rotation of ``(theta, xi)`` by the
angle ``h v / r``, with ``v`` unchanged. The overdamped projection is the
orthogonal (radial) one, ``r (theta, xi) / |(theta, xi)|``, which keeps the
quadrant (the paper's ``arctan(xi / theta)`` form does not; see
``docs/errata.md``, erratum 2).

Extreme input: the radial projection scales each pair by an exact power of
two before squaring, so a step of any finite size lands on the circle on the
side it points to; the A step is a rotation for every finite angle, so the
pair keeps its radius to rounding (its angle is exact below ``2**13`` rad, see
:meth:`Circle.a_step`); ``h = 0`` moves nothing; an ``inf`` or NaN gives NaN.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Appendix B (c-CoLA-od, c-CoLA-ud).
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cola_jax import _noise
from cola_jax._hyperparameters import check_positive
from cola_jax._numerics import (
  explicit_sharding,
  max_abs,
  power_of_two_scale,
  sin_cos,
)
from cola_jax._platform import computed_together
from cola_jax.constraints.base import Constraint


class CircleState(NamedTuple):
  """Auxiliary state of a circle-constrained leaf: the slacks and the radius.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.Circle(0.5))
    >>> tx.init(jnp.array([0.3, 0.0])).constraint_states  # w**2 + slack**2 = 0.5**2
    CircleState(slack=Array([0.4, 0.5], dtype=float32), radius=Array(0.5, dtype=float32))
  """

  slack: jax.Array  # xi, shaped like the weight
  radius: jax.Array  # r, a scalar (kept so that residuals need only the state)

  def residual(self, param: jax.Array) -> jax.Array:
    """``max |theta^2 + xi^2 - r^2| / r^2`` and ``max(|theta| - r, 0) / r``."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    theta = param.astype(dtype)
    r = self.radius.astype(dtype)
    on_circle = max_abs(theta**2 + self.slack.astype(dtype) ** 2 - r**2) / r**2
    outside = max_abs(jnp.maximum(jnp.abs(theta) - r, 0.0)) / r
    return jnp.maximum(on_circle, outside)


START_INSIDE = 0.99  # a bounded weight (or unit) starts at most at this fraction of its bound
_START_TAN = math.sqrt(1 - START_INSIDE**2) / START_INSIDE


def start_slack(r: jax.Array, squared: jax.Array) -> jax.Array:
  """The slack of a weight or unit of squared magnitude ``squared <= r^2`` at its first update.

  ``sqrt(r^2 - squared)``, but at least ``|w| tan(phi)`` with ``cos(phi) =
  START_INSIDE``: the pair ``(w, xi)`` then lands, radially, at most at
  ``START_INSIDE r`` (exactly there from the bound or beyond it), and a weight
  already there keeps its slack.

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.constraints import start_slack
    >>> float(start_slack(jnp.float32(1.0), jnp.float32(0.36)))  # w = 0.6 inside: the slack of the circle
    0.800000011920929
  """
  return jnp.sqrt(jnp.maximum(r * r - squared, _START_TAN**2 * squared))


@dataclasses.dataclass(frozen=True)
class Circle(Constraint):
  """``|theta| <= radius`` entrywise, as ``theta^2 + xi^2 = radius^2``.

  Args:
    radius: the bound ``r > 0`` on each entry of the leaf.

  The slack starts at ``+sqrt(r^2 - theta^2)``, except that a weight that
  starts beyond the bound, at it, or within 1 % of it starts at ``+-0.99 r``
  (:func:`start_slack`). At the bound itself the
  slack is 0 and the circle's tangent is the slack's direction, where the
  gradient has no component: a weight put there would barely move.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> cola.Circle(0.1).nearest(jnp.array([0.3, -0.05, 0.1]))  # where the first update starts
    Array([ 0.099, -0.05 ,  0.099], dtype=float32)
    >>> tx = cola.cola_ud(0.3, friction=1.0,
    ...                   constraints={'w': cola.Circle(0.1), 'b': None})
  """

  radius: float

  momentum_coordinates = "frame"  # the momentum's coordinate along the unit tangent of each weight's circle

  def __post_init__(self):
    check_positive("Circle", "radius", self.radius)

  def init(self, param):
    r = jnp.asarray(self.radius, param.dtype)
    theta = jnp.clip(param, -r, r)
    return CircleState(slack=start_slack(r, theta * theta), radius=r)

  def point(self, param, aux):
    r = jnp.asarray(self.radius, param.dtype)
    # Both entries in [-r, r] (a healthy slack is): the pair scaled by 1/r
    # cannot overflow, and the cheaper fixed scale serves. param * 0 is NaN
    # for an infinite weight, which clipping would hide.
    theta = jnp.clip(param, -r, r) + param * 0
    xi = jnp.clip(aux.slack.astype(param.dtype), -r, r)
    # The loops of the new weight, slack and momentum all read the pair:
    # normalised once and written to memory (see computed_together).
    return computed_together(*self._onto_circle(theta, xi, 1 / r))

  def _onto_circle(self, theta, xi, scale=None):
    """Radial projection ``r (theta, xi) / |(theta, xi)|``; ``(0, r)`` at the origin.

    Overflow-safe: the pair is first multiplied by ``scale`` (by default a
    power of two, :func:`~cola_jax._numerics.power_of_two_scale` of
    ``max(|theta|, |xi|)``, which is exact), so that every finite pair lands
    on the circle in its own direction, however large (a step of ``-3e38``
    lands on ``-r``). A pair counts as the origin where both entries are below
    the smallest normal number (zero or subnormal: compiled code flushes
    subnormals to zero, XLA's constant folder does not), or, with a given
    ``scale``, where its scaled squared norm is; a pair with an ``inf`` or
    NaN gives NaN.
    """
    r = jnp.asarray(self.radius, theta.dtype)
    tiny = jnp.finfo(theta.dtype).tiny
    if scale is None:
      largest = jnp.maximum(jnp.abs(theta), jnp.abs(xi))
      degenerate = largest < tiny
      scale = power_of_two_scale(largest)
      # Selected before squaring: for a constant a, XLA reassociates (a s) (a s) into (a a) (s s), and s s overflows.
      theta = jnp.where(degenerate, jnp.zeros_like(theta), theta * scale)
      xi = jnp.where(degenerate, jnp.ones_like(xi), xi * scale)
      z = theta * theta + xi * xi
    else:
      theta, xi = theta * scale, xi * scale
      z = theta * theta + xi * xi
      degenerate = z < tiny
      xi = jnp.where(degenerate, jnp.ones_like(xi), xi)
      theta = jnp.where(degenerate, jnp.zeros_like(theta), theta)
      z = jnp.where(degenerate, jnp.ones_like(z), z)
    norm = r * jax.lax.rsqrt(z)
    return theta * norm, xi * norm

  def unpack(self, point, param):
    theta, xi = point
    r = jnp.asarray(self.radius, theta.dtype)
    # Rounding in the normalisation can leave |theta| one ulp above r.
    return jnp.clip(theta, -r, r), CircleState(slack=xi, radius=r)

  def residual(self, param, aux):
    """:meth:`CircleState.residual`."""
    return aux.residual(param)

  def ambient_gradient(self, point, grad):
    theta, _ = point
    return grad, jnp.zeros_like(theta)

  def ambient_normal(self, key, point):
    theta, _ = point
    # Both feed both new coordinates: normal_pair writes them to memory once
    # rather than have each coordinate's loop hash again.
    return _noise.normal_pair(key, theta.shape, theta.dtype, out_sharding=explicit_sharding(theta))

  def project(self, anchor, step):
    return self._onto_circle(anchor[0] + step[0], anchor[1] + step[1])

  def cotangent(self, point, vector):
    theta, xi = point
    v_theta, v_xi = vector
    return (v_theta * xi - v_xi * theta) * (1 / jnp.asarray(self.radius, theta.dtype))

  def momentum_vector(self, point, momentum):
    """``v (xi, -theta) / r``: the coordinate ``v`` along the unit tangent as a vector."""
    theta, xi = point
    inverse_r = 1 / jnp.asarray(self.radius, theta.dtype)
    return momentum * xi * inverse_r, -momentum * theta * inverse_r

  def projected_gradient(self, point, grad):
    _, xi = point
    return grad * xi * (1 / jnp.asarray(self.radius, xi.dtype))

  def cotangent_draw(self, key, point):
    """The cotangent noise's coordinate along the circle's frame, shaped like ``theta``."""
    theta, _ = point
    return _noise.normal_paired(key, theta.shape, theta.dtype, out_sharding=explicit_sharding(theta))

  def cotangent_normal(self, point, draw):
    return draw

  def a_step(self, point, momentum, h):
    """The rotation of ``(theta, xi)`` by the angle ``h v / r``, a rotation for every finite angle.

    The pair stays on the circle to rounding however large the momentum, and
    ``h = 0`` moves nothing. In float32 the angle is exact to 1.2e-7 below
    ``2**13`` rad; above, where the float32 angle is itself uncertain by more
    than its spacing (1e-3 rad), the turn is on XLA:CPU by an inexactly
    reduced angle (:func:`~cola_jax._numerics.sin_cos`): an exact reduction
    there (:func:`~cola_jax._numerics.with_sincos`) cost more than the rest of
    the fused update.
    """
    angle = momentum * (h * (1 / jnp.asarray(self.radius, momentum.dtype)))
    # One loop for both coordinates: the sine and cosine are computed once.
    return computed_together(*_rotate(angle, *point)), momentum


def _rotate(angle, theta, xi):
  sin, cos = sin_cos(angle)
  return cos * theta + sin * xi, cos * xi - sin * theta
