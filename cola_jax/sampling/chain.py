r"""Sample collection: a chain of any blackjax-shaped sampler run as one JAX loop, storing only what is asked.

A sampler is blackjax's pair ``(init, step)``: ``init(position) -> state`` and
``step(rng_key, state, minibatch, step_size, temperature) -> state`` (or
``(state, info)``); ``blackjax.sgld`` and ``blackjax.sghmc`` are such samplers (their state is the position
itself), as are :func:`cola_jax.sampling.overdamped` and :func:`cola_jax.sampling.underdamped` (a state with a
``position`` field).

Keys: a chain has one key. Its step ``i`` (counted from the chain's first step, burn-in included) draws from
``jax.random.fold_in(key, i)``, so one seed gives one chain, and a chain resumed at step ``i`` (``start=i``)
draws what the uninterrupted chain would have drawn.
"""

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cola_jax._hyperparameters import check_nonnegative, check_positive
from cola_jax._numerics import concrete_float
from cola_jax.sampling import _progress


class Chain(NamedTuple):
  """What :func:`sample_chain` returns.

  Attributes:
    samples: what was stored (the positions, or ``observable(position)``), each leaf with a leading axis of
      ``num_samples`` (after the chain axis, for :func:`sample_chains`).
    state: the sampler's state after the last step, from which the chain resumes.
    num_steps: the steps the chain has taken since its first (burn-in included), the ``start`` of a resumed run.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> step = lambda key, x, batch, h, T: x + h * (batch - x) + jnp.sqrt(2 * T * h) * jax.random.normal(key)
    >>> chain = cola.sampling.sample_chain(step, 0.0, jax.random.key(0), 1.0, num_samples=3, step_size=0.1)
    >>> chain.samples.shape, int(chain.num_steps)
    ((3,), 3)
  """

  samples: Any
  state: Any
  num_steps: jax.Array


def _count(owner: str, name: str, value: Any, least: int) -> int:
  try:
    count = operator.index(value)
  except TypeError:
    raise TypeError(f"{owner}: {name} must be an integer, got {value!r}.") from None
  if isinstance(value, bool) or count < least:
    raise ValueError(f"{owner}: {name} must be an integer >= {least}, got {value!r}.")
  return count


def _at(value: Any, i: jax.Array) -> Any:
  """A number, or an optax-style schedule's value at step count ``i``."""
  return value(i) if callable(value) else value


def _position(state: Any) -> Any:
  """The position in a sampler's state: its ``position`` field, or the state itself (blackjax's SG-MCMC)."""
  return state.position if hasattr(state, "position") else state


def _next_state(owner: str, out: Any, state: Any) -> Any:
  """The state in what a step returned: a state, or ``(state, info)``."""
  structure = jax.tree.structure(state)
  if jax.tree.structure(out) == structure:
    return out
  if isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == structure:
    return out[0]
  raise TypeError(
    f"{owner}: step must return the state (tree {structure}) or (state, info), got a tree {jax.tree.structure(out)}."
  )


class _Options(NamedTuple):
  """A run's settings, checked."""

  owner: str
  num_samples: int
  num_burnin: int
  thinning: int
  step_size: Any
  temperature: Any
  observable: Callable[[Any], Any] | None
  progress_bar: bool

  @property
  def total(self) -> int:
    return self.num_burnin + self.num_samples * self.thinning


def _run(step, state, key, minibatch, start, options: _Options):
  """The chain as one loop: (samples, last state)."""
  report = _progress.progress(options.total) if options.progress_bar else _progress.silent
  observable = options.observable
  observe = _position if observable is None else lambda s: observable(_position(s))
  start = jnp.asarray(start, jnp.int32)

  def one_step(j, state):  # j: the step's index in this run; start + j: in the chain
    i = start + j
    batch = minibatch(i) if callable(minibatch) else minibatch
    out = step(jax.random.fold_in(key, i), state, batch, _at(options.step_size, i), _at(options.temperature, i))
    report(j)
    return _next_state(options.owner, out, state)

  state = jax.lax.fori_loop(0, options.num_burnin, one_step, state)

  # The samples are written into one buffer carried through the loop (not stacked by scan): under vmap (many
  # chains) it is then (chains, samples, ...) in place, where scan's stacked output would be transposed, a copy.
  shapes = jax.eval_shape(observe, state)
  buffer = jax.tree.map(lambda x: jnp.zeros((options.num_samples, *x.shape), x.dtype), shapes)

  def one_sample(k, carry):
    state, samples = carry
    j = options.num_burnin + k * options.thinning
    state = jax.lax.fori_loop(0, options.thinning, lambda t, s: one_step(j + t, s), state)
    samples = jax.tree.map(lambda b, x: b.at[k].set(x), samples, observe(state))
    return state, samples

  state, samples = jax.lax.fori_loop(0, options.num_samples, one_sample, (state, buffer))
  return samples, state


