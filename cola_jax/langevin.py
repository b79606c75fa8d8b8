r"""The constrained Langevin maps, generic over the constraint manifold.

Each function advances one parameter leaf on its manifold ``M = {g(q) = 0}``;
``constraint`` supplies the geometry (:class:`cola_jax.constraints.Constraint`).
Positions ``q`` include slack variables, ``V(q)`` is the loss (its gradient on
the slacks is zero), ``Pi(q)`` is the orthogonal projection onto the cotangent
space ``T*_q M``, ``h`` the step size, ``gamma`` the friction and ``tau`` the
temperature.

Overdamped (Euler-Maruyama, then projection onto ``M``):

.. math::
  q_{n+1} = \mathrm{proj}_{M}\big(q_n - h \nabla V(q_n) + \sqrt{2 \tau h}\, R_n\big).

Underdamped, split into

.. math::
  O:\ p \leftarrow \Pi(q)\big(e^{-\gamma h} p + \sqrt{\tau (1 - e^{-2\gamma h})}\, R\big),
  \quad B:\ p \leftarrow p - h\, \Pi(q) \nabla V(q),
  \quad A:\ \text{free flight on } M \text{ for time } h,

composed in the order O, B, A (the paper's OBA), or as BAOAB. The invariant measure of both dynamics has
density proportional to ``exp(-V / tau)`` with respect to the surface measure
of ``M`` (times the Gaussian in ``p`` for the underdamped one).

Randomness is explicit: a map reads its step's standard normal numbers
``noise`` as an argument (None: no noise), drawn from a PRNG key by
:func:`draw_noise`, which reads only the point's shapes, dtypes and shardings.
A transform can thus draw the noise of many leaves in one program and hand
each map its own.

With ``tau = 0`` and no constraint, :func:`overdamped_step` is gradient descent
with learning rate ``h`` and :func:`oba_step` is SGD with momentum
``exp(-gamma h)`` and learning rate ``h**2``, the momentum ``p`` being
``-h`` times SGD's.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Sec. 3 and Appendix B.
  Leimkuhler and Matthews, *Efficient molecular dynamics using geodesic
  integration and solvent-solute splitting*, Proc. R. Soc. A, 2016.
"""

from typing import Any

import jax

from cola_jax.constraints.base import Constraint, Momentum, Point

_DYNAMICS = ("overdamped", "OBA", "BAOAB")


def draw_noise(constraint: Constraint, key: jax.Array, point: Point, dynamics: str) -> Any:
  """The standard normal numbers one step of ``dynamics`` reads, drawn from ``key``.

  ``dynamics`` is ``"overdamped"`` (:func:`overdamped_step`: an ambient
  vector), ``"OBA"`` (:func:`oba_step`) or ``"BAOAB"`` (:func:`baoab_step`
  and :func:`o_step`: the numbers of a cotangent vector). Only the shapes,
  dtypes and shardings of ``point`` are read: the draw of a leaf does not
  wait for its values.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))
    >>> noise = langevin.draw_noise(circle, jax.random.key(0), point, "overdamped")  # (theta, xi) entries
    >>> [r.shape for r in noise]
    [(2,), (2,)]
  """
  if dynamics not in _DYNAMICS:
    raise ValueError(f"draw_noise: dynamics must be one of {_DYNAMICS}, got {dynamics!r}.")
  if dynamics == "overdamped" or (dynamics == "OBA" and constraint.project_noise_with_force):
    return constraint.ambient_normal(key, point)
  return constraint.cotangent_draw(key, point)


def overdamped_step(
  constraint: Constraint,
  point: Point,
  grad: jax.Array,
  h,
  noise_scale=None,
  noise: Any = None,
) -> Point:
  """One Euler-Maruyama step of size ``h``, projected back onto the manifold.

  ``noise_scale`` is ``sqrt(2 tau h)`` and ``noise`` the step's numbers
  (:func:`draw_noise` with ``"overdamped"``); without ``noise``, no noise.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> theta, xi = langevin.overdamped_step(circle, point, jnp.array([-4.0, 0.0]), h=0.1)
    >>> [round(float(t), 3) for t in theta], bool(jnp.allclose(theta**2 + xi**2, 1.0))  # (1.0, 0.8) projected
    ([0.781, -0.6], True)
  """
  step = jax.tree.map(lambda force: -h * force, constraint.ambient_gradient(point, grad))
  if noise is not None:
    step = jax.tree.map(lambda s, r: s + noise_scale * r, step, noise)
  return constraint.project(point, step)


