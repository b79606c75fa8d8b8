"""What a constraint manifold provides to the Langevin maps.

A constraint acts on one parameter leaf. Its *point* is the leaf's position on
the manifold in whatever coordinates the geometry prefers (a slack variable
beside the weights, a tall matrix view of a kernel), its *momentum* lives in the
cotangent space at that point, in the geometry's own coordinates. The Langevin
maps in :mod:`cola_jax.langevin` only combine these operations; they know
nothing about a particular manifold.

Every method is a pure function of arrays, safe under ``jit`` and ``vmap``.
"""

import abc
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from cola_jax import _compiled, _noise
from cola_jax._numerics import explicit_sharding

Point = Any
Momentum = Any
Aux = Any


class Constraint(abc.ABC):
  """A manifold ``{q : g(q) = 0}`` for one parameter leaf.

  Subclasses are frozen dataclasses: hashable, comparable, and free of arrays
  other than hyperparameters, so that transforms can be rebuilt inside
  ``optax.inject_hyperparams`` without recompiling.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> circle = cola.Circle(0.5)
    >>> isinstance(circle, cola.Constraint), circle == cola.Circle(0.5)
    (True, True)
    >>> w = circle.nearest(jnp.array([0.7, -0.2]))  # the leaf on the manifold
    >>> aux = circle.init(w)  # its auxiliary state
    >>> w, float(aux.residual(w))
    (Array([ 0.495, -0.2  ], dtype=float32), 0.0)
  """

  # Whether CoLA-ud's O and B steps project the noise and the force onto the
  # cotangent space together (the projection is linear): worth it where a
  # projection costs products or a solve, not where the noise is drawn in
  # cotangent coordinates directly.
  project_noise_with_force: ClassVar[bool] = False
  # How momenta (and the tangent vectors of :func:`~cola_jax.constrained`) are
  # stored: "ambient", as vectors of the ambient space whose tangent part
  # ``cotangent`` takes; "frame", as coordinates in a frame of the tangent
  # space (tangent whatever their values).
  momentum_coordinates: ClassVar[str] = "ambient"

  def validate(self, param: jax.Array, path: str) -> None:
    """Raises ValueError naming ``path`` if the leaf cannot carry this constraint."""

  @abc.abstractmethod
  def init(self, param: jax.Array) -> Aux:
    """The auxiliary state (slack variables, diagnostics) for a new leaf.

    It has a method ``residual(param)``: how far ``param`` (with this state) is
    from the manifold, as a scalar.
    """

  def nearest(self, param: jax.Array) -> jax.Array:
    """The parameter value on the manifold that the first update would start from."""
    return _compiled.call(_nearest_from_itself, (self,), param)

  @abc.abstractmethod
  def point(self, param: jax.Array, aux: Aux) -> Point:
    """The point on the manifold re-established from the current parameter.

    Rounding in ``params + updates`` and parameters that start off the manifold
    are corrected here, so that error never accumulates over steps.
    """

  @abc.abstractmethod
  def unpack(self, point: Point, param: jax.Array) -> tuple[jax.Array, Aux]:
    """The parameter value (shaped like ``param``) and auxiliary state of a point."""

  @abc.abstractmethod
  def ambient_gradient(self, point: Point, grad: jax.Array) -> Point:
    """The loss gradient as a vector of the ambient space (zero on slacks)."""

  @abc.abstractmethod
  def ambient_normal(self, key: jax.Array, point: Point) -> Point:
    """A standard normal vector of the ambient space.

    A draw reads only the point's shapes, dtypes and shardings, never its
    values, so that the transforms can draw it apart from the step.
    """

  @abc.abstractmethod
  def project(self, anchor: Point, step: Point) -> Point:
    """The point of the manifold reached by the ambient ``step`` from ``anchor``.

    ``anchor + step`` is generally off the manifold; it is corrected along the
    constraint force of the geometry's choice.
    """

  @abc.abstractmethod
  def cotangent(self, point: Point, vector: Point) -> Momentum:
    """Orthogonal projection of an ambient vector onto the cotangent space."""

  def projected_gradient(self, point: Point, grad: jax.Array) -> Momentum:
    """The loss gradient projected onto the cotangent space: ``Pi(q) grad V(q)``.

    By default the cotangent of :meth:`ambient_gradient`; a geometry may say it
    more cheaply (the gradient is zero on slack variables).
    """
    return self.cotangent(point, self.ambient_gradient(point, grad))

  def cotangent_draw(self, key: jax.Array, point: Point) -> Any:
    """The standard normal numbers a cotangent noise vector is made of (:meth:`cotangent_normal`).

    By default an ambient vector (:meth:`ambient_normal`); a geometry with a
    frame of the tangent space draws its coordinates directly. As a draw of
    :meth:`ambient_normal`, it reads only the point's shapes, dtypes and
    shardings.
    """
    return self.ambient_normal(key, point)

  def cotangent_normal(self, point: Point, draw: Any) -> Momentum:
    """A standard normal vector of the cotangent space at ``point``, made of ``draw`` (:meth:`cotangent_draw`).

    By default the ambient draw projected by :meth:`cotangent`.
    """
    return self.cotangent(point, draw)

  def zero_momentum(self, param: jax.Array) -> jax.Array:
    """The stored form of a zero momentum for the leaf."""
    return jnp.zeros_like(param)

  def load_momentum(self, stored: jax.Array) -> Momentum:
    """The momentum in the geometry's coordinates from its stored form.

    By default the momentum is stored as it is, shaped like the leaf.
    """
    return stored

  def store_momentum(self, momentum: Momentum, param: jax.Array) -> jax.Array:
    """The stored form of a momentum (shaped like the leaf)."""
    return momentum

  @abc.abstractmethod
  def a_step(self, point: Point, momentum: Momentum, h) -> tuple[Point, Momentum]:
    """The constrained free flight (the A step) over time ``h``."""

  def retract(self, point: Point, tangent: Momentum) -> Point:
    """The point reached from ``point`` by the tangent vector ``tangent`` (in momentum coordinates).

    A retraction (``R(q, 0) = q``, first-order along ``tangent``) that
    :func:`~cola_jax.constrained` moves the leaf by; it must exist for every
    finite vector, since an optimizer's step can be of any size. By default
    the A step for unit time: the exact geodesic flow where the geometry has
    one. A geometry whose A step can reject a step overrides it.
    """
    return self.a_step(point, tangent, 1.0)[0]


def _nearest_from_itself(constraint: Constraint, param: jax.Array) -> jax.Array:
  return constraint.unpack(constraint.point(param, constraint.init(param)), param)[0]


class Euclidean(Constraint):
  """No constraint: the flat space of the leaf, for weights left free."""

  def __eq__(self, other):
    return isinstance(other, Euclidean)

  def __hash__(self):
    return hash(Euclidean)

  def __repr__(self):
    return "Euclidean()"

  def init(self, param):
    return None

  def point(self, param, aux):
    return param

  def unpack(self, point, param):
    return point, None

  def ambient_gradient(self, point, grad):
    return grad

  def ambient_normal(self, key, point):
    return _noise.normal_paired(key, point.shape, point.dtype, out_sharding=explicit_sharding(point))

  def project(self, anchor, step):
    return anchor + step

  def cotangent(self, point, vector):
    return vector

  def a_step(self, point, momentum, h):
    return point + h * momentum, momentum
