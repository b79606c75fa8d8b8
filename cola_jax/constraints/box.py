r"""Box constraint: ``lower <= w_i <= upper`` for every entry, as a shifted circle.

With the centre ``c = (lower + upper) / 2`` and the half-width
``r = (upper - lower) / 2``, each weight ``w`` gets a slack ``xi`` with

.. math::
  g(w, \xi) = (w - c)^2 + \xi^2 - r^2 = 0,

the circle constraint of :class:`~cola_jax.Circle` for ``theta = w - c``. A
shift changes neither gradients nor noise, so every step is the circle's,
computed by :class:`~cola_jax.Circle` itself on ``theta``: the exact rotation
as A step, the radial projection for the overdamped step, one momentum
coordinate per weight. ``Box(-r, r)`` is ``Circle(r)`` step for step (the
shift by ``c = 0`` changes no bit), and ``Box(0.0, u)`` gives bounded
non-negative weights.

Invariant measure. The surface measure of the circle is ``r dphi`` for
``theta = r sin(phi)``, so the law of ``w`` with loss ``V`` and temperature
``tau`` has the density

.. math::
  \rho(w) \propto \frac{e^{-V(w)/\tau}}{\sqrt{(w - \mathrm{lower})(\mathrm{upper} - w)}}
  \quad\text{on } (\mathrm{lower}, \mathrm{upper}),

the arcsine law between the bounds when ``V = 0``: the weights spend more time
near the bounds than a uniform law would.

Precision. The circle runs in the leaf's compute dtype (float32 at least) on
``theta = w - c``, so the bounds hold to the rounding of ``w``, a relative
``eps`` of ``max(|lower|, |upper|)``: a narrow box far from zero is only as fine
as the float grid there.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Appendix B (the circle constraint, c-CoLA).
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cola_jax._numerics import concrete_float
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.circle import Circle, CircleState


class BoxState(NamedTuple):
  """Auxiliary state of a box-constrained leaf: the slacks and the circle's center and radius.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.Box(0.0, 0.2))
    >>> tx.init(jnp.array([0.1, 0.16])).constraint_states  # (w - 0.1)**2 + slack**2 = 0.1**2
    BoxState(slack=Array([0.1 ..., 0.08...], dtype=float32), center=Array(0.1, dtype=float32),
             radius=Array(0.1, dtype=float32))
  """

  slack: jax.Array  # xi, shaped like the weight
  center: jax.Array  # c = (lower + upper) / 2, a scalar
  radius: jax.Array  # r = (upper - lower) / 2, a scalar

  def residual(self, param: jax.Array) -> jax.Array:
    """The circle's residual of ``theta = w - c`` (:meth:`CircleState.residual`)."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    theta = param.astype(dtype) - self.center.astype(dtype)
    return CircleState(slack=self.slack, radius=self.radius).residual(theta)


def _check_bound(name: str, value) -> None:
  if isinstance(value, (bool, str, bytes)) or value is None:
    raise TypeError(f"Box: {name} must be a number, got {value!r}.")
  if jnp.ndim(value) != 0:
    raise ValueError(
      f"Box: {name} must be a scalar (one bound for every entry of the leaf), got "
      f"shape {jnp.shape(value)}; per-entry bounds are not supported."
    )
  x = concrete_float(value)
  if x is not None and not math.isfinite(x):
    raise ValueError(f"Box: {name} must be finite, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Box(Constraint):
  """``lower <= w <= upper`` entrywise, as ``(w - c)^2 + xi^2 = r^2``.

  Args:
    lower: the lower bound, a finite scalar (the same for every entry).
    upper: the upper bound, a finite scalar ``> lower``.

  The slack starts at ``+sqrt(r^2 - (w - c)^2)``, except that a weight that
  starts beyond a bound, at it or within ``0.01 r`` of it starts ``0.01 r``
  inside (as for :class:`Circle`: at a bound it would not move). Bounds are
  scalars; per-entry bounds (arrays) are a ValueError. See the module
  docstring for the geometry and the invariant law (the arcsine law between
  the bounds without a loss).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> cola.Box(0.0, 0.2).nearest(jnp.array([-1.0, 0.1, 0.5]))  # where the first update starts
    Array([0.001, 0.1  , 0.199], dtype=float32)
    >>> # Non-negative weights below 0.2; biases free.
    >>> tx = cola.cola_ud(0.3, friction=1.0,
    ...                   constraints={'w': cola.Box(0.0, 0.2), 'b': None})
  """

  lower: float
  upper: float
  _center: float = dataclasses.field(init=False, repr=False, compare=False)
  _circle: Circle = dataclasses.field(init=False, repr=False, compare=False)

  momentum_coordinates = "frame"  # as the circle's

  def __post_init__(self):
    _check_bound("lower", self.lower)
    _check_bound("upper", self.upper)
    lower, upper = concrete_float(self.lower), concrete_float(self.upper)
    if lower is not None and upper is not None:
      if not lower < upper:
        raise ValueError(f"Box: lower must be below upper, got lower={self.lower!r}, upper={self.upper!r}.")
      if not math.isfinite(upper - lower):
        raise ValueError(f"Box: upper - lower must be finite, got lower={self.lower!r}, upper={self.upper!r}.")
    # c and r from the bounds as given (Python floats: in double precision), so
    # that Box(-r, r) hands Circle the very same radius.
    object.__setattr__(self, "_center", (self.lower + self.upper) / 2)
    object.__setattr__(self, "_circle", Circle((self.upper - self.lower) / 2))

  def _shift(self, dtype):
    return jnp.asarray(self._center, dtype)

  def init(self, param):
    state = self._circle.init(param - self._shift(param.dtype))
    return BoxState(slack=state.slack, center=self._shift(param.dtype), radius=state.radius)

  def point(self, param, aux):
    circle_state = CircleState(slack=aux.slack, radius=aux.radius)
    return self._circle.point(param - self._shift(param.dtype), circle_state)

  def unpack(self, point, param):
    theta, state = self._circle.unpack(point, param)
    dtype = theta.dtype
    # c + theta can round past a bound when c + r is not exactly upper.
    w = jnp.clip(theta + self._shift(dtype), jnp.asarray(self.lower, dtype), jnp.asarray(self.upper, dtype))
    return w, BoxState(slack=state.slack, center=self._shift(dtype), radius=state.radius)

  def residual(self, param, aux):
    """:meth:`BoxState.residual`."""
    return aux.residual(param)

  # The rest is the circle's: a shift changes no gradient, noise or direction.

  def ambient_gradient(self, point, grad):
    return self._circle.ambient_gradient(point, grad)

  def ambient_normal(self, key, point):
    return self._circle.ambient_normal(key, point)

  def project(self, anchor, step):
    return self._circle.project(anchor, step)

  def cotangent(self, point, vector):
    return self._circle.cotangent(point, vector)

  def momentum_vector(self, point, momentum):
    return self._circle.momentum_vector(point, momentum)

  def projected_gradient(self, point, grad):
    return self._circle.projected_gradient(point, grad)

  def cotangent_draw(self, key, point):
    return self._circle.cotangent_draw(key, point)

  def cotangent_normal(self, point, draw):
    return self._circle.cotangent_normal(point, draw)

  def a_step(self, point, momentum, h):
    return self._circle.a_step(point, momentum, h)