def o_step(
  constraint: Constraint,
  point: Point,
  momentum: Momentum,
  decay,
  noise_scale=None,
  noise: Any = None,
) -> Momentum:
  """Friction and fluctuation: the exact Ornstein-Uhlenbeck flow on ``T*_q M``.

  ``decay`` is ``exp(-gamma h)``, ``noise_scale`` is
  ``sqrt(tau (1 - exp(-2 gamma h)))`` and ``noise`` the step's numbers
  (:func:`draw_noise` with ``"BAOAB"``); without ``noise``, friction only.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> langevin.o_step(circle, point, jnp.array([1.0, -1.0]), decay=0.5)  # no noise: friction only
    Array([ 0.5, -0.5], dtype=float32)
  """
  momentum = decay * momentum
  if noise is not None:
    momentum = momentum + noise_scale * constraint.cotangent_normal(point, noise)
  return momentum


def b_step(constraint: Constraint, point: Point, momentum: Momentum, grad: jax.Array, h) -> Momentum:
  """The kick by the projected force: ``p - h Pi(q) grad V(q)``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> momentum = langevin.b_step(circle, point, jnp.zeros(2), jnp.array([1.0, 1.0]), h=0.1)
    >>> [round(float(p), 3) for p in momentum]  # -h grad xi / r
    [-0.08, -0.08]
  """
  return momentum - h * constraint.projected_gradient(point, grad)


def a_step(constraint: Constraint, point: Point, momentum: Momentum, h) -> tuple[Point, Momentum]:
  """Free flight on the manifold for time ``h`` (exact or RATTLE, per geometry).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> (theta, xi), momentum = langevin.a_step(circle, point, jnp.array([1.0, -1.0]), h=0.1)
    >>> [round(float(t), 3) for t in theta], bool(jnp.allclose(theta**2 + xi**2, 1.0)), momentum
    ([0.677, -0.677], True, Array([ 1., -1.], dtype=float32))
  """
  return constraint.a_step(point, momentum, h)


def oba_step(
  constraint: Constraint,
  point: Point,
  momentum: Momentum,
  grad: jax.Array,
  h,
  decay,
  noise_scale=None,
  noise: Any = None,
) -> tuple[Point, Momentum]:
  """One underdamped step in the paper's order: O, then B, then A.

  ``noise``: the step's numbers (:func:`draw_noise` with ``"OBA"``), or None.

  Where the geometry says so (``constraint.project_noise_with_force``), O's
  noise and B's force are projected onto the cotangent space in one go,
  ``e^{-gamma h} p + Pi(q)(noise_scale R - h grad V(q))``: the same momentum
  up to rounding (``p`` is cotangent and ``Pi(q)`` linear), one projection
  instead of two.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> grad = jnp.array([1.0, 1.0])
    >>> (theta, xi), momentum = langevin.oba_step(circle, point, jnp.zeros(2), grad, h=0.1, decay=0.9)
    >>> [round(float(p), 3) for p in momentum], bool(jnp.allclose(theta**2 + xi**2, 1.0))  # p = -h grad xi / r
    ([-0.08, -0.08], True)
  """
  if noise is not None and constraint.project_noise_with_force:
    force = jax.tree.map(lambda r, g: noise_scale * r - h * g, noise, constraint.ambient_gradient(point, grad))
    momentum = jax.tree.map(lambda p, f: decay * p + f, momentum, constraint.cotangent(point, force))
  else:
    momentum = b_step(constraint, point, o_step(constraint, point, momentum, decay, noise_scale, noise), grad, h)
  return a_step(constraint, point, momentum, h)


def baoab_step(
  constraint: Constraint,
  point: Point,
  momentum: Momentum,
  grad: jax.Array,
  h,
  kick,
  decay,
  noise_scale=None,
  noise: Any = None,
) -> tuple[Point, Momentum]:
  """One BAOAB step, written as B A O A with the kick ``kick``.

  ``noise``: the step's numbers (:func:`draw_noise` with ``"BAOAB"``), or None.

  BAOAB's closing half kick ``B(h/2)`` needs the gradient at the new point,
  which an optimizer only receives at its next call. Merging it with the next
  step's opening half kick gives ``B(h) A(h/2) O A(h/2)`` per call, with
  ``kick = h/2`` on the first call and ``h`` afterwards: the positions are
  BAOAB's exactly, and the stored momentum is the one before the closing half
  kick.

  References:
    Leimkuhler and Matthews, *Rational construction of stochastic numerical
    methods for molecular sampling*, AMRX 2013 (BAOAB's configurational
    accuracy).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> grad = jnp.array([1.0, 1.0])
    >>> (theta, xi), momentum = langevin.baoab_step(
    ...     circle, point, jnp.zeros(2), grad, h=0.1, kick=0.05, decay=0.9)  # the first call: kick h / 2
    >>> [round(float(p), 3) for p in momentum], bool(jnp.allclose(theta**2 + xi**2, 1.0))
    ([-0.036, -0.036], True)
  """
  momentum = b_step(constraint, point, momentum, grad, kick)
  point, momentum = a_step(constraint, point, momentum, h / 2)
  momentum = o_step(constraint, point, momentum, decay, noise_scale, noise)
  return a_step(constraint, point, momentum, h / 2)
