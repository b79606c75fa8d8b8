r"""Hyperspherical descent: normalized Riemannian gradient descent on spheres, retracted by normalization.

For a unit ``w`` on a sphere of radius ``r`` (a :class:`~cola_jax.UnitNorm`
unit: the whole leaf for ``axis="all"``, one column of a Dense kernel for the
default axis) and its loss gradient ``g``:

.. math::
  a = g - \frac{(w \cdot g)}{r^2}\, w, \qquad
  w_{+} = r\, \frac{w - \eta\, r\, a / |a|}{|w - \eta\, r\, a / |a||}.

``a`` is the Riemannian gradient, ``-a / |a|`` the unit tangent of steepest
descent, and the retraction the radial projection. The tangent step has length
``eta r`` and is orthogonal to ``w``, so ``w+`` lies at the angle
``arctan(eta)`` from ``w`` on the great circle towards ``-a``, for every
radius: the learning rate sets an angle, and the trajectory on a sphere of
radius ``r`` is ``r`` times the one on the unit sphere.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from cola_jax._default_leaves import weight_matrices
from cola_jax._hyperparameters import check_nonnegative, check_positive
from cola_jax._numerics import max_abs, power_of_two_scale
from cola_jax._tree import ConstraintSpec, is_function
from cola_jax.constrained import riemannian
from cola_jax.constraints.base import Constraint, Euclidean
from cola_jax.constraints.unit_norm import UnitNorm

_OWNER = "hyperspherical_descent"


def _sphere_or_free(constraint: Any, where: str) -> None:
  """Raises TypeError unless ``constraint`` is a UnitNorm or free (None, or a leaf left free)."""
  if constraint is None or isinstance(constraint, (UnitNorm, Euclidean)):
    return
  kind = "constraint" if isinstance(constraint, Constraint) else "value"
  raise TypeError(
    f"{_OWNER}: the {kind} {where} is {constraint!r}; hyperspherical descent moves on spheres: "
    "give cola.UnitNorm (axis='all' for the whole leaf) or None (a free leaf, plain gradient descent). "
    "For other constraints use cola.constrained(optax.sgd(learning_rate), constraints=...)."
  )


def _check_constraints(constraints: ConstraintSpec) -> None:
  """What can be checked of ``constraints`` before the parameters are known (a callable is checked at init)."""
  if is_function(constraints):
    return
  is_leaf = lambda x: x is None or isinstance(x, Constraint)
  for path, leaf in jax.tree_util.tree_flatten_with_path(constraints, is_leaf=is_leaf)[0]:
    _sphere_or_free(leaf, f"at constraints{jax.tree_util.keystr(path)}" if path else "given as constraints")


def _on_weight_matrices(params):
  """The default: each weight matrix on its sphere (``UnitNorm(axis="all")``), the rule's choice of leaves."""
  sphere = UnitNorm(axis="all")
  chosen = weight_matrices(_OWNER, params, 'cola.UnitNorm(axis="all")', "constraints=")
  return jax.tree.map(lambda taken: sphere if taken else None, chosen)


def _unit_direction(c: UnitNorm, tangent: jax.Array) -> jax.Array:
  """``r a_j / |a_j|`` for each unit ``a_j`` of ``tangent``; zero for a zero unit.

  Overflow- and underflow-safe: each unit is measured after an exact
  power-of-two scaling. A unit whose entries are all below the smallest normal
  number (zero or subnormal) has no direction and gives a zero step.
  """
  axes = c.init(tangent).axes
  largest = max_abs(tangent, axis=axes, keepdims=True)
  zero = largest < jnp.finfo(tangent.dtype).tiny
  scaled = jnp.where(zero, jnp.zeros_like(tangent), tangent * power_of_two_scale(largest))
  norm2 = jnp.sum(scaled * scaled, axis=axes, keepdims=True)
  return scaled * (jnp.asarray(c.radius, tangent.dtype) * jax.lax.rsqrt(jnp.where(zero, jnp.ones_like(norm2), norm2)))


