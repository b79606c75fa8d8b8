"""Chains of a stochastic-gradient sampler on a classifier, every member at once, and the posterior predictive.

A :class:`Method` is a sampler in blackjax's shape (``init(position)``, ``step(key, state, minibatch, ...)``)
or an optimizer dressed as one; :func:`run_chains` runs one method's members (seeds, step sizes,
temperatures) under ``vmap``, ``lax.scan`` over the steps: a burn-in, then ``samples`` thinned
positions, each one's predictive probabilities on the evaluation sets averaged in log space (Bayesian
model averaging). A point estimate is the case ``samples = 1`` without burn-in: its last position.
Every chain takes the same number of gradient evaluations (a step that evaluates ``grads_per_step``
gradients counts that many). :func:`classification_metrics` scores the averaged probabilities:
accuracy, negative log-likelihood and expected calibration error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax import sampling

from .train import seed_keys


class Method(NamedTuple):
  """What :func:`run_chains` needs of a sampler or an optimizer.

  ``init(member, params) -> state``; ``step(member, key, state, minibatch) -> state`` with
  ``minibatch = (x, y)``; ``position(state) -> params``; ``grads_per_step`` gradient evaluations per
  ``step``. ``member`` maps each name of the members to its (traced) value for this chain.
  ``vectorized``: the chains run under ``vmap``; ``False``, one after the other (``lax.map``), for
  steps that ``vmap`` makes slower per chain (an orthogonal projection's loop on XLA:CPU).
  """

  init: Callable
  step: Callable
  position: Callable
  grads_per_step: int = 1
  vectorized: bool = True


def _state_of(out):
  """A blackjax-shaped step's new state: its return value, or the first item of ``(state, info)``."""
  if isinstance(out, tuple) and not hasattr(out, "_fields") and len(out) == 2:
    return out[0]
  return out


def sampling_algorithm(make: Callable, grads_per_step: int = 1, vectorized: bool = True) -> Method:
  """A :class:`Method` from ``make(member) -> (init, step)`` in blackjax's shape: ``init(position)``,
  ``step(key, state, minibatch, step_size, temperature)``; the step size and temperature are the
  member's ``step_size`` and ``temperature``. The position is ``state.position`` if the state has one,
  else the state itself (blackjax's ``sgld`` and ``sghmc`` keep the bare position)."""

  def step(member, key, state, minibatch):
    alg = make(member)
    return _state_of(alg.step(key, state, minibatch, member["step_size"], member["temperature"]))

  return Method(
    init=lambda member, params: make(member).init(params),
    step=step,
    position=lambda state: getattr(state, "position", state),
    grads_per_step=grads_per_step,
    vectorized=vectorized,
  )


def optimizer(make_tx: Callable, grad_fn: Callable) -> Method:
  """A :class:`Method` from an optax transformation ``make_tx(member)``, descending ``grad_fn(params,
  minibatch)`` (the gradient of the loss)."""
  import optax

  def step(member, key, state, minibatch):
    params, opt_state = state
    updates, opt_state = make_tx(member).update(grad_fn(params, minibatch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return Method(
    init=lambda member, params: (params, make_tx(member).init(params)),
    step=step,
    position=lambda state: state[0],
  )


def schedule(budget: int, grads_per_step: int, burn_in: float, samples: int) -> dict:
  """Steps of a chain of ``budget`` gradient evaluations: the burn-in (``burn_in`` of them, a fraction)
  and ``samples`` equal stretches after it, each ending at a sample; the remainder is not run."""
  steps = budget // grads_per_step
  burn = round(burn_in * steps)
  thin = (steps - burn) // samples
  if thin < 1:
    raise ValueError(f"a budget of {budget} gradients leaves no step between {samples} samples after burn-in")
  return {
    "burn_in_steps": burn,
    "thin": thin,
    "samples": samples,
    "steps": burn + samples * thin,
    "gradient_evaluations": (burn + samples * thin) * grads_per_step,
  }


def _batches(key, n: int, batch_size: int, steps: int) -> jax.Array:
  """``(steps, batch_size)`` training indices: epochs of a fresh permutation each, the last partial
  minibatch of every epoch dropped."""
  per_epoch = n // batch_size
  epochs = -(-steps // per_epoch)
  orders = jax.vmap(lambda k: jax.random.permutation(k, n)[: per_epoch * batch_size])(jax.random.split(key, epochs))
  return orders.reshape(epochs * per_epoch, batch_size)[:steps]


def run_chains(
  method: Method,
  *,
  init_params: Callable,
  log_probs: Callable,
  train: tuple,
  eval_sets: Mapping[str, tuple],
  members: Mapping[str, Any],
  plan: dict,
  batch_size: int,
) -> dict:
  """Runs one chain per member and returns each one's posterior predictive, scored.

  Args:
    method: the sampler or optimizer.
    init_params: ``init_key -> params``, the start (the key of the member's seed, the same for
      every method).
    log_probs: ``(params, x) -> (n, classes)`` log-probabilities.
    train: ``(x, y)`` training arrays the minibatches are drawn from.
    eval_sets: name -> ``(x, y)`` sets the predictive is evaluated on at each sample.
    members: arrays with one entry per chain, ``"seed"`` among them (it fixes the start, the
      minibatch order and the noise).
    plan: :func:`schedule`'s steps.
    batch_size: examples per minibatch.

  Returns:
    ``{"metrics": {set: {name: (members,) numpy}}, "compile_s", "run_s"}``: each set's
    :func:`classification_metrics` of the averaged predictive and ``sample_accuracy`` and
    ``sample_nll``, the single samples' scores averaged over the samples.
  """
  x_train, y_train = (jax.device_put(a) for a in train)
  sets = {k: tuple(jax.device_put(a) for a in v) for k, v in eval_sets.items()}
  burn, thin, samples = plan["burn_in_steps"], plan["thin"], plan["samples"]
  steps = plan["steps"]

  def chain(member):
    init_key, shuffle_key, noise_key = seed_keys(member["seed"])
    state = method.init(member, init_params(init_key))
    order = _batches(shuffle_key, x_train.shape[0], batch_size, steps)
    keys = jax.random.split(noise_key, steps)

    def one(state, xs):
      key, idx = xs
      return method.step(member, key, state, (x_train[idx], y_train[idx])), None

    state, _ = jax.lax.scan(one, state, (keys[:burn], order[:burn]))

    def sample(carry, xs):
      state, sums = carry
      state, _ = jax.lax.scan(one, state, xs)
      position = method.position(state)
      out = {}
      for name, (x, y) in sets.items():
        lp = log_probs(position, x)
        sums = {**sums, name: jnp.logaddexp(sums[name], lp)}
        picked = jnp.take_along_axis(lp, y[:, None], axis=1)[:, 0]
        out[name] = (jnp.mean(jnp.argmax(lp, -1) == y), -jnp.mean(picked))
      return (state, sums), out

    rest = lambda a: a[burn:].reshape(samples, thin, *a.shape[1:])
    shape = lambda x: jax.eval_shape(log_probs, method.position(state), x).shape
    start = {name: jnp.full(shape(x), -jnp.inf) for name, (x, _) in sets.items()}
    (_, sums), per_sample = jax.lax.scan(sample, (state, start), (rest(keys), rest(order)))
    result = {}
    for name, (_, y) in sets.items():
      result[name] = classification_metrics(sums[name] - math.log(samples), y)
      result[name]["sample_accuracy"] = jnp.mean(per_sample[name][0])
      result[name]["sample_nll"] = jnp.mean(per_sample[name][1])
    return result

  members = {k: jnp.asarray(v) for k, v in members.items()}
  t0 = time.perf_counter()
  chains = jax.vmap(chain) if method.vectorized else (lambda m: jax.lax.map(chain, m))
  compiled = jax.jit(chains).lower(members).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  metrics = jax.device_get(compiled(members))
  run_s = time.perf_counter() - t0
  return {"metrics": jax.tree.map(np.asarray, metrics), "compile_s": compile_s, "run_s": run_s}


def classification_metrics(log_probs: jax.Array, y: jax.Array, bins: int = 15) -> dict:
  """Accuracy, mean negative log-likelihood and expected calibration error (``bins`` equal bins) of ``(n,
  classes)`` log-probabilities against labels ``y``: :mod:`cola_jax.sampling`'s."""
  return {
    "accuracy": sampling.accuracy(log_probs, y),
    "nll": sampling.negative_log_likelihood(log_probs, y),
    "ece": sampling.expected_calibration_error(log_probs, y, num_bins=bins),
  }
