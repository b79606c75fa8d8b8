r"""Any optax optimizer on the constraint manifolds: Riemannian gradient, inner step, retraction.

``constrained(inner, constraints=...)`` runs an optax transformation ``inner``
(Adam, AdamW, Lion, RMSProp, SGD with momentum, a chain, ...) on the manifold of
each leaf's constraint. Per constrained leaf at the point ``q`` (with its slack
variables):

.. math::
  g_R = \Pi_q \nabla V(q), \qquad u = \mathrm{inner}(g_R), \qquad
  q_{+} = R_q(\Pi_q u),

where ``Pi_q`` is the orthogonal projection onto the tangent space and ``R_q``
a retraction that exists for every finite step. Unconstrained leaves get
``inner``'s update as it is.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from cola_jax import _compiled
from cola_jax._engine import Driver, check_state_type, initial_auxes
from cola_jax._hyperparameters import caller
from cola_jax._tree import NOT_PARAMS, ConstraintSpec, is_params_placeholder, without_variables
from cola_jax.constraints.base import Constraint, Euclidean

_RETRACTIONS = ("polar", "projection")


class ConstrainedState(NamedTuple):
  """State of :func:`constrained`: the inner transformation's state and each leaf's constraint state.

  Example:
    >>> import jax.numpy as jnp, optax, cola_jax as cola
    >>> tx = cola.constrained(optax.sgd(0.1, momentum=0.9), constraints=cola.Circle(0.5))
    >>> tx.init(jnp.array([0.3, 0.0]))  # SGD's trace; the slack of |w| <= 0.5
    ConstrainedState(inner_state=(TraceState(trace=Array([0., 0.], dtype=float32)), EmptyState()),
                     constraint_states=CircleState(slack=Array([0.4, 0.5], dtype=float32),
                                                   radius=Array(0.5, dtype=float32)))
  """

  inner_state: Any  # the inner transformation's state, over the tangent coordinates of the leaves
  constraint_states: Any  # per leaf: auxiliary state of its constraint (None if free); not a copy of the parameters


def _tangent(c: Constraint, point, vector, param):
  """``Pi_q`` of a param-shaped ambient vector, in the stored momentum form of the leaf."""
  return c.store_momentum(c.cotangent(point, c.ambient_gradient(point, vector)), param)


def _seen_params(constraints: Sequence, points: list, compute: list, params: list) -> list:
  """The leaves as ``inner`` sees them: free leaves as given, constrained ones as their tangent projections."""
  return [param if q is None else _tangent(c, q, p, p) for c, q, p, param in zip(constraints, points, compute, params)]


def _initial_state(inner, constraints: tuple, treedef, compute: list, params: list) -> tuple[Any, list]:
  """``inner``'s state for these leaves and their constraint states (compiled as one program by ``init``)."""
  auxes = initial_auxes(constraints, compute)
  points = [None if isinstance(c, Euclidean) else c.point(p, aux) for c, p, aux in zip(constraints, compute, auxes)]
  return inner.init(treedef.unflatten(_seen_params(constraints, points, compute, params))), auxes


def _retract(c: Constraint, point, coordinates, retraction: str):
  """The point reached from ``point`` by the tangent vector with these momentum coordinates."""
  if c.momentum_coordinates == "ambient":
    coordinates = c.cotangent(point, coordinates)
    if retraction == "projection":
      return c.project(point, coordinates)
  return c.retract(point, coordinates)


