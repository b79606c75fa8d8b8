r"""Constrained SG-MCMC samplers in blackjax's shape: the CoLA dynamics with the key and step size per call.

The overdamped and underdamped constrained Langevin dynamics of
:func:`~cola_jax.cola_od` and :func:`~cola_jax.cola_ud`, as samplers of the
tempered posterior on the manifold of the constraints,

.. math::
  \pi_T(q) \propto p(q \mid \mathcal{D})^{1/T}\, d\sigma_M(q),

with ``sigma_M`` the surface measure of the manifold (of the lifted manifold
where a constraint has slack variables: under ``Circle(r)`` and no force, each
weight is arcsine-distributed on ``[-r, r]``). Each sampler is an ``(init,
step)`` pair as ``blackjax.base.SamplingAlgorithm``: ``init(position)`` puts
the position on its manifold and returns the state, ``step(rng_key, state,
minibatch, step_size, temperature=1.0)`` is one pure step, jittable and
vmappable over chains. ``grad_estimator(position, minibatch)`` returns the
gradient of the log-density (blackjax's convention), so that
``blackjax.sgmcmc.gradients.grad_estimator(logprior, loglikelihood,
data_size)`` works as it is; the potential of the dynamics is ``V = -log p``
and ``temperature`` is ``tau``. An optimizer's temperature ``tau`` on a mean
loss over ``N`` examples samples the same law as ``temperature = tau N``
here.

The steps are those of the optimizers, on the same driver and Langevin maps:
the same constraints (a pytree prefix of ``Constraint | None``,
:func:`~cola_jax.path_constraints`, constraints declared on a Flax model), the
same noise from the same key.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cola_jax import _rules
from cola_jax._engine import Driver
from cola_jax._hyperparameters import check_nonnegative
from cola_jax._tree import ConstraintSpec, without_variables
from cola_jax.langevin import Splitting, splitting_named


class SamplingAlgorithm(NamedTuple):
  """A sampler as ``blackjax.base.SamplingAlgorithm``: ``init(position)``, ``step(rng_key, state, minibatch, ...)``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> init, step = cola.sampling.overdamped(lambda q, batch: -q)  # unpacks as blackjax's algorithms do
    >>> init(jnp.ones(2)).position
    Array([1., 1.], dtype=float32)
  """

  init: Any
  step: Any


class OverdampedSamplerState(NamedTuple):
  """State of :func:`overdamped`: the position (on its manifold) and each leaf's constraint state.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> state = cola.sampling.overdamped(lambda q, batch: -q, constraints=cola.Circle(0.5)).init(jnp.array([0.3, 0.0]))
    >>> state.constraint_states.slack  # |w| <= 0.5: the slack sqrt(0.5**2 - w**2) beside the position
    Array([0.4, 0.5], dtype=float32)
  """

  position: Any
  constraint_states: Any


class UnderdampedSamplerState(NamedTuple):
  """State of :func:`underdamped`: the position, the momenta, each leaf's constraint state and the step count.

  The count tells the first call of a splitting, which has no previous step to finish (see
  :class:`~cola_jax.Splitting`).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> state = cola.sampling.underdamped(lambda q, batch: -q, friction=1.0).init({'w': jnp.ones(2)})
    >>> state.momentum, state.count  # at rest, no step taken
    ({'w': Array([0., 0.], dtype=float32)}, Array(0, dtype=int32))
  """

  position: Any
  momentum: Any
  constraint_states: Any
  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  (steps taken, as optax names it)


def _check_step_arguments(owner: str, step_size, temperature) -> None:
  for name, value in (("step_size", step_size), ("temperature", temperature)):
    if callable(value):
      raise TypeError(f"{owner}: {name} must be a number or a scalar array (the value of this step), not a function.")
    check_nonnegative(owner, name, value)


def _potential_gradient(owner: str, grad_estimator, position, minibatch):
  """``-grad log p`` at ``position``, checked against the position's tree structure."""
  logdensity_grad = grad_estimator(position, minibatch)
  expected, got = jax.tree.structure(position), jax.tree.structure(logdensity_grad)
  if expected != got:
    raise ValueError(
      f"{owner}: grad_estimator(position, minibatch) must return a gradient with the tree structure of the "
      f"position; got {got}, expected {expected}."
    )
  return jax.tree.map(jnp.negative, logdensity_grad)


