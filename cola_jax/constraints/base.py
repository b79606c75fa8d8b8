r"""The constraint protocol: what a constraint manifold provides to the Langevin maps and the optimizers.

A constraint acts on one parameter leaf. Its *point* is the leaf's position on
the manifold in whatever coordinates the geometry prefers (a slack variable
beside the weights, a tall matrix view of a kernel), its *momentum* lives in the
cotangent space at that point, in the geometry's own coordinates. The Langevin
maps in :mod:`cola_jax.langevin`, :func:`~cola_jax.constrained` and
:func:`~cola_jax.manifold_muon` only combine these operations; they know
nothing about a particular manifold.

Every method is a pure function of arrays, safe under ``jit`` and ``vmap``.
A new constraint writes :meth:`Constraint.project` and
:meth:`Constraint.cotangent`; see :class:`Constraint` for the rest and
``docs/guides/custom_constraint.md`` for a worked example, and check it with
:func:`cola_jax.testing.check_constraint`.
"""

import abc
import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from cola_jax import _compiled, _noise
from cola_jax._numerics import explicit_sharding, max_abs

Point = Any
Momentum = Any
Aux = Any


@functools.partial(jax.tree_util.register_dataclass, data_fields=["slack"], meta_fields=["constraint"])
@dataclasses.dataclass(frozen=True)
class ConstraintState:
  """The auxiliary state of a leaf whose constraint keeps no state of its own: its slack variables, if any.

  What :meth:`Constraint.init` returns by default (``slack=None``). A
  constraint with slack variables may return it too, with the slacks in
  ``slack`` (any pytree of arrays). ``constraint`` is static (part of the tree
  structure), so that :func:`~cola_jax.constraint_residuals` finds the
  constraint's :meth:`~Constraint.residual` from the state alone.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> class Sphere(cola.Constraint):  # |w| = 1, no slack: two methods
    ...   def project(self, anchor, step):
    ...     moved = anchor + step
    ...     return moved / jnp.linalg.norm(moved)
    ...   def cotangent(self, point, vector):
    ...     return vector - jnp.vdot(point, vector) * point
    >>> sphere = Sphere()
    >>> state = sphere.init(jnp.array([3.0, 4.0]))
    >>> state.slack is None, state.constraint is sphere
    (True, True)
    >>> float(state.residual(jnp.array([0.6, 0.8])))  # on the sphere
    0.0
  """

  slack: Any = None
  constraint: "Constraint | None" = None

  def residual(self, param: jax.Array) -> jax.Array:
    """The constraint's :meth:`~Constraint.residual` of ``param`` with this state."""
    if self.constraint is None:
      raise ValueError("ConstraintState.residual: the state names no constraint (constraint=None).")
    return self.constraint.residual(param, self)


