r"""Non-negativity constraint: ``w_i >= 0`` for every entry, through a slack on a parabola.

Each constrained weight ``w`` gets a slack ``s`` with

.. math::
  g(w, s) = w - s^2 = 0,

so the pair moves on the parabola ``w = s^2`` and ``w >= 0`` holds without
clipping and without an upper bound. Each update computes the new weight as
``w = s * s``, which rounding cannot make negative, and neither can
``params + updates`` (``new - old >= -old`` rounds to at least ``-old``).
That sum rounds relative to the old weight, which for an unbounded weight
may be most of a large step's new one; the slack kept is the rounded
weight's (:meth:`NonNegative.reconcile`), so the residual reads the slack's
rounding only.

Why a parabola. It is the lowest-degree slack for a one-sided bound (the
circle's ``theta^2 + xi^2 = r^2`` bounds both sides), and a polynomial one:
the orthogonal projection onto it is the root of a cubic in one unknown and the
RATTLE multiplier the root of a quadratic, both elementwise. ``w = exp(s)``
never reaches 0 and overflows; ``w = |s|`` has no tangent at 0. The exact
geodesic flow on the parabola would need its arc length ``s sqrt(1 + 4 s^2) / 2
+ asinh(2 s) / 4`` inverted by iteration; RATTLE is closed form, symplectic and
time reversible, and its ``O(h^2)`` error is of the order of the splitting's
own bias once there is a loss.

Geometry. The unit tangent at ``(w, s)`` is ``t = (2 s, 1) / n`` with
``n = sqrt(1 + 4 s^2)``; the momentum is stored as its coordinate ``v`` along
``t`` (one array, shaped like the weight), so the projected noise is one
standard normal per weight and the kick of the B step is
``-h (2 s / n) dV/dw``.

Overdamped projection: the nearest point of the parabola (orthogonal, as the
circle's radial one) to ``(a, b) = (w, s) + step``. Minimising
``(s^2 - a)^2 + (s - b)^2`` over ``s`` gives the cubic
``2 s^3 + (1 - 2a) s - b = 0``; the nearest point has the sign of ``b`` and
``t = |s|`` is the unique root ``t >= 0`` of ``f(t) = 2 t (t^2 - m) - |b|``,
``m = a - 1/2`` (the largest root; the others are negative). ``f`` is convex on
``t >= 0``, so Newton's method from any point above the root decreases
monotonically to it. It starts from the smaller of two points above the root:
a bound, ``sqrt(max(m, 0)) + min(cbrt(|b| / 2), |b| / (2|m| + 2 max(m, 0)))``
(its cube root taken from above),
and the slack of the step's tangential part, ``s + (2 s, 1) . step / n^2``
(first order in the step), if ``f`` is positive there, else Newton's first
step from it (which lands above the root where ``f' > 0``). Five Newton
iterations follow, a fixed number (no loop to synchronise on): measured against
a float64 solution, they reach the root to 3.5 float32 ulps of ``max(|s|, 1)``
for steps of every size from ``1e-3`` to ``1e29`` (four do too, within 4 ulps;
three leave up to ~6000 ulps at steps of order 1). Whatever the step, the result is on the parabola
exactly, as ``w = s * s``. The iteration is scaled by ``1 / max(t, 1)^2`` so
that nothing overflows.

A step (RATTLE). From ``q = (s^2, s)`` with momentum ``p = v t``, the free
flight moves to ``q + h (p + mu (1, -2 s))``, the multiplier ``mu`` such that
the new point is on the parabola. With ``p = (p_w, p_s)``,
``kappa = 8 h s p_s / n^2`` and ``rho = sqrt(1 + kappa)``, that quadratic's
root continuous at ``h = 0`` is

.. math::
  \mu = h\, \eta^2, \qquad \eta = \frac{2 p_s}{n (1 + \rho)},
  \qquad s' = s + h (p_s - 2 s \mu) = s + \frac{2 h p_s}{1 + \rho},

the last form computed (``p_s - 2 s mu`` is a difference of two large numbers
when ``kappa`` is large), and the new momentum is the tangential part of
``(q' - q) / h = (s' - s) / h (s' + s, 1)`` at ``(s'^2, s')``. No iteration, no division by ``h``. The root exists iff
``kappa >= -1``, i.e. unless the step heads towards the vertex faster than
the curve bends, ``h s v < -n^3 / 8``; such a step is rejected: the weight
stays and its momentum is reversed, ``v -> -v`` (the rule that keeps a
constrained Hamiltonian step reversible when the projection has no solution,
Lelievre, Rousset, Stoltz 2019). Nothing else can fail.

Invariant measure. The parabola, parametrised by ``s in R``, has the arc
length ``dsigma = sqrt(1 + 4 s^2) ds``; CoLA samples the density
``exp(-V / tau)`` with respect to it, i.e. ``s`` has the density
``exp(-V(s^2) / tau) sqrt(1 + 4 s^2)``. Both branches ``s = +-sqrt(w)`` map to
``w``, each with ``|ds / dw| = 1 / (2 sqrt(w))``, so

.. math::
  \rho(w) \propto e^{-V(w)/\tau}\, \frac{\sqrt{1 + 4 w}}{\sqrt{w}}, \qquad w > 0.

Without a loss this is not normalisable: the unbounded direction needs the
training loss (or weight decay) to confine it. The factor ``1 / sqrt(w)``
makes small weights more likely than ``exp(-V / tau)`` alone would; ``w = 0``
is reached and left again (the slack changes sign there).

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020 (slack variables for inequality constraints).
  Leimkuhler and Reich, *Simulating Hamiltonian Dynamics*, 2004, ch. 7 (RATTLE).
  Lelievre, Rousset, Stoltz, *Hybrid Monte Carlo methods for sampling
  probability measures on submanifolds*, Numer. Math. 143, 2019.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax import _noise
from cola_jax._numerics import explicit_sharding, max_abs
from cola_jax._platform import computed_together
from cola_jax.constraints.base import Constraint
from cola_jax.constraints.circle import START_INSIDE

# Newton iterations of the projection after its start (see the module docstring).
_NEWTON_ITERATIONS = 5
# Where a weight at or below 0 starts: the slack s = tan(phi) / 2, where the parabola's tangent (2 s, 1) makes the
# angle phi with the slack axis that the circle's tangent makes at its start, cos(phi) = START_INSIDE.
START = (math.sqrt(1 - START_INSIDE**2) / START_INSIDE / 2) ** 2


def _lifted(param):
  """The weight, ``START`` where it is below the smallest normal number: at or below 0, or subnormal, which a
  compiled program on XLA:CPU reads as 0 (NaN stays NaN)."""
  return jnp.where(param < jnp.finfo(param.dtype).tiny, jnp.asarray(START, param.dtype), param)


class NonNegativeState(NamedTuple):
  """Auxiliary state of a non-negative leaf: the slacks ``s`` of ``w = s^2``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.NonNegative())
    >>> tx.init(jnp.array([0.25, 4.0, -1.0])).constraint_states  # sqrt(w); sqrt(START) at or below 0
    NonNegativeState(slack=Array([0.5       , 2.        , 0.07124614], dtype=float32))
  """

  slack: jax.Array  # s, shaped like the weight: w = s^2

  def residual(self, param: jax.Array) -> jax.Array:
    """``max |w - s^2| / max(|w|, 1)`` and ``max(-w, 0)``, computed in at least float32."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    w = param.astype(dtype)
    s = self.slack.astype(dtype)
    on_parabola = max_abs((w - s * s) / jnp.maximum(jnp.abs(w), 1))
    below = max_abs(jnp.maximum(-w, 0))
    return jnp.maximum(on_parabola, below)