def _start(driver: Driver, position):
  """The position moved onto its manifold, its leaves and their constraint states."""
  leaves = driver.leaves(without_variables(position))
  values = [c.nearest(p).astype(param.dtype) for c, p, param in zip(leaves.constraints, leaves.compute, leaves.params)]
  leaves = driver.leaves(leaves.unflatten(values))
  return leaves, driver.initial_states(leaves)


def overdamped(grad_estimator, *, constraints: ConstraintSpec = None) -> SamplingAlgorithm:
  r"""Constrained stochastic-gradient Langevin dynamics: SGLD on the manifold of the constraints.

  Each leaf takes the Euler-Maruyama step of :func:`~cola_jax.cola_od` with
  ``V = -log p`` and is projected back onto its manifold:

  .. math::
    q_{n+1} = \mathrm{proj}_M\big(q_n + h\, \widehat{\nabla \log p}(q_n) + \sqrt{2 T h}\, R_n\big),
    \qquad R_n \sim N(0, I).

  Unconstrained leaves (``None``) take blackjax's ``sgld`` step, the same law.

  Args:
    grad_estimator: ``(position, minibatch) -> `` the gradient of the
      log-density at ``position``, a pytree shaped like it.
    constraints: as for :func:`~cola_jax.cola_od`; ``None``: no constraint.

  Returns:
    A :class:`SamplingAlgorithm` ``(init, step)``: ``init(position)`` gives an
    :class:`OverdampedSamplerState` on the manifold, ``step(rng_key, state,
    minibatch, step_size, temperature=1.0)`` the next state. ``temperature``
    exactly ``0`` draws no noise (stochastic gradient descent on the manifold).

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> grad_estimator = lambda q, batch: -q  # log p = -|q|^2 / 2
    >>> sampler = cola.sampling.overdamped(grad_estimator, constraints=cola.UnitNorm(axis="all"))
    >>> state = sampler.init(jnp.array([3.0, 4.0]))
    >>> state = jax.jit(sampler.step)(jax.random.key(0), state, None, 0.1)
    >>> round(float(jnp.linalg.norm(state.position)), 5)  # on the unit sphere
    1.0

  References:
    Welling, Teh, *Bayesian Learning via Stochastic Gradient Langevin
    Dynamics*, ICML 2011. Leimkuhler, Pouchon, Vlaar, Storkey,
    *Constraint-Based Regularization of Neural Networks*, OPT2020 (Sec. 3).
  """
  owner = "cola.sampling.overdamped"
  if not callable(grad_estimator):
    raise TypeError(f"{owner}: grad_estimator must be a function (position, minibatch) -> gradient of log p.")
  driver = Driver(owner, constraints)

  def init(position) -> OverdampedSamplerState:
    leaves, constraint_states = _start(driver, position)
    return OverdampedSamplerState(leaves.unflatten(leaves.params), constraint_states)

  def step(rng_key, state: OverdampedSamplerState, minibatch, step_size, temperature=1.0) -> OverdampedSamplerState:
    _check_step_arguments(owner, step_size, temperature)
    grads = _potential_gradient(owner, grad_estimator, state.position, minibatch)
    noisy = not (isinstance(temperature, (int, float)) and temperature == 0)
    update = driver.begin(
      grads, state.position, state.constraint_states, key=rng_key, draw=_rules.overdamped_draw if noisy else None
    )
    noise_scale = jnp.sqrt(2 * jnp.maximum(temperature, 0.0) * step_size) if noisy else None
    new_params, new_auxes = _rules.overdamped(update, step_size, noise_scale)
    return OverdampedSamplerState(update.values(new_params), update.kept(new_auxes))

  return SamplingAlgorithm(init, step)


