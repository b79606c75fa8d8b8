r"""The CoLA methods as optax gradient transformations.

``cola_od`` (overdamped) and ``cola_ud`` (underdamped) apply the constrained
Langevin maps of :mod:`cola_jax.langevin` leaf by leaf, each leaf on the
manifold of its constraint (:class:`~cola_jax.Circle`,
:class:`~cola_jax.Orthogonal`, or none). ``update(grads, state, params)``
returns ``updates`` such that ``optax.apply_updates(params, updates)`` is the
new point on the manifold.

A constrained transform must be the last link of an ``optax.chain``: a
transformation after it would move the parameters off the manifold.
Transformations before it (gradient clipping, for instance) are fine.

Free leaves: ``free=optax.adam(1e-3)`` (any optax transformation) moves the
unconstrained leaves exactly as ``optax.partition`` would with that
optimizer, and the constrained leaves exactly as without it. Without
``free=``, the free leaves take the method's own step (SGD or SGD with
momentum, with the Langevin noise at a temperature above 0).

Randomness: the PRNG key lives in the optimizer state, is split once per step,
and gives one independent key per leaf (a leaf that ``free=`` moves leaves its
key unused), so runs are reproducible under ``jit``
and ``vmap`` and inside Flax's ``TrainState``. Each leaf's noise is drawn
from its own key and handed to its Langevin map as an argument
(:mod:`cola_jax._step_noise`), so a seed gives the same numbers on every
backend and device count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from cola_jax import _rules
from cola_jax._engine import Driver, check_state_type
from cola_jax._hyperparameters import caller, check_floating_dtype, check_nonnegative, check_positive
from cola_jax._numerics import concrete_float, is_prng_key
from cola_jax._tree import NOT_PARAMS, ConstraintSpec, is_params_placeholder, without_variables
from cola_jax.langevin import Splitting, splitting_named


class OverdampedState(NamedTuple):
  """State of :func:`cola_od`: the step count, the PRNG key, each leaf's constraint state and ``free``'s state.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_od(0.1, constraints=cola.Circle(0.5))
    >>> tx.init(jnp.array([0.3, 0.0]))  # the slack of |w| <= 0.5: sqrt(0.5**2 - w**2)
    OverdampedState(count=Array(0, dtype=int32), key=None,
                    constraint_states=CircleState(slack=Array([0.4, 0.5], dtype=float32),
                                                  radius=Array(0.5, dtype=float32)),
                    free_state=None)
  """

  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  (steps taken, int32, as optax names it)
  key: jax.Array | None  # PRNG key, None when no noise is ever drawn
  constraint_states: Any  # per leaf: auxiliary state of its constraint (None if free); not a copy of the parameters
  free_state: Any  # the state of free= over the free leaves (optax.MaskedNode at the others); None without free=


class UnderdampedState(NamedTuple):
  """State of :func:`cola_ud`: that of :func:`cola_od` and the momenta (none for the leaves ``free=`` moves).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.cola_ud(0.1, friction=1.0)
    >>> params = {'w': jnp.array([1.0, -2.0])}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({'w': jnp.array([1.0, 1.0])}, state, params)
    >>> state.count, state.momentum  # p = -h grad after a first step from rest
    (Array(1, dtype=int32), {'w': Array([-0.1, -0.1], dtype=float32)})
  """

  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  (steps taken, int32, as optax names it)
  key: jax.Array | None  # PRNG key, None when no noise is ever drawn
  constraint_states: Any  # per leaf: auxiliary state of its constraint (None if free); not a copy of the parameters
  momentum: Any  # per leaf, in the stored form of its constraint: shaped like the leaf (flat for Implicit);
  # optax.MaskedNode at the leaves that free= moves
  free_state: Any  # the state of free= over the free leaves (optax.MaskedNode at the others); None without free=


def _check_hyperparameters(owner, learning_rate, temperature, key) -> bool:
  """Validates what is known now; returns whether noise is drawn."""
  if isinstance(learning_rate, jax.Array):
    # A schedule's value at a step (optax.inject_hyperparams passes arrays) may be 0.
    check_nonnegative(owner, "learning_rate", learning_rate)
  else:
    check_positive(owner, "learning_rate", learning_rate)
  check_nonnegative(owner, "temperature", temperature)
  tau = concrete_float(temperature)
  if key is None:
    if callable(temperature) or (tau is not None and tau != 0):
      raise ValueError(
        f"{owner}: temperature {temperature!r} needs a PRNG key to draw its noise: pass key=jax.random.key(seed)."
      )
    return False
  if not is_prng_key(key):
    raise TypeError(f"{owner}: key must be a JAX PRNG key such as jax.random.key(seed), got {key!r}.")
  exact_zero = isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0
  return not exact_zero


def _at(value, count) -> Any:
  """A hyperparameter at step ``count``: schedules are called, numbers pass."""
  return value(count) if callable(value) else value


def _step_size_at(learning_rate, count):
  """The step size at ``count``; a schedule's rounding below zero reads as 0.

  (``optax.linear_schedule(0.1, 0.0, n)`` evaluates to about -1.5e-9 past
  ``n`` under ``jit``.) A number, checked positive at construction, passes as it is.
  """
  value = _at(learning_rate, count)
  return value if isinstance(value, (int, float)) else jnp.maximum(value, 0.0)


def _temperature_at(temperature, count):
  """The temperature at ``count``; a schedule's rounding below zero reads as 0.

  (``optax.linear_schedule(1e-3, 0.0, ...)`` ends at about -1.5e-11 in float32,
  whose square root would be NaN.)
  """
  return jnp.maximum(_at(temperature, count), 0.0)


def cola_od(
  learning_rate: optax.ScalarOrSchedule,
  *,
  constraints: ConstraintSpec = None,
  temperature: optax.ScalarOrSchedule = 0.0,
  key: jax.Array | None = None,
  free: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Constrained overdamped Langevin dynamics (CoLA-od).

  In optax's terms: at temperature 0, on free leaves, this is
  ``optax.sgd(learning_rate)``; ``learning_rate`` is SGD's learning rate.
  ``free=optax.adam(1e-3)`` (any optax transformation) moves the free leaves
  instead. Parameters off their manifold are put on it by the first update
  (call :func:`~cola_jax.project_params` to start there).

  Each leaf takes an Euler-Maruyama step and is projected back onto the
  manifold of its constraint (slack variables included):

  .. math::
    q_{n+1} = \mathrm{proj}_M\big(q_n - h \nabla V(q_n) + \sqrt{2 \tau h}\, R_n\big),
    \qquad R_n \sim N(0, I).

  Unconstrained leaves take plain (noisy) gradient steps; with ``tau = 0`` and
  no constraints this is ``optax.sgd(learning_rate)``. For ``tau > 0`` the
  invariant measure has density ``exp(-V / tau)`` with respect to the surface
  measure of the manifold.

  Args:
    learning_rate: the step size ``h > 0`` (SGD's learning rate), a number or
      an optax schedule.
    constraints: ``None`` (no constraint), a :class:`~cola_jax.Constraint` for
      every leaf, a pytree prefix of the parameters with ``Constraint`` or
      ``None`` leaves, or a callable mapping the parameters to such a pytree.
    temperature: ``tau >= 0``, a number or an optax schedule. Exactly ``0``
      draws no noise at all.
    key: a JAX PRNG key, required unless ``temperature`` is exactly 0.
    free: an optax ``GradientTransformation`` for the unconstrained leaves
      (``optax.adam(1e-3)``, ``optax.adamw``, a chain), or ``None`` (default):
      the step above. Given, it moves those leaves exactly as
      ``optax.partition`` routing them to it would: its ``update`` gets their
      gradients and parameters (``optax.MaskedNode`` at the constrained
      leaves) and the extra arguments. They draw no Langevin noise (the
      optimizer given owns them); the constrained leaves' steps, noise
      included, are the same as without ``free``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (extra keyword arguments, such as ``value=loss``, go to
    ``free`` and are not used otherwise). It must be the last link of a chain
    (what follows would leave the manifold).

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.cola_od(0.1, constraints={'w': cola.Orthogonal(), 'b': None})
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> w = params['w']
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-5)), params['b']  # b: a plain gradient step
    (True, Array([-0.1, -0.1], dtype=float32))

    The free leaf on Adam, the constrained one as before:

    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.cola_od(0.1, constraints={'w': cola.Orthogonal(), 'b': None}, free=optax.adam(1e-2))
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(jnp.allclose(params['w'], w)), params['b'].round(4)  # Adam's first step: -1e-2 sign(g)
    (True, Array([-0.01, -0.01], dtype=float32))

  References:
    Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
    Neural Networks*, OPT2020 (Sec. 3, Appendix B).
  """
  owner = caller("cola_od")
  noisy = _check_hyperparameters(owner, learning_rate, temperature, key)
  driver = Driver(owner, constraints, free=free)

  def init_fn(params):
    count = jnp.zeros([], jnp.int32)
    if is_params_placeholder(params):  # optax.tree.map_params: free's state says which fields copy the parameters
      return OverdampedState(count, key=key, constraint_states=NOT_PARAMS, free_state=driver.free.init(params, None))
    params = without_variables(params)
    leaves = driver.leaves(params)
    return OverdampedState(
      count,
      key=key,
      constraint_states=driver.initial_states(leaves),
      free_state=driver.free.init(params, leaves),
    )

  def update_fn(grads, state, params=None, **extra_args):
    check_state_type(owner, state, OverdampedState)
    draw = _rules.overdamped_draw if noisy else None
    update = driver.begin(
      grads,
      params,
      state.constraint_states,
      free_state=state.free_state,
      key=state.key,
      draw=draw,
      extra_args=extra_args,
    )
    h = _step_size_at(learning_rate, state.count)
    noise_scale = jnp.sqrt(2 * _temperature_at(temperature, state.count) * h) if noisy else None
    updates, constraint_states = update.finish(*_rules.overdamped(update, h, noise_scale))
    return updates, OverdampedState(
      count=jnp.asarray(optax.safe_increment(state.count)),
      key=update.next_key,
      constraint_states=constraint_states,
      free_state=update.free_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _momentum_or_friction(owner: str, friction, momentum) -> bool:
  """Checks that exactly one of ``friction`` and ``momentum`` is given; True for ``momentum`` (optax.sgd's terms)."""
  if (friction is None) == (momentum is None):
    raise TypeError(
      f"{owner}: give momentum= (optax.sgd's coefficient, with learning_rate as optax.sgd's: "
      f"{owner}(1e-3, momentum=0.9) is optax.sgd(1e-3, momentum=0.9) on free leaves) or friction= "
      f"(the Langevin rate gamma, with learning_rate the step h), "
      + ("not both." if friction is not None else "got neither.")
    )
  name, value = ("friction", friction) if momentum is None else ("momentum", momentum)
  if callable(value):
    raise TypeError(f"{owner}: {name} must be a number, not a schedule.")
  check_nonnegative(owner, name, value)
  if momentum is not None and not float(momentum) <= 1:
    raise ValueError(f"{owner}: momentum must be in [0, 1] (optax.sgd's coefficient), got {momentum!r}.")
  return momentum is not None


def cola_ud(
  learning_rate: optax.ScalarOrSchedule,
  *,
  friction: float | None = None,
  momentum: float | None = None,
  constraints: ConstraintSpec = None,
  temperature: optax.ScalarOrSchedule = 0.0,
  key: jax.Array | None = None,
  splitting: str | Splitting = "OBA",
  accumulator_dtype: Any = None,
  free: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Constrained underdamped Langevin dynamics (CoLA-ud), OBA, BAOAB or any splitting of O, B and A steps.

  In optax's terms: ``cola_ud(1e-3, momentum=0.9)`` is, at temperature 0
  on free leaves, ``optax.sgd(1e-3, momentum=0.9)``. With ``friction=``
  instead, the arguments are the Langevin ones: ``learning_rate`` is the step
  ``h`` (SGD's learning rate is ``h**2``) and ``friction`` the rate ``gamma``
  (SGD's momentum is ``exp(-gamma h)``), so ``cola_ud(1e-3, friction=0.9)``
  is *not* SGD-m with momentum 0.9. ``free=optax.adam(1e-3)`` (any optax
  transformation) moves the free leaves instead. Parameters off their
  manifold are put on it by the first update (call
  :func:`~cola_jax.project_params` to start there).

  Positions ``q`` (with slack variables) and momenta ``p`` in the cotangent
  space of the manifold advance by

  .. math::
    O:\ p \leftarrow \Pi_q\big(e^{-\gamma h} p + \sqrt{\tau (1 - e^{-2\gamma h})}\, R\big),\quad
    B:\ p \leftarrow p - h\, \Pi_q \nabla V(q),\quad
    A:\ (q, p) \leftarrow \text{geodesic flow for time } h,

  where the A step is exact for circle constraints and RATTLE with the
  quasi-Newton projection for orthogonality constraints. Momenta start at
  zero. With ``tau = 0`` and no constraints this is exactly
  ``optax.sgd(h**2, momentum=exp(-gamma h))`` (see
  :func:`~cola_jax.sgd_momentum_to_langevin`).

  Args:
    learning_rate: with ``friction``, the step size ``h > 0``; with
      ``momentum``, optax.sgd's learning rate ``h**2``. A number or an optax
      schedule.
    friction: the friction rate ``gamma >= 0`` (SGD-m's momentum is
      ``exp(-gamma h)``; ``gamma = 0`` keeps all momentum). Give it or
      ``momentum``.
    momentum: optax.sgd's momentum coefficient in ``[0, 1]``, instead of
      ``friction``: the O step then keeps this fraction of the momentum at
      every step (``gamma = -log(momentum) / h``), with ``h =
      sqrt(learning_rate)``.
    constraints: as for :func:`cola_od`.
    temperature: ``tau >= 0``, a number or an optax schedule. Exactly ``0``
      draws no noise at all.
    key: a JAX PRNG key, required unless ``temperature`` is exactly 0.
    splitting: ``"OBA"`` (the paper's; equals SGD with momentum at ``tau = 0``)
      or ``"BAOAB"`` (more accurate configurational averages at the same step
      size; two A half steps per update, see :func:`cola_jax.langevin.baoab_step`),
      or any :class:`~cola_jax.Splitting` (``cola.Splitting("OBABO")``, a
      scheme of one's own: its O steps draw one set of numbers each).
    accumulator_dtype: the dtype the momenta are stored in between steps,
      as ``optax.sgd``'s (``mu_dtype`` in ``optax.adam`` and
      ``optax.contrib.muon``). ``None`` (default): the compute
      dtype, float32 for bfloat16 or float16 parameters. ``jnp.bfloat16``
      halves the momenta of a bfloat16 model; the step still computes in
      float32 and rounds the new momentum once. Positions and slack variables
      stay in the compute dtype, so the constraints hold as closely.
    free: an optax ``GradientTransformation`` for the unconstrained leaves,
      or ``None`` (default): the dynamics above. As for :func:`cola_od`:
      exactly ``optax.partition``'s step with it on those leaves, no noise
      and no momenta of this method for them, and the constrained leaves'
      steps unchanged.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params`` (extra keyword arguments go to ``free`` and are not used
    otherwise). It must be the last link of a chain.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.full((3, 2), 0.05), 'b': jnp.zeros(2)}
    >>> tx = cola.cola_ud(0.3, friction=1.0,
    ...                   constraints={'w': cola.Circle(0.1), 'b': None},
    ...                   temperature=1e-4, key=jax.random.key(0))
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(jnp.abs(params['w']).max() <= 0.1)  # noise and all, |w| <= 0.1
    True

    With AdamW on the free leaf (its weight decay reads ``params``): the
    momenta are kept for ``w`` only, AdamW's moments for ``b`` only.

    >>> tx = cola.cola_ud(0.3, friction=1.0, constraints={'w': cola.Circle(0.1), 'b': None},
    ...                   free=optax.adamw(1e-3, weight_decay=0.1))
    >>> state = tx.init(params)
    >>> state.momentum['b'], state.free_state[0].mu['w']
    (MaskedNode(), MaskedNode())

  References:
    Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
    Neural Networks*, OPT2020 (Sec. 3, Appendix B).
  """
  owner = caller("cola_ud")
  from_sgd = _momentum_or_friction(owner, friction, momentum)
  gamma = 0.0 if friction is None else friction
  noisy = _check_hyperparameters(owner, learning_rate, temperature, key)
  splitting = splitting_named(owner, splitting)
  accumulator_dtype = check_floating_dtype(owner, "accumulator_dtype", accumulator_dtype)
  driver = Driver(owner, constraints, free=free)

  def zero_momentum(c, p):
    m = c.zero_momentum(p)
    return m if accumulator_dtype is None else jax.tree.map(lambda a: a.astype(accumulator_dtype), m)

  def init_fn(params):
    count = jnp.zeros([], jnp.int32)
    if is_params_placeholder(params):  # optax.tree.map_params: the momenta (and free's state) copy the parameters
      return UnderdampedState(
        count, key=key, constraint_states=NOT_PARAMS, momentum=params, free_state=driver.free.init(params, None)
      )
    params = without_variables(params)
    leaves = driver.leaves(params)
    momenta = [
      zero_momentum(c, p) if stepped else optax.MaskedNode()
      for c, p, stepped in zip(leaves.constraints, leaves.compute, driver.stepped(leaves))
    ]
    return UnderdampedState(
      count,
      key=key,
      constraint_states=driver.initial_states(leaves),
      momentum=leaves.unflatten(momenta),
      free_state=driver.free.init(params, leaves),
    )

  def update_fn(grads, state, params=None, **extra_args):
    check_state_type(owner, state, UnderdampedState)
    update = driver.begin(
      grads,
      params,
      state.constraint_states,
      momentum=state.momentum,
      free_state=state.free_state,
      key=state.key,
      draw=splitting.draw if noisy else None,
      extra_args=extra_args,
    )
    if from_sgd:
      h, decay = jnp.sqrt(_step_size_at(learning_rate, state.count)), jnp.asarray(momentum, jnp.float32)
    else:
      h = _step_size_at(learning_rate, state.count)
      decay = jnp.exp(-gamma * h)
    tau = _temperature_at(temperature, state.count) if noisy else None
    new_params, new_auxes, new_momenta = _rules.underdamped(update, splitting, h, decay, tau, state.count == 0)
    updates, constraint_states = update.finish(new_params, new_auxes)
    return updates, UnderdampedState(
      count=jnp.asarray(optax.safe_increment(state.count)),
      key=update.next_key,
      constraint_states=constraint_states,
      momentum=update.leaves.unflatten(new_momenta),
      free_state=update.free_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