def constrained(
  inner: optax.GradientTransformation,
  *,
  constraints: ConstraintSpec,
  retraction: str = "polar",
) -> optax.GradientTransformationExtraArgs:
  r"""Runs any optax transformation on the manifolds of the constraints.

  For a constrained leaf at the point ``q`` (its slack variables included),
  ``inner`` receives the Riemannian gradient ``Pi_q grad V(q)``, the loss
  gradient projected onto the tangent space; its update ``u`` is projected onto
  the tangent space at ``q`` and the leaf moves to ``R_q(Pi_q u)`` on the
  manifold:

  .. math::
    q_{n+1} = R_{q_n}\big(\Pi_{q_n}\, \mathrm{inner}(\Pi_{q_n} \nabla V(q_n))\big).

  Unconstrained leaves (``None``) get exactly ``inner``'s update, as
  ``inner`` alone would give it: ``inner`` is their optimizer too (there is no
  ``free=`` here; ``optax.partition`` gives them another).

  A start off the manifold. Every update re-establishes each leaf's point
  from the parameters it is given, so the first update from a leaf off its
  manifold starts at its constraint's ``nearest`` point (where
  :func:`~cola_jax.project_params` puts it: a kernel's polar factor, a
  bounded weight at most 0.99 of its bound) and takes its step from there,
  with the gradient computed at the starting parameters. To compute that
  gradient on the manifold too, call :func:`~cola_jax.project_params` before
  ``init``.

  What ``inner`` sees of a constrained leaf: its tangent vectors in the
  coordinates the constraint stores momenta in (those of ``cola_ud``), shaped
  like the leaf except for :class:`~cola_jax.Implicit` (flat, ``(n + K,)``: the
  entries, then the ``K`` slacks):

  * :class:`~cola_jax.Orthogonal`, :class:`~cola_jax.UnitNorm`,
    :class:`~cola_jax.Implicit`: the projected gradient as an ambient vector.
  * :class:`~cola_jax.Circle`, :class:`~cola_jax.Box`,
    :class:`~cola_jax.NonNegative`: one number per weight, the gradient's
    component along the unit tangent of the weight's circle or parabola
    (``dV/dtheta * xi / r`` on a circle: it vanishes at the bounds).
  * :class:`~cola_jax.MaxNorm`: the coordinates of the tangent vector in the
    frame rotated from the pole (an isometry: ``|u| = |Pi grad|``).

  The ``params`` that ``inner`` gets (AdamW's weight decay, for instance) are
  the tangent projections of the parameters in the same coordinates: decay is
  the Riemannian gradient of ``|w|^2 / 2``. On an ``Orthogonal`` leaf it is
  zero (``W`` is normal to the Stiefel manifold at ``W``): weight decay does
  nothing there, and on a ``UnitNorm`` leaf neither.

  Momenta. ``inner``'s state (Adam's moments, SGD's trace) stays in these
  coordinates as ``inner`` keeps it; it is not transported. Each update is
  projected onto the tangent space at the current point before the retraction,
  which is how embedded manifolds transport vectors (projection), applied to
  the update rather than to the first moment, so that any ``inner`` works
  without knowing which of its state is a first moment. The frame coordinates
  of circles, parabolas and MaxNorm's slack spheres follow the point, and the projection
  keeps the ambient ones tangent.

  Retraction. ``"polar"`` (default): every leaf moves by its constraint's
  :meth:`~cola_jax.Constraint.retract` along ``Pi u``, which exists for
  every finite step: for ``Orthogonal`` the polar factor of ``Q + Pi u`` (the
  nearest orthonormal matrix, by Newton-Schulz iterations), or its QR factor,
  as its ``retraction`` field says; the exact geodesic flow for unit
  time (circle, box, MaxNorm), the radial projection (unit norm), the nearest
  point of the parabola (non-negative), SHAKE and, where SHAKE has no
  solution, Newton's projection from the moved point (implicit; a unit that
  neither reaches stays where it was, flagged). ``"projection"``: the leaves
  whose tangent vectors are ambient (``Orthogonal``, ``UnitNorm``,
  ``Implicit``) move by their constraint's own projection along ``q_n``, as in
  :func:`~cola_jax.cola_od` (with ``inner = optax.sgd(h)`` this is
  ``cola_od(h)``); for ``Orthogonal`` its equation has no solution once the
  step's normal part has spectral norm above 1 (Adam's elementwise steps
  reach that), and the projection then falls back to the polar factor and
  flags the leaf's :class:`~cola_jax.ProjectionInfo`.

  Args:
    inner: any ``optax.GradientTransformation``; its learning rate sets the step.
    constraints: as for :func:`~cola_jax.cola_od`: a ``Constraint``, ``None``,
      a pytree prefix of the parameters, a callable of the parameters
      (:func:`~cola_jax.path_constraints`, :func:`~cola_jax.constraints_from`).
    retraction: ``"polar"`` (each constraint's ``retract``) or ``"projection"``
      (the projection along ``q_n`` where the tangent vectors are ambient).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params``; extra arguments go to ``inner``. It must be the last link of a
    chain (what follows would leave the manifold).

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.constrained(optax.adam(1e-2), constraints={'w': cola.Orthogonal(), 'b': None})
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> w = params['w']
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-5)), params['b'].round(4)  # b: Adam's step
    (True, Array([-0.01, -0.01], dtype=float32))

  References:
    Absil, Mahony, Sepulchre, *Optimization Algorithms on Matrix Manifolds*,
    2008 (retractions, projection as vector transport).
    Becigneul, Ganea, *Riemannian Adaptive Optimization Methods*, ICLR 2019.
  """
  owner = caller("constrained")
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"{owner}: inner must be an optax.GradientTransformation such as optax.adam(1e-3), got {type(inner).__name__}."
    )
  if retraction not in _RETRACTIONS:
    raise ValueError(f"{owner}: retraction must be one of {_RETRACTIONS}, got {retraction!r}.")
  return riemannian(owner, inner, constraints, retraction)


