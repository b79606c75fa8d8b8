r"""Manifold Muon: steepest descent under the spectral norm on the Stiefel manifold.

For a weight ``W`` with orthonormal columns (``W^T W = I``, the
:class:`~cola_jax.Orthogonal` constraint) and a gradient or momentum ``G``, the
step direction is the tangent vector of unit spectral norm that decreases the
loss fastest to first order,

.. math::
  A = \arg\max_{A} \langle G, A \rangle \quad\text{subject to}\quad
  \|A\|_2 \le 1, \quad W^T A + A^T W = 0,

and the step is ``W <- R_W(-eta A)``, a retraction to the manifold. Muon solves
the same problem without the tangency condition (its answer is the matrix sign
``msign(G)``); with it, the direction is the one the blog post "Modular
Manifolds" (Bernstein, Thinking Machines, 2025) calls manifold Muon. How
``A`` is found, and the certificate of its optimality, is in
:mod:`cola_jax.stiefel_direction`.

Under ``jax.vmap`` on XLA:CPU, each factorisation of a step (the direction's
``eigh``, the retraction's) runs one model at a time, as everywhere in
cola_jax (:func:`~cola_jax._platform.one_matrix_at_a_time`): a model's result
under ``vmap`` is its unbatched step's, to float32 rounding.

References:
  Bernstein, *Modular Manifolds*, Thinking Machines Lab: Connectionism, 2025
  (manifold Muon).
  Jordan et al., *Muon: An optimizer for hidden layers in neural networks*,
  2024.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from cola_jax._default_leaves import weight_matrices
from cola_jax._engine import Driver, check_state_type
from cola_jax._hyperparameters import caller, check_nonnegative, check_positive, check_positive_integer
from cola_jax._tree import NOT_PARAMS, ConstraintSpec, is_params_placeholder, without_variables
from cola_jax.constraints.base import Euclidean
from cola_jax.constraints.orthogonal import Orthogonal
from cola_jax.stiefel_direction import DirectionInfo, steepest_tangent_direction


class ManifoldMuonState(NamedTuple):
  """State of :func:`manifold_muon`.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> state = cola.manifold_muon(0.1).init({'w': jnp.eye(3, 2)})
    >>> state.momentum['w'].shape, state.direction_info['w']
    ((3, 2), DirectionInfo(iterations=Array(0, dtype=int32), converged=Array(True, dtype=bool),
                           gap=Array(0., dtype=float32)))
  """

  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  (steps taken, int32, as optax names it)
  momentum: Any  # m, the moving average of the gradients (optax.contrib.muon's mu), shaped like the parameters
  constraint_states: Any  # per leaf: its constraint's state (a ProjectionInfo for Orthogonal, None if free)
  direction_info: Any  # per leaf: a DirectionInfo for Orthogonal leaves, None for free ones


def manifold_muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  constraints: ConstraintSpec = None,
  beta: float = 0.95,
  nesterov: bool = True,
  gap_tolerance: float = 1e-3,
  max_iterations: int = 300,
) -> optax.GradientTransformationExtraArgs:
  r"""Manifold Muon: Muon's spectral-norm steepest descent inside the tangent space of the Stiefel manifold.

  The optax counterpart is ``optax.contrib.muon``, which orthogonalises the
  update but lets the weights leave any manifold; this keeps every
  :class:`~cola_jax.Orthogonal` leaf on it. Per such leaf, with ``W`` its tall
  view (see :class:`~cola_jax.Orthogonal`) and ``g`` its gradient:

  .. math::
    m \leftarrow \beta m + (1 - \beta) g, \qquad
    d = \beta m + (1 - \beta) g \ \text{(Nesterov; else } d = m),

  .. math::
    A = \arg\max_{|A|_2 \le 1,\ W^T A + A^T W = 0} \langle d, A \rangle, \qquad
    W \leftarrow R_W(-\eta A),

  with ``R_W`` the leaf's :meth:`Orthogonal.retract
  <cola_jax.Constraint.retract>` (the polar factor, the nearest orthonormal
  matrix). The direction is found as :mod:`cola_jax.stiefel_direction` describes
  (closed form for square matrices, ADMM in ``(p + m) x p`` coordinates for
  tall ones); its iterations and whether it met ``gap_tolerance`` are in
  ``state.direction_info``.

  ``beta`` and ``nesterov`` are ``optax.contrib.muon``'s: ``m`` is its ``mu``,
  the same exponential moving average. Muon bias-corrects before it
  orthogonalises: ``m / (1 - beta^t)`` at step ``t``, or with Nesterov
  ``beta m / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)``. ``A`` depends on
  the direction of ``d`` only (``A(c d) = A(d)`` for ``c > 0``), so without
  Nesterov the correction changes no step; with it, Muon weighs ``m`` against
  ``g`` less than ``d`` above does, by ``(1 - beta^t) / (1 - beta^(t+1))``: the
  same direction at the first step (``m = (1 - beta) g``), and the factor
  tends to 1 as ``beta^t`` vanishes. Muon's step is ``learning_rate``
  times Newton-Schulz's approximate ``msign`` (singular values near, not at,
  1) times ``sqrt(max(1, fan_out / fan_in))``; here the step has spectral
  norm ``eta``.

  Unconstrained leaves (``None``) take ``-eta d``, the same momentum without
  a direction and without bias correction: they move as under
  ``optax.sgd(eta * (1 - beta), momentum=beta, nesterov=nesterov)``, which is
  without Nesterov what :func:`~cola_jax.cola_ud`'s free leaves do at
  temperature 0 with ``cola_ud(eta * (1 - beta), momentum=beta)`` (whose
  ``momentum`` is optax.sgd's coefficient, not an average). Muon steps the
  leaves it does not orthogonalise (by default every leaf that is not 2-D)
  by AdamW instead (``adam_b1``, ``adam_b2``, ``adam_learning_rate``, its
  ``nesterov``). ``manifold_muon`` has no ``free=`` (``cola_ud``'s way to
  move the free leaves by any optax transformation): to put them on Adam,
  route them there with ``optax.partition``.

  Args:
    learning_rate: ``eta``, the spectral norm of each step (a number or an optax schedule).
    constraints: :class:`~cola_jax.Orthogonal` or ``None`` per leaf, as for
      :func:`~cola_jax.cola_od` (a constraint, a pytree prefix of the
      parameters, or a callable of them). Default: ``Orthogonal()`` on the
      weight matrices, every leaf with ``ndim >= 2`` but biases, scales and
      embedding tables, named in a ``UserWarning`` when there are more than
      one (the rule of every entry, in docs/choosing.md, "Which leaves are
      constrained"); the others are free.
    beta: the decay rate of the moving average ``m`` in ``[0, 1)``, as
      ``optax.contrib.muon``'s ``beta``; 0 gives the reference's rule (no momentum).
    nesterov: whether ``d`` looks ahead (as ``optax.contrib.muon``).
    gap_tolerance: the relative duality gap at which the direction's ADMM
      stops: ``<d, A>`` within this fraction of its maximum
      (:class:`DirectionInfo`'s ``gap``).
    max_iterations: the bound on its iterations per matrix and step.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params``. It must be the last link of a chain.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(4, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.manifold_muon(0.1, constraints={'w': cola.Orthogonal(), 'b': None})
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.arange(8.0).reshape(4, 2), 'b': jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> w = optax.apply_updates(params, updates)['w']
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-6)), bool(state.direction_info['w'].converged)
    (True, True)

  References:
    Bernstein, *Modular Manifolds*, Thinking Machines Lab: Connectionism, 2025.
    Jordan et al., *Muon: An optimizer for hidden layers in neural networks*, 2024.
  """
  owner = caller("manifold_muon")
  if not callable(learning_rate):
    check_positive(owner, "learning_rate", learning_rate)
  if callable(beta):
    raise TypeError(f"{owner}: beta must be a number, not a schedule.")
  check_nonnegative(owner, "beta", beta)
  if not float(beta) < 1:
    raise ValueError(f"{owner}: beta must be in [0, 1), got {beta!r}.")
  check_positive(owner, "gap_tolerance", gap_tolerance)
  check_positive_integer(owner, "max_iterations", max_iterations)
  if not isinstance(nesterov, bool):
    raise TypeError(f"{owner}: nesterov must be True or False, got {nesterov!r}.")
  if constraints is None:
    orthogonal = Orthogonal()
    constraints = lambda params: jax.tree.map(
      lambda taken: orthogonal if taken else None,
      weight_matrices(owner, params, "cola.Orthogonal()", "constraints="),
    )

  def orthogonal_or_free(path, c):
    if not isinstance(c, (Orthogonal, Euclidean)):
      raise ValueError(
        f"{owner}: the leaf at {path} has the constraint {c!r}; manifold Muon steps Orthogonal leaves "
        "(the Stiefel manifold) and free ones (None). For other manifolds use "
        "cola.constrained(optax.contrib.muon(...), constraints=...)."
      )

  driver = Driver(owner, constraints, steps_free_leaves=False, check=orthogonal_or_free)

  def init_fn(params):
    count = jnp.zeros([], jnp.int32)
    if is_params_placeholder(params):  # optax.tree.map_params: the momenta are the copy of the parameters
      return ManifoldMuonState(count, momentum=params, constraint_states=NOT_PARAMS, direction_info=NOT_PARAMS)
    leaves = driver.leaves(without_variables(params))
    infos = [
      None if free else DirectionInfo(jnp.zeros((), jnp.int32), jnp.array(True), jnp.zeros(())) for free in leaves.free
    ]
    return ManifoldMuonState(
      count,
      momentum=leaves.unflatten([jnp.zeros_like(p) for p in leaves.params]),
      constraint_states=driver.initial_states(leaves),
      direction_info=leaves.unflatten(infos),
    )

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args
    check_state_type(owner, state, ManifoldMuonState)
    update = driver.begin(grads, params, state.constraint_states)
    leaves = update.leaves
    stored = leaves.flatten(state.momentum, "state.momentum")
    eta = jnp.asarray(learning_rate(state.count) if callable(learning_rate) else learning_rate)
    momenta = [beta * m.astype(p.dtype) + (1 - beta) * g for m, p, g in zip(stored, leaves.compute, update.grads)]
    directions = [beta * m + (1 - beta) * g if nesterov else m for m, g in zip(momenta, update.grads)]

    def leaf_step(c, p, point, d):
      # The tangent space at Q = scale U is U's: the direction is found for U (Orthogonal's scale).
      w, ambient = point.matrix / c.scale, c.ambient_gradient(point, d)
      direction = lambda w, g: steepest_tangent_direction(
        w, g, gap_tolerance=gap_tolerance, max_iterations=max_iterations
      )
      a, info = direction(w, ambient) if w.ndim == 2 else jax.vmap(direction)(w, ambient)
      new_param, new_aux = c.unpack(c.retract(point, -eta * c.cotangent(point, a)), p)
      return new_param, new_aux, DirectionInfo(jnp.max(info.iterations), jnp.all(info.converged), jnp.max(info.gap))

    new_params, new_auxes, infos = update.map(
      3, leaf_step, (None, None, None), leaves.compute, update.points, directions
    )
    new_params = [
      p - eta * d if free else new for p, d, new, free in zip(leaves.compute, directions, new_params, leaves.free)
    ]
    updates, constraint_states = update.finish(new_params, new_auxes)
    return updates, ManifoldMuonState(
      jnp.asarray(optax.safe_increment(state.count)),
      leaves.unflatten([m.astype(old.dtype) for m, old in zip(momenta, stored)]),
      constraint_states,
      leaves.unflatten(infos),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