def _inverse_length(s):
  """``1 / sqrt(1 + 4 s^2)``, without overflow for large ``|s|``."""
  u = 2 * jnp.abs(s)
  big = u > 1
  x = jnp.where(big, 1 / jnp.where(big, u, 1), u)  # min(u, 1 / u)
  root = jax.lax.rsqrt(1 + x * x)
  return jnp.where(big, x * root, root)


def _cube_root_above(c):
  """A number ``>= cbrt(c)`` (to rounding) and within 0.2% of it, for ``c >= 0``.

  ``jnp.cbrt`` is a scalar library call on XLA's CPU backend, not vectorised
  as a square root is. Here: the exponent divided by 3 in the bits,
  then one Newton step ``(2 y + c / y^2) / 3``, which is ``>= cbrt(c)`` for any
  ``y > 0`` (the arithmetic-geometric mean inequality).
  """
  if c.dtype != jnp.float32:
    return jnp.cbrt(c)
  bits = jax.lax.bitcast_convert_type(c, jnp.int32)
  y = jax.lax.bitcast_convert_type(bits // 3 + np.int32(709_921_077), jnp.float32)
  return (2 * y + c / (y * y)) * np.float32(1 / 3)


def _newton_ratio(t, m, beta):
  """``f(t) / q^2`` and ``f'(t) / q^2`` for ``f(t) = 2 t (t^2 - m) - beta``, ``q = max(t, 1)``."""
  inverse = 1 / jnp.maximum(t, 1)
  tq = t * inverse
  f = 2 * tq * ((t * t - m) * inverse) - beta * inverse * inverse
  df = 6 * tq * tq - 2 * m * inverse * inverse
  return f, df


def _newton_step(t, m, beta):
  f, df = _newton_ratio(t, m, beta)
  rising = df > 0
  return t - jnp.where(rising, f / jnp.where(rising, df, 1), 0), f, df


def _nearest_abs_slack(m, beta, guess):
  """The root ``t >= 0`` of ``2 t (t^2 - m) = beta`` (``beta >= 0``), from above.

  ``guess >= 0`` is a first-order estimate; see the module docstring.
  """
  jump, f, df = _newton_step(guess, m, beta)
  m_plus = jnp.maximum(m, 0)
  tiny = jnp.finfo(m.dtype).tiny
  bound = jnp.sqrt(m_plus) + jnp.minimum(
    _cube_root_above(beta / 2), beta / jnp.maximum(2 * jnp.abs(m) + 2 * m_plus, tiny)
  )
  t = jnp.minimum(bound, jnp.where(f >= 0, guess, jnp.where(df > 0, jump, bound)))
  for _ in range(_NEWTON_ITERATIONS):
    t, _, _ = _newton_step(t, m, beta)
  return jnp.maximum(t, 0)


@dataclasses.dataclass(frozen=True)
class NonNegative(Constraint):
  """``w >= 0`` entrywise, exactly, as ``w = s^2`` with a slack ``s``.

  No upper bound and no hyperparameter. A weight at or below 0 (or
  subnormal) is lifted to ``START = 0.00508`` by its update: at ``w = 0`` the slack is 0, the
  parabola's tangent is the slack's direction, no force reaches it, and the
  weight would never leave 0; at ``START`` the tangent makes the angle with
  the slack axis that :class:`~cola_jax.Circle`'s does at its start, 0.99 of
  its bound (``2 s / sqrt(1 + 4 s^2) = sqrt(1 - 0.99^2)``). Weights above 0
  stay; the slack starts at ``+sqrt(w)`` and changes sign when the weight
  passes through 0 (a trained weight is 0 only where ``s * s`` underflows). The parameter is always ``s * s``, so it
  is never negative, and the loss (or weight decay) must keep it from growing
  without bound when ``tau > 0``. See the module docstring for the
  projection, the RATTLE A step (and its one failure mode, a rejected step)
  and the invariant density ``exp(-V/tau) sqrt(1 + 4w) / sqrt(w)``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> cola.NonNegative().nearest(jnp.array([-1.0, 0.0, 0.5]))  # where the first update starts
    Array([0.00507601, 0.00507601, 0.5       ], dtype=float32)
    >>> # An input-convex layer: non-negative weights on the hidden path.
    >>> tx = cola.cola_ud(0.1, friction=1.0,
    ...                   constraints={'w_hidden': cola.NonNegative(), 'w_in': None, 'b': None})
  """

  momentum_coordinates = "frame"  # the coordinate along the parabola's unit tangent

  def init(self, param):
    return NonNegativeState(slack=jnp.sqrt(_lifted(param)))

  def point(self, param, aux):
    # The weight is the truth, the stored slack gives the branch s = +-sqrt(w).
    w = _lifted(param)
    root = jnp.sqrt(w)
    return w, jnp.where(aux.slack < 0, -root, root)

  def unpack(self, point, param):
    w, s = point
    return w, NonNegativeState(slack=s)

  def reconcile(self, param, aux):
    """The slack of the weight as ``params + updates`` rounded it, on the slack's branch.

    The rounding is relative to the old weight: a step from ``2.5e10`` to
    ``5.8e7`` in bfloat16 lands on 0, and ``w - s^2`` against the new weight
    would read 5.8e7 while ``w >= 0`` holds.
    """
    s = aux.slack
    return NonNegativeState(slack=jnp.where(param == s * s, s, jnp.copysign(jnp.sqrt(param), s)))

  def residual(self, param, aux):
    """:meth:`NonNegativeState.residual`."""
    return aux.residual(param)

  def ambient_gradient(self, point, grad):
    w, _ = point
    return grad, jnp.zeros_like(w)

  def ambient_normal(self, key, point):
    w, _ = point
    return _noise.normal_pair(key, w.shape, w.dtype, out_sharding=explicit_sharding(w))

  def project(self, anchor, step):
    w0, s0 = anchor
    a, b = w0 + step[0], s0 + step[1]
    # The start: the slack of the step's tangential part, s0 + (2 s0, 1) . step / n^2.
    inverse = _inverse_length(s0)
    guess = s0 + inverse * (2 * (s0 * inverse) * step[0] + inverse * step[1])
    t = _nearest_abs_slack(a - 0.5, jnp.abs(b), jnp.abs(guess))
    s = jnp.where(b < 0, -t, t)
    still = (step[0] == 0) & (step[1] == 0)  # a zero step moves nothing, not even by rounding
    # One pass computes the Newton iteration for both outputs (see computed_together).
    return computed_together(jnp.where(still, w0, s * s), jnp.where(still, s0, s))

  def cotangent(self, point, vector):
    _, s = point
    v_w, v_s = vector
    inverse = _inverse_length(s)
    return 2 * (s * inverse) * v_w + inverse * v_s

  def momentum_vector(self, point, momentum):
    """``v (2 s, 1) / n``: the coordinate ``v`` along the unit tangent as a vector."""
    _, s = point
    inverse = _inverse_length(s)
    return 2 * (s * inverse) * momentum, inverse * momentum

  def cotangent_draw(self, key, point):
    """The cotangent noise's coordinates, shaped like ``w``."""
    w, _ = point
    return _noise.normal_paired(key, w.shape, w.dtype, out_sharding=explicit_sharding(w))

  def cotangent_normal(self, point, draw):
    return draw

  def retract(self, point, tangent):
    """The nearest point of the parabola to ``q + v t``: it exists for every finite step, where RATTLE's may not."""
    _, s = point
    inverse = _inverse_length(s)
    return self.project(point, (2 * (s * inverse) * tangent, inverse * tangent))

  def a_step(self, point, momentum, h):
    w, s = point
    v = momentum
    inverse = _inverse_length(s)
    p_s = v * inverse  # p = v (2 s, 1) / n
    kappa = 8 * h * (s * inverse) * p_s * inverse
    # NaN and -inf (an infinite momentum, not a step to reject) pass, and show.
    solvable = ~((kappa < -1) & (kappa > -jnp.inf))
    rho = jnp.sqrt(jnp.maximum(1 + kappa, 0))
    velocity_s = 2 * p_s / (1 + rho)  # (s' - s) / h
    s_new = s + h * velocity_s
    inverse_new = _inverse_length(s_new)
    # (q' - q) / h = velocity_s (s' + s, 1); the new momentum is its coordinate along the unit tangent at q'.
    v_new = velocity_s * (2 * (s_new * inverse_new) * (s_new + s) + inverse_new)
    s_new = jnp.where(solvable, s_new, s)
    v_new = jnp.where(solvable, v_new, -v)
    w_new = jnp.where(s_new == s, w, s_new * s_new)
    w_new, s_new, v_new = computed_together(w_new, s_new, v_new)
    return (w_new, s_new), v_new