def riemannian(
  owner: str,
  inner: optax.GradientTransformation,
  constraints: ConstraintSpec,
  retraction: str,
  *,
  check: Callable[[str, Constraint], None] | None = None,
  direction: Callable[[Any, Any], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """:func:`constrained`, for the transforms built on it.

  ``check(path, constraint)`` raises for a constraint the caller does not
  step; ``direction(constraint, g)`` maps each constrained leaf's Riemannian
  gradient (in its momentum coordinates) before ``inner`` sees it.
  """
  inner = optax.with_extra_args_support(inner)
  driver = Driver(owner, constraints, steps_free_leaves=False, check=check)

  def init_fn(params):
    if is_params_placeholder(params):  # optax.tree.map_params: inner's state says which fields copy the parameters
      return ConstrainedState(inner_state=inner.init(params), constraint_states=NOT_PARAMS)
    leaves = driver.leaves(without_variables(params))
    # One program, in which XLA drops the tangent projections that inner's init does not read.
    inner_state, auxes = _compiled.call(
      _initial_state, (inner, tuple(leaves.constraints), leaves.treedef), leaves.compute, leaves.params
    )
    return ConstrainedState(inner_state=inner_state, constraint_states=leaves.kept(auxes))

  def update_fn(grads, state, params=None, **extra_args):
    check_state_type(owner, state, ConstrainedState)
    update = driver.begin(grads, params, state.constraint_states)
    leaves = update.leaves
    seen_grads = []
    given = leaves.flatten(grads, "grads")
    for c, q, g, grad, p in zip(leaves.constraints, update.points, update.grads, given, leaves.compute):
      if q is None:
        seen_grads.append(grad)
        continue
      seen = c.store_momentum(c.projected_gradient(q, g), p)
      seen_grads.append(seen if direction is None else direction(c, seen))
    seen_params = _seen_params(leaves.constraints, update.points, leaves.compute, leaves.params)
    inner_updates, inner_state = inner.update(
      leaves.unflatten(seen_grads), state.inner_state, leaves.unflatten(seen_params), **extra_args
    )

    def leaf_step(c, q, u, p):
      coordinates = c.load_momentum(jax.tree.map(lambda a: jnp.asarray(a).astype(p.dtype), u))
      return c.unpack(_retract(c, q, coordinates, retraction), p)

    inner_leaves = leaves.flatten(inner_updates, "the inner transformation's updates")
    new_params, new_auxes = update.map(2, leaf_step, (None, None), update.points, inner_leaves, leaves.compute)
    updates, constraint_states = update.finish(new_params, new_auxes, given=inner_leaves)
    return updates, ConstrainedState(inner_state, constraint_states)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