class Constraint(abc.ABC):
  r"""A manifold ``M = {q : g(q) = 0}`` for one parameter leaf: the protocol a constraint implements.

  The leaf ``x`` (with slack variables ``s``, if the geometry has them:
  ``q = (x, s)``) moves on ``M``, a smooth submanifold of an ambient Euclidean
  space ``R^N``. The Langevin maps and the optimizers need five operations:

  * the projection onto ``M`` of an ambient step from a point,
    ``project(q, D) = P(q + D) in M``, which lands on ``M`` for every finite
    step: the nearest point, or the point along the normals at ``q``
    (SHAKE, ``q + D + G(q)^T lambda``, ``G = dg/dq``);
  * the orthogonal projection onto the tangent space,
    ``Pi(q) v = v - G^T (G G^T)^{-1} G v``, which is also the projection onto
    the cotangent space (the metric is Euclidean): ``cotangent(q, v)``;
  * the free flight on ``M`` (the A step) over time ``h``, by default RATTLE
    through :meth:`project`,

    .. math::
      q' = P(q + h p), \qquad p' = \Pi(q')\Big(p + \frac{q' - (q + h p)}{h}\Big)
         = \Pi(q')\,\frac{q' - q}{h};

  * a retraction ``R(q, v)`` (``R(q, 0) = q``, first order along ``v``) for
    :func:`~cola_jax.constrained`, by default the A step for unit time
    (``P(q + v)`` with the default A step);
  * standard normal ambient vectors for the noise, by default
    ``jax.random.normal`` for each array of the point.

  A point, a momentum and an ambient vector may be any pytree of arrays
  (a slack constraint's tuple ``(x, s)``): every map applies arithmetic to
  them leaf by leaf.

  So a constraint without slack variables writes two methods,
  :meth:`project` and :meth:`cotangent`; every other method has a default
  built on them. Its point is then the leaf itself, re-established each
  update by ``project(x, 0)`` (so rounding in ``params + updates`` never
  accumulates), its state a :class:`ConstraintState`, its momentum an
  ambient vector shaped like the leaf, and its :meth:`residual` how far that
  re-establishment moves the leaf (override it with ``max |g(x)|`` where
  ``g`` is at hand). A constraint with slack variables (an inequality
  ``d(x) <= 0`` as ``d(x) + s^2 = 0``) writes :meth:`init` (the slacks of a
  new leaf), :meth:`point` (the leaf and its slacks as one point) and
  :meth:`unpack` (the way back), and :meth:`ambient_gradient` (the loss
  gradient, zero on the slacks). A geometry with an exact geodesic flow,
  a frame of its tangent spaces or a cheaper noise overrides the rest; each
  default says what it computes.

  Subclasses are hashable and comparable (frozen dataclasses, say) and hold
  no arrays other than static hyperparameters, so that transforms can be
  rebuilt inside ``optax.inject_hyperparams`` without recompiling.
  :func:`cola_jax.testing.check_constraint` checks an implementation against
  this protocol.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> circle = cola.Circle(0.5)
    >>> isinstance(circle, cola.Constraint), circle == cola.Circle(0.5)
    (True, True)
    >>> w = circle.nearest(jnp.array([0.7, -0.2]))  # the leaf on the manifold
    >>> aux = circle.init(w)  # its auxiliary state
    >>> float(circle.residual(w, aux))
    0.0
    >>> with jnp.printoptions(precision=4):  # 0.7 beyond the radius 0.5: 0.99 r, just inside
    ...   print(w)
    [ 0.495 -0.2  ]
  """

  project_noise_with_force: ClassVar[bool] = False
  """Whether CoLA-ud's O and B steps project the noise and the force onto the cotangent space in one call.

  The projection is linear, so ``Pi(q)(sigma R - h grad)`` is the same
  momentum up to rounding as two projections. Worth it (``True``) where a
  projection costs products or a solve; not where the noise is drawn in
  cotangent coordinates directly (:meth:`cotangent_draw`). Default ``False``.
  """

  momentum_coordinates: ClassVar[str] = "ambient"
  """How momenta (and the tangent vectors of :func:`~cola_jax.constrained`) are held.

  ``"ambient"`` (the default): vectors of the ambient space, shaped like the
  point, whose tangent part :meth:`cotangent` takes. ``"frame"``: coordinates
  in an orthonormal frame of the tangent space, tangent whatever their values
  (:meth:`cotangent` returns them, :meth:`momentum_vector` maps them to the
  ambient vector); :func:`~cola_jax.testing.check_constraint` then checks
  that the frame is orthonormal.
  """

  # What every constraint writes.

  @abc.abstractmethod
  def project(self, anchor: Point, step: Any) -> Point:
    """The point of the manifold reached by the ambient ``step`` from ``anchor``.

    ``anchor + step`` is generally off the manifold; it is corrected along the
    constraint force of the geometry's choice (the nearest point, or along
    the normals at ``anchor``). It must land on the manifold for every finite
    ``anchor + step`` and give NaN for a NaN input.
    """

  @abc.abstractmethod
  def cotangent(self, point: Point, vector: Any) -> Momentum:
    """Orthogonal projection of an ambient vector onto the cotangent space, in momentum coordinates."""

  # Defaults: a leaf without slack variables, stepped through project and cotangent.

  def validate(self, param: jax.Array, path: str) -> None:
    """Raises ValueError naming ``path`` if the leaf cannot carry this constraint."""

  def init(self, param: jax.Array) -> Aux:
    """The auxiliary state (slack variables, diagnostics) for a new leaf.

    By default a :class:`ConstraintState` without slacks.
    """
    return ConstraintState(constraint=self)

  def point(self, param: jax.Array, aux: Aux) -> Point:
    """The point on the manifold re-established from the current parameter.

    Rounding in ``params + updates`` and parameters that start off the manifold
    are corrected here, so that error never accumulates over steps. By
    default the leaf projected from itself, ``project(param, 0)``.
    """
    return self.project(param, jnp.zeros_like(param))

  def unpack(self, point: Point, param: jax.Array) -> tuple[jax.Array, Aux]:
    """The parameter value (shaped like ``param``) and auxiliary state of a point.

    By default the point is the parameter, and the state :meth:`init`'s of it.
    """
    return point, self.init(point)

  def reconcile(self, param: jax.Array, aux: Aux) -> Aux:
    """The state of the parameter that ``optax.apply_updates`` made of an update's new value.

    ``params + updates`` rounds the new value in the parameter's dtype
    relative to the old one, so a state of the new value may disagree with
    the parameter the user holds by the old value's rounding. By default the
    state is kept: :meth:`point` rebuilds the next point from the parameter,
    and a bounded leaf's rounding is within its residual's tolerance. Override
    it where the residual compares the state with the parameter relative to
    the new value and the leaf is unbounded (:class:`~cola_jax.NonNegative`'s
    slack, after a weight of 1e10 steps to 1e7 in bfloat16).

    Example:
      >>> import jax.numpy as jnp, cola_jax as cola
      >>> c = cola.NonNegative()
      >>> aux = c.init(jnp.array([4.0, 4.0]))  # slacks 2, 2
      >>> c.reconcile(jnp.array([4.0, 0.0]), aux).slack  # the second weight was rounded to 0
      Array([2., 0.], dtype=float32)
    """
    del param
    return aux

  def residual(self, param: jax.Array, aux: Aux) -> jax.Array:
    """How far ``param`` (with its state ``aux``) is from the manifold, a scalar.

    What :func:`~cola_jax.constraint_residuals` reports for the leaf.

    By default how far re-establishing the point moves the parameter,
    relative to its largest entry, ``max |x - P(x)| / max |x|`` with ``P`` the
    projection of :meth:`point`, computed in at least float32 (NaN shows as
    ``inf``). This checks the projection only against itself: a consistent
    projection onto the wrong set passes it (and
    :func:`~cola_jax.testing.check_constraint` says so). A constraint given by
    a function ``g`` of order one returns ``max |g(x)|`` instead.
    """
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    x = param.astype(dtype)
    moved = self.unpack(self.point(param, aux), param)[0].astype(dtype)
    return max_abs(moved - x) / jnp.maximum(max_abs(x), jnp.finfo(dtype).tiny)

  def nearest(self, param: jax.Array) -> jax.Array:
    """The parameter value on the manifold that the first update would start from.

    By default ``unpack(point(param, init(param)), param)[0]``, compiled once
    per shape: whatever :meth:`init` and :meth:`point` make of a new leaf. A
    start where no force reaches the point (a slack at 0, where the loss
    gradient has no tangent part) should be moved by them to where one does:
    :class:`~cola_jax.Circle` starts at most at 0.99 of its bound,
    :class:`~cola_jax.NonNegative` lifts a weight at or below 0.
    """
    return _compiled.call(_nearest_from_itself, (self,), param)

  def ambient_gradient(self, point: Point, grad: jax.Array) -> Any:
    """The loss gradient as a vector of the ambient space (zero on slacks), shaped like the point.

    By default the gradient itself, for a point that is the leaf (one array
    of its shape). A point of another structure (a slack constraint's
    ``(x, s)``) must override it: the default then raises a ``TypeError``
    naming this method, at trace time.
    """
    leaves = jax.tree.leaves(point)
    if jax.tree.structure(point) != jax.tree.structure(grad) or leaves[0].shape != jnp.shape(grad):
      shapes = jax.tree.map(jnp.shape, point)
      raise TypeError(
        f"{self!r}.ambient_gradient: the point (shapes {shapes}) is not the leaf (shape {jnp.shape(grad)}), so the "
        "default (the gradient itself) does not apply: override ambient_gradient(point, grad) to return the loss "
        "gradient shaped like the point (zero on the slacks)."
      )
    return grad

  def ambient_normal(self, key: jax.Array, point: Point) -> Any:
    """A standard normal vector of the ambient space.

    A draw reads only the point's shapes, dtypes and shardings, never its
    values, so that the transforms can draw it apart from the step. By default
    ``jax.random.normal`` for each array of the point, from its own key.
    """
    arrays, treedef = jax.tree.flatten(point)
    keys = [key] if len(arrays) == 1 else list(jax.random.split(key, len(arrays)))
    draws = [jax.random.normal(k, a.shape, a.dtype, out_sharding=explicit_sharding(a)) for k, a in zip(keys, arrays)]
    return treedef.unflatten(draws)

  def momentum_vector(self, point: Point, momentum: Momentum) -> Any:
    """The ambient (tangent) vector of a momentum given in this geometry's coordinates.

    By default the momentum itself (``momentum_coordinates = "ambient"``); a
    geometry whose momenta are coordinates in a frame maps them to the
    vector, an isometry onto the tangent space.
    """
    return momentum

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

  def zero_momentum(self, param: jax.Array) -> Any:
    """The stored form of a zero momentum for the leaf.

    By default zeros shaped like :meth:`store_momentum` of :meth:`cotangent`'s
    output for an ambient vector at the point of ``param`` (by
    :func:`jax.eval_shape`, nothing computed): the point's structure in
    ambient coordinates (a tuple ``(x, s)`` for a slack constraint), the
    frame's in ``"frame"`` coordinates. Arrays shaped like the leaf keep its
    sharding.
    """

    def stored_momentum(p):
      q = self.point(p, self.init(p))
      return self.store_momentum(self.cotangent(q, self.ambient_normal(jax.random.key(0), q)), p)

    # Shapes only: traced without the leaf's sharding, which a geometry's reshapes need not support.
    shapes = jax.eval_shape(stored_momentum, jax.ShapeDtypeStruct(jnp.shape(param), jnp.result_type(param)))
    return jax.tree.map(
      lambda a: jnp.zeros_like(param, a.dtype) if a.shape == param.shape else jnp.zeros(a.shape, a.dtype), shapes
    )

  def load_momentum(self, stored: Any) -> Momentum:
    """The momentum in the geometry's coordinates from its stored form (:meth:`zero_momentum`'s structure).

    By default the momentum is stored as it is (any pytree of arrays).
    """
    return stored

  def store_momentum(self, momentum: Momentum, param: jax.Array) -> Any:
    """The stored form of a momentum, the inverse of :meth:`load_momentum`; by default the momentum itself."""
    return momentum

  def a_step(self, point: Point, momentum: Momentum, h) -> tuple[Point, Momentum]:
    """The constrained free flight (the A step) over time ``h``.

    By default RATTLE through :meth:`project`: the point moves to
    ``q' = project(q, h v)`` (``v`` the momentum's vector,
    :meth:`momentum_vector`), and the momentum takes the same constraint
    impulse and is projected onto the cotangent space at ``q'``; at ``h = 0``
    nothing moves. Where :meth:`project` is SHAKE along the normals at ``q``
    this is the symplectic, time-reversible RATTLE; with another projection
    (the nearest point) a consistent first-order flight.
    """
    step = jax.tree.map(lambda v: h * v, self.momentum_vector(point, momentum))
    new = self.project(point, step)
    moving = h != 0
    inverse_h = jnp.where(moving, 1 / jnp.where(moving, h, 1), 0)
    velocity = jax.tree.map(
      lambda v, q1, q0, d: v + jnp.where(moving, (q1 - q0 - d) * inverse_h, 0),
      self.momentum_vector(point, momentum),
      new,
      point,
      step,
    )
    return new, self.cotangent(new, velocity)

  def retract(self, point: Point, tangent: Momentum) -> Point:
    """The point reached from ``point`` by the tangent vector ``tangent`` (in momentum coordinates).

    A retraction (``R(q, 0) = q``, first-order along ``tangent``) that
    :func:`~cola_jax.constrained` moves the leaf by; it must exist for every
    finite vector, since an optimizer's step can be of any size. By default
    the A step for unit time: the exact geodesic flow where the geometry has
    one (with the default A step, ``project(q, v)``). A geometry whose A step
    can reject a step overrides it.
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

  def ambient_normal(self, key, point):
    return _noise.normal_paired(key, point.shape, point.dtype, out_sharding=explicit_sharding(point))

  def project(self, anchor, step):
    return anchor + step

  def cotangent(self, point, vector):
    return vector

  def a_step(self, point, momentum, h):
    return point + h * momentum, momentum