def _checked(owner, step, start, **settings) -> _Options:
  if not callable(step):
    raise TypeError(
      f"{owner}: step must be a sampler's step function (rng_key, state, minibatch, step_size, "
      f"temperature) -> state, got {step!r}."
    )
  observable = settings["observable"]
  if observable is not None and not callable(observable):
    raise TypeError(
      f"{owner}: observable must be None (store the positions) or a function of the position, got {observable!r}."
    )
  if jnp.ndim(start) != 0 or not jnp.issubdtype(jnp.result_type(start), jnp.integer):
    raise TypeError(f"{owner}: start must be an integer scalar (a chain's num_steps), got {start!r}.")
  known = concrete_float(start)
  if known is not None and known < 0:
    raise ValueError(f"{owner}: start must be >= 0, got {start!r}.")
  check_positive(owner, "step_size", settings["step_size"])
  check_nonnegative(owner, "temperature", settings["temperature"])
  counts = dict(
    num_samples=_count(owner, "num_samples", settings["num_samples"], 1),
    num_burnin=_count(owner, "num_burnin", settings["num_burnin"], 0),
    thinning=_count(owner, "thinning", settings["thinning"], 1),
  )
  return _Options(owner=owner, **{**settings, **counts})


def sample_chain(
  step: Callable[..., Any],
  state: Any,
  key: jax.Array,
  minibatch: Any,
  *,
  num_samples: int,
  step_size: Any,
  temperature: Any = 1.0,
  num_burnin: int = 0,
  thinning: int = 1,
  observable: Callable[[Any], Any] | None = None,
  start: Any = 0,
  progress_bar: bool = False,
) -> Chain:
  r"""Runs a chain of a sampler and stores its thinned positions, or observables of them.

  The chain takes ``num_burnin`` steps, then ``num_samples`` times ``thinning`` steps, storing after each
  ``thinning`` steps the position (or ``observable(position)``). All of it is one loop (``jax.lax.fori_loop``): jit it,
  vmap it over keys and starts (or call :func:`sample_chains`). Memory is that of the stored samples and one
  state: nothing grows with ``num_burnin`` or ``thinning``.

  Step ``i`` of the chain (``i = start, start + 1, ...``, burn-in included) calls
  ``step(jax.random.fold_in(key, i), state, batch_i, step_size_i, temperature_i)``, where ``batch_i`` is
  ``minibatch(i)`` if ``minibatch`` is callable (a function of the step index: slice or draw the step's batch from
  arrays it closes over) and ``minibatch`` itself otherwise (the same batch every step), and ``step_size_i`` /
  ``temperature_i`` are the numbers given, or an optax-style schedule's value at ``i``. A chain resumed from
  the returned :class:`Chain` with the same key and ``start=chain.num_steps`` continues the same stream: ``n``
  then ``m`` samples are the ``n + m`` samples of one run.

  Args:
    step: the sampler's step, ``(rng_key, state, minibatch, step_size, temperature) -> state`` or
      ``(state, info)`` (``info`` is dropped), e.g. ``blackjax.sgld(grad_estimator).step`` or
      ``cola.sampling.underdamped(...).step``.
    state: the sampler's state at the chain's start (``init(position)``, or a returned ``chain.state``).
    key: the chain's PRNG key.
    minibatch: the step's data: a function of the step index (a traced int32) returning it, or a fixed pytree.
    num_samples: how many samples to store.
    step_size: the step size, a positive number or a schedule of the step index.
    temperature: the sampler's temperature, a non-negative number or a schedule (1: the posterior).
    num_burnin: steps taken before the first stored sample.
    thinning: steps per stored sample (the last of them is stored).
    observable: ``f(position) -> pytree`` to store instead of the position (None: the position).
    start: the index of the chain's first step here: 0 for a new chain, ``chain.num_steps`` to resume one.
    progress_bar: show a tqdm bar (tqdm must be installed); it reads the step counter only and changes no result.

  Returns:
    A :class:`Chain`: ``samples`` (each leaf with a leading axis of ``num_samples``), the last ``state`` and
    ``num_steps = start + num_burnin + num_samples * thinning``.

  Example:
    SGLD on the density ``exp(-x**2 / 2)``, written as blackjax writes it (the gradient of the log-density):

    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> def sgld_step(key, x, batch, step_size, temperature):
    ...   noise = jax.random.normal(key, x.shape)
    ...   return x - step_size * x + jnp.sqrt(2 * temperature * step_size) * noise
    >>> chain = cola.sampling.sample_chain(
    ...   sgld_step, jnp.zeros(2), jax.random.key(0), None, num_samples=100, step_size=0.1, num_burnin=50,
    ...   thinning=5, observable=lambda x: {'x0': x[0], 'square': jnp.sum(x**2)})
    >>> chain.samples['square'].shape, int(chain.num_steps)
    ((100,), 550)
    >>> more = cola.sampling.sample_chain(
    ...   sgld_step, chain.state, jax.random.key(0), None, num_samples=10, step_size=0.1, thinning=5,
    ...   start=chain.num_steps)  # the next 10 samples of the same chain
    >>> int(more.num_steps)
    600
  """
  options = _checked(
    "sample_chain",
    step,
    start,
    num_samples=num_samples,
    num_burnin=num_burnin,
    thinning=thinning,
    step_size=step_size,
    temperature=temperature,
    observable=observable,
    progress_bar=progress_bar,
  )
  samples, state = _run(step, state, key, minibatch, start, options)
  return Chain(samples, state, jnp.asarray(start, jnp.int32) + options.total)