def hyperspherical_descent(
  learning_rate: optax.ScalarOrSchedule,
  *,
  constraints: ConstraintSpec = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Hyperspherical descent: a step of fixed angle against the Riemannian gradient on each sphere.

  Normalized Riemannian gradient descent with retraction by normalization
  (Bernstein, *Modular Manifolds*, 2025): the counterpart on spheres, unit by
  unit, of normalized gradient descent,
  ``optax.chain(optax.normalize_by_update_norm(), optax.sgd(learning_rate))``
  (which divides the whole update tree by its norm plus ``1e-6``). Each weight unit ``w`` lies on a sphere
  of radius ``r`` given by a :class:`~cola_jax.UnitNorm` constraint: the whole
  leaf, ``|W|_F = r``, for ``axis="all"`` (the default's), or each output
  unit's incoming weights for ``UnitNorm()`` (a column of a Flax kernel, a row
  of an Equinox weight), each row for ``UnitNorm(axis=-1)``. With the
  loss gradient ``g`` restricted to the unit,

  .. math::
    a = g - \frac{(w \cdot g)}{r^2}\, w, \qquad
    w_{+} = r\, \frac{w - \eta_t\, r\, a / |a|}{\big|w - \eta_t\, r\, a / |a|\big|},

  the unit tangent of steepest descent scaled by ``eta r``, then the radial
  projection back onto the sphere: the unit turns by ``arctan(eta)`` along the
  great circle towards ``-a``, whatever the size of the gradient. For ``r = 1``
  and the whole-matrix sphere this is the reference rule ``a = g - w (w . g)``,
  ``a /= |a|``, ``w <- w - eta a``, ``w /= |w|``. With ``r`` the initial
  Frobenius norm of each matrix it is Hyperball's fixed-norm step (update of
  length ``eta r``, weights of norm ``r``) with the Riemannian gradient as the
  base update.

  ``-a / |a|`` is the minimiser of ``a . v`` over the tangent vectors with
  ``|v| <= 1``. Where ``a = 0`` (a stationary unit, or a gradient that
  vanishes) every ``v`` in that ball is a minimiser, and the step takes the one
  of least norm, ``v = 0``: the unit stays where it is, and nothing is divided
  by zero (the reference adds ``1e-12`` to ``|a|`` instead). A gradient normal
  to the sphere (a loss of ``|w|`` alone) has a tangent part of rounding size,
  whose direction is noise; the step still has the angle ``arctan(eta)``.

  Built as :func:`~cola_jax.constrained` with ``optax.scale_by_learning_rate``
  as the inner transformation, the per-unit normalisation applied to the
  Riemannian gradients it gets: it has its state, its sharding and its
  checks of the parameters, and parameters off their spheres are put on them
  radially by the first update.

  Args:
    learning_rate: ``eta > 0``, the tangent of each step's angle, or an optax
      schedule of it.
    constraints: :class:`~cola_jax.UnitNorm` constraints and ``None``, given as
      to :func:`~cola_jax.constrained`: one constraint for every leaf, a pytree
      prefix of the parameters, or a callable of them
      (:func:`~cola_jax.path_constraints`). A free leaf (``None``) moves by
      plain gradient descent, ``-eta g``; to train it with another optimizer,
      route it there with ``optax.partition``. Another constraint is a
      TypeError. Default: ``UnitNorm(axis="all")`` on the weight matrices,
      every leaf with ``ndim >= 2`` but biases, scales and embedding tables,
      named in a ``UserWarning`` when there are more than one (the rule of
      every entry, in docs/choosing.md, "Which leaves are constrained").

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params``; its state is :class:`~cola_jax.ConstrainedState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> w = jnp.array([[0.6, 0.0], [0.0, 0.8]])  # Frobenius norm 1
    >>> tx = cola.hyperspherical_descent(0.1)
    >>> state = tx.init(w)
    >>> updates, state = tx.update(jnp.array([[0.0, 1.0], [0.0, 0.0]]), state, w)
    >>> w = optax.apply_updates(w, updates)
    >>> w.round(4), round(float(jnp.linalg.norm(w)), 6)  # turned by arctan(0.1) towards -g
    (Array([[ 0.597 , -0.0995],
           [ 0.    ,  0.796 ]], dtype=float32), 1.0)

    Per column, each column on its unit sphere; a bias left free:

    >>> params = {'kernel': jnp.ones((3, 2)) / jnp.sqrt(3.0), 'bias': jnp.zeros(2)}
    >>> tx = cola.hyperspherical_descent(
    ...     optax.cosine_decay_schedule(0.1, 100),
    ...     constraints={'kernel': cola.UnitNorm(), 'bias': None})
    >>> state = tx.init(params)
    >>> grads = {'kernel': jnp.arange(6.0).reshape(3, 2), 'bias': jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> jnp.linalg.norm(params['kernel'], axis=0).round(5), params['bias']
    (Array([1., 1.], dtype=float32), Array([-0.1, -0.1], dtype=float32))

  References:
    Bernstein, *Modular Manifolds*, Thinking Machines Lab: Connectionism,
    2025 (hyperspherical descent).
    Absil, Mahony, Sepulchre, *Optimization Algorithms on Matrix Manifolds*,
    2008 (Riemannian gradient, retraction by projection).
    Wen, Dang, Lyu, Ma, Liang, *Fantastic Pretraining Optimizers and Where to
    Find Them II: Hyperball Optimization*, 2026 (weights and updates of fixed
    Frobenius norm).
  """
  if isinstance(learning_rate, jax.Array):
    check_nonnegative(_OWNER, "learning_rate", learning_rate)
  else:
    check_positive(_OWNER, "learning_rate", learning_rate)
  if constraints is None:
    constraints = _on_weight_matrices
  _check_constraints(constraints)
  sphere_or_free = lambda path, c: _sphere_or_free(c, f"for the leaf at {path}")
  return riemannian(
    _OWNER,
    optax.scale_by_learning_rate(learning_rate),
    constraints,
    "polar",
    check=sphere_or_free,
    direction=_unit_direction,
  )