def underdamped(
  grad_estimator,
  *,
  friction: float,
  constraints: ConstraintSpec = None,
  splitting: str | Splitting = "BAOAB",
) -> SamplingAlgorithm:
  r"""Constrained underdamped Langevin dynamics (stochastic-gradient HMC with friction) on the manifold.

  Positions ``q`` and momenta ``p`` in the cotangent space of the manifold
  advance by the splitting's A, B and O steps (those of
  :func:`~cola_jax.cola_ud`), with ``V = -log p`` and ``tau = T``:

  .. math::
    B:\ p \leftarrow p + h\, \Pi_q \widehat{\nabla \log p}(q),\quad
    A:\ (q, p) \leftarrow \text{geodesic flow for time } h,\quad
    O:\ p \leftarrow e^{-\gamma h} p + \sqrt{T (1 - e^{-2\gamma h})}\, \Pi_q R.

  The invariant measure is ``exp(-(V + |p|^2 / 2) / T)`` on the cotangent
  bundle: its positions are distributed as the tempered posterior on the
  manifold. One gradient per step: BAOAB's closing half kick is merged with the
  next step's opening one (see :class:`~cola_jax.Splitting`), so the positions
  are BAOAB's exactly and the stored momentum is the one before that kick.

  Args:
    grad_estimator: ``(position, minibatch) ->`` the gradient of the
      log-density at ``position``, a pytree shaped like it.
    friction: ``gamma >= 0``.
    constraints: as for :func:`~cola_jax.cola_ud`; ``None``: no constraint.
    splitting: ``"BAOAB"`` (default), ``"OBA"`` (the paper's) or any
      :class:`~cola_jax.Splitting`.

  Returns:
    A :class:`SamplingAlgorithm` ``(init, step)``: ``init(position)`` gives an
    :class:`UnderdampedSamplerState` at rest on the manifold, ``step(rng_key,
    state, minibatch, step_size, temperature=1.0)`` the next state.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> grad_estimator = lambda q, batch: -q  # log p = -|q|^2 / 2
    >>> sampler = cola.sampling.underdamped(grad_estimator, friction=1.0, constraints=cola.Circle(0.5))
    >>> state = sampler.init(jnp.array([0.3, -2.0]))  # -2.0 starts at 0.99 r, inside the circle
    >>> step = jax.jit(sampler.step)
    >>> for i in range(10):
    ...   state = step(jax.random.fold_in(jax.random.key(0), i), state, None, 0.1)
    >>> bool(jnp.all(jnp.abs(state.position) <= 0.5)), int(state.count)
    (True, 10)

  References:
    Chen, Fox, Guestrin, *Stochastic Gradient Hamiltonian Monte Carlo*, ICML
    2014. Leimkuhler, Matthews, *Rational construction of stochastic numerical
    methods for molecular sampling*, AMRX 2013 (BAOAB). Leimkuhler, Pouchon,
    Vlaar, Storkey, *Constraint-Based Regularization of Neural Networks*,
    OPT2020 (Sec. 3).
  """
  owner = "cola.sampling.underdamped"
  if not callable(grad_estimator):
    raise TypeError(f"{owner}: grad_estimator must be a function (position, minibatch) -> gradient of log p.")
  if callable(friction):
    raise TypeError(f"{owner}: friction must be a number, not a schedule.")
  check_nonnegative(owner, "friction", friction)
  splitting = splitting_named(owner, splitting)
  driver = Driver(owner, constraints)

  def init(position) -> UnderdampedSamplerState:
    leaves, constraint_states = _start(driver, position)
    momenta = [c.zero_momentum(p) for c, p in zip(leaves.constraints, leaves.compute)]
    return UnderdampedSamplerState(
      leaves.unflatten(leaves.params), leaves.unflatten(momenta), constraint_states, jnp.zeros([], jnp.int32)
    )

  def step(rng_key, state: UnderdampedSamplerState, minibatch, step_size, temperature=1.0) -> UnderdampedSamplerState:
    _check_step_arguments(owner, step_size, temperature)
    grads = _potential_gradient(owner, grad_estimator, state.position, minibatch)
    noisy = not (isinstance(temperature, (int, float)) and temperature == 0)
    update = driver.begin(
      grads,
      state.position,
      state.constraint_states,
      momentum=state.momentum,
      key=rng_key,
      draw=splitting.draw if noisy else None,
    )
    decay = jnp.exp(-friction * jnp.asarray(step_size, jnp.float32))
    tau = jnp.maximum(temperature, 0.0) if noisy else None
    new_params, new_auxes, new_momenta = _rules.underdamped(update, splitting, step_size, decay, tau, state.count == 0)
    return UnderdampedSamplerState(
      update.values(new_params),
      update.leaves.unflatten(new_momenta),
      update.kept(new_auxes),
      state.count + 1,
    )

  return SamplingAlgorithm(init, step)
