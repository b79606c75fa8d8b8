r"""The posterior predictive of a classifier: its predictive probabilities averaged over posterior samples.

Bayesian model averaging over ``S`` samples ``theta_s`` of the parameters:

.. math::
  p(y \mid x) \approx \frac{1}{S} \sum_{s=1}^{S} \mathrm{softmax}\big(f(\theta_s, x)\big)_y,

computed in log space (a running ``logsumexp``), so that a class every sample finds unlikely keeps a finite
log-probability.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _flattened(samples: Any, sample_axes: int) -> tuple[Any, int]:
  leaves = jax.tree.leaves(samples)
  if not leaves:
    raise ValueError("posterior_predictive: samples has no leaves.")
  shapes = {jnp.shape(leaf)[:sample_axes] for leaf in leaves}
  if len(shapes) != 1 or len(next(iter(shapes))) != sample_axes:
    raise ValueError(
      f"posterior_predictive: every leaf of samples must share its first {sample_axes} axes (the samples' "
      f"axes), got leading shapes {sorted(shapes)}."
    )
  count = math.prod(next(iter(shapes)))
  return jax.tree.map(lambda leaf: jnp.reshape(leaf, (count, *jnp.shape(leaf)[sample_axes:])), samples), count


def posterior_predictive(
  apply_fn: Callable[[Any, Any], jax.Array],
  samples: Any,
  inputs: Any,
  *,
  sample_axes: int = 1,
  batch_size: int = 1,
) -> jax.Array:
  r"""The log of the model's predictive probabilities averaged over the samples (Bayesian model averaging).

  ``apply_fn(params, inputs)`` returns logits (the last axis the classes) for one sample ``params``. The
  samples are visited by ``jax.lax.scan``, ``batch_size`` of them at a time (vmapped): memory is that of
  ``batch_size`` predictions, whatever the number of samples.

  For a Flax linen model, ``apply_fn = lambda params, x: model.apply({'params': params}, x)`` with the samples
  of its ``params``; for an nnx model, sample the ``nnx.State`` of ``graphdef, state = nnx.split(model)`` and pass
  ``apply_fn = lambda state, x: nnx.merge(graphdef, state)(x)``.

  Args:
    apply_fn: ``(params, inputs) -> logits``.
    samples: the parameters' samples: a pytree whose leaves share ``sample_axes`` leading axes (1: one chain's
      ``chain.samples``; 2: :func:`cola_jax.sampling.sample_chains`' ``(chains, samples)``).
    inputs: the inputs, passed to ``apply_fn`` as they are.
    sample_axes: how many leading axes of the samples index them.
    batch_size: samples evaluated together; it must divide their number.

  Returns:
    ``log((1 / S) sum_s softmax(apply_fn(theta_s, inputs)))``, shaped like the logits: ``jnp.exp`` of it are the
    averaged probabilities; :func:`cola_jax.sampling.accuracy`, :func:`~cola_jax.sampling.negative_log_likelihood`
    and :func:`~cola_jax.sampling.expected_calibration_error` read it as it is.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> apply_fn = lambda w, x: x @ w  # a linear classifier, 3 features, 2 classes
    >>> samples = jnp.stack([jnp.zeros((3, 2)), jnp.array([[10.0, 0.0]] * 3)])  # 2 samples of w
    >>> log_probs = cola.sampling.posterior_predictive(apply_fn, samples, jnp.ones((1, 3)))
    >>> [round(float(p), 3) for p in jnp.exp(log_probs)[0]]  # halfway between (0.5, 0.5) and (1, 0)
    [0.75, 0.25]
  """
  if not callable(apply_fn):
    raise TypeError(f"posterior_predictive: apply_fn must be a function (params, inputs) -> logits, got {apply_fn!r}.")
  if isinstance(sample_axes, bool) or not isinstance(sample_axes, int) or sample_axes < 1:
    raise ValueError(f"posterior_predictive: sample_axes must be an integer >= 1, got {sample_axes!r}.")
  samples, count = _flattened(samples, sample_axes)
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1 or count % batch_size:
    raise ValueError(
      f"posterior_predictive: batch_size must be a positive integer dividing the number of samples ({count}), "
      f"got {batch_size!r}."
    )
  batches = jax.tree.map(lambda leaf: jnp.reshape(leaf, (count // batch_size, batch_size, *leaf.shape[1:])), samples)
  log_softmax = lambda params: jax.nn.log_softmax(apply_fn(params, inputs), axis=-1)
  first = jax.eval_shape(log_softmax, jax.tree.map(lambda leaf: leaf[0], samples))

  def accumulate(total, batch):
    log_probs = jax.vmap(log_softmax)(batch)
    return jnp.logaddexp(total, jax.nn.logsumexp(log_probs, axis=0)), None

  start = jnp.full(first.shape, -jnp.inf, first.dtype)
  total, _ = jax.lax.scan(accumulate, start, batches)
  return total - jnp.log(jnp.asarray(count, first.dtype))