def sample_chains(
  step: Callable[..., Any],
  states: Any,
  keys: jax.Array,
  minibatch: Any,
  *,
  num_samples: int,
  step_size: Any,
  temperature: Any = 1.0,
  num_burnin: int = 0,
  thinning: int = 1,
  observable: Callable[[Any], Any] | None = None,
  start: Any = 0,
  progress_bar: bool = False,
) -> Chain:
  r"""Runs many independent chains of a sampler at once: :func:`sample_chain` vmapped over keys and starts.

  Chain ``c`` starts from ``states``' entry ``c`` (every leaf's leading axis indexes the chains: ``jax.vmap(init)``
  of stacked positions) and draws from ``keys[c]``; each is the chain :func:`sample_chain` would give with
  that state and key. All chains share the minibatches, the step size and temperature, and ``start``; one
  progress bar counts their common steps.

  Args:
    step: the sampler's step, as for :func:`sample_chain`.
    states: the chains' states, stacked along a leading axis.
    keys: one key per chain (``jax.random.split(key, num_chains)``).
    minibatch: the step's data, shared by the chains (a function of the step index, or a fixed pytree).
    num_samples: how many samples to store per chain.
    step_size: the step size, a positive number or a schedule of the step index.
    temperature: the temperature, a non-negative number or a schedule.
    num_burnin: steps before the first stored sample.
    thinning: steps per stored sample.
    observable: ``f(position) -> pytree`` to store instead of the position.
    start: the index of the chains' first step here (``chains.num_steps`` to resume).
    progress_bar: show one tqdm bar for all chains.

  Returns:
    A :class:`Chain` whose ``samples`` leaves have shape ``(num_chains, num_samples, ...)`` (blackjax's
    diagnostics' layout: chain axis 0, sample axis 1), ``state`` the chains' states and ``num_steps`` a scalar.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> def sgld_step(key, x, batch, step_size, temperature):
    ...   return x - step_size * x + jnp.sqrt(2 * temperature * step_size) * jax.random.normal(key, x.shape)
    >>> starts = jnp.linspace(-3.0, 3.0, 4)[:, None]  # 4 chains of a 1-D position
    >>> keys = jax.random.split(jax.random.key(0), 4)
    >>> chains = cola.sampling.sample_chains(sgld_step, starts, keys, None, num_samples=200, step_size=0.1,
    ...                                      num_burnin=100, observable=lambda x: x[0])
    >>> chains.samples.shape
    (4, 200)
  """
  options = _checked(
    "sample_chains",
    step,
    start,
    num_samples=num_samples,
    num_burnin=num_burnin,
    thinning=thinning,
    step_size=step_size,
    temperature=temperature,
    observable=observable,
    progress_bar=progress_bar,
  )
  samples, states = jax.vmap(lambda state, key: _run(step, state, key, minibatch, start, options))(states, keys)
  return Chain(samples, states, jnp.asarray(start, jnp.int32) + options.total)
