r"""What a Bayesian classification paper reports of a predictive: accuracy, negative log-likelihood, calibration.

Each metric reads logits or log-probabilities (the last axis the classes; normalised by ``log_softmax``, so a
single model's logits and :func:`cola_jax.sampling.posterior_predictive`'s averaged log-probabilities are read
alike) and integer labels, one per example.

The expected calibration error with ``B`` equal-width bins of the confidence ``c_i = max_k p_ik``
(bin ``b`` holds ``(b - 1) / B < c <= b / B``) is

.. math::
  \mathrm{ECE} = \sum_{b=1}^{B} \frac{n_b}{n} \big| \mathrm{acc}_b - \mathrm{conf}_b \big|,

``acc_b`` the accuracy and ``conf_b`` the mean confidence of the ``n_b`` examples in bin ``b``.

References:
  Guo, Pleiss, Sun, Weinberger, *On calibration of modern neural networks*, ICML 2017 (ECE, 15 bins).
  Naeini, Cooper, Hauskrecht, *Obtaining well calibrated probabilities using Bayesian binning*, AAAI 2015.
"""

import jax
import jax.numpy as jnp


def _checked(owner: str, log_probs, labels):
  log_probs, labels = jnp.asarray(log_probs), jnp.asarray(labels)
  if log_probs.ndim < 1 or log_probs.shape[:-1] != labels.shape:
    raise ValueError(
      f"{owner}: log_probs must have the labels' shape plus a class axis, got {log_probs.shape} and labels "
      f"{labels.shape}."
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{owner}: labels must be integers (class indices), got dtype {labels.dtype}.")
  return jax.nn.log_softmax(log_probs, axis=-1), labels


def accuracy(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
  """The fraction of examples whose most probable class is the label.

  Args:
    log_probs: logits or log-probabilities, shape ``(..., classes)``.
    labels: integer labels, shape ``(...)``.

  Returns:
    A scalar in [0, 1].

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> log_probs = jnp.log(jnp.array([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]]))
    >>> float(cola.sampling.accuracy(log_probs, jnp.array([0, 0, 0])))  # the second is wrong
    0.666...
  """
  log_probs, labels = _checked("accuracy", log_probs, labels)
  return jnp.mean(jnp.argmax(log_probs, axis=-1) == labels)


def negative_log_likelihood(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
  r"""The mean negative log-likelihood of the labels, ``-(1/n) sum_i log p_i(y_i)``.

  Args:
    log_probs: logits or log-probabilities, shape ``(..., classes)``.
    labels: integer labels, shape ``(...)``.

  Returns:
    A non-negative scalar.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> log_probs = jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.75]]))
    >>> nll = cola.sampling.negative_log_likelihood(log_probs, jnp.array([0, 1]))
    >>> bool(jnp.isclose(nll, -(jnp.log(0.5) + jnp.log(0.75)) / 2))
    True
  """
  log_probs, labels = _checked("negative_log_likelihood", log_probs, labels)
  return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


def expected_calibration_error(log_probs: jax.Array, labels: jax.Array, num_bins: int = 15) -> jax.Array:
  r"""The expected calibration error: confidence against accuracy in ``num_bins`` equal-width bins.

  Args:
    log_probs: logits or log-probabilities, shape ``(..., classes)``.
    labels: integer labels, shape ``(...)``.
    num_bins: the number of equal-width bins of the confidence over [0, 1] (15, as Guo et al.).

  Returns:
    A scalar in [0, 1]: 0 when, in every bin, the accuracy is the mean confidence.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> probs = jnp.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.6, 0.4]])
    >>> labels = jnp.array([0, 0, 0, 1])  # bin of 0.9: accuracy 1; bin of 0.6: accuracy 0.5
    >>> ece = cola.sampling.expected_calibration_error(jnp.log(probs), labels)
    >>> bool(jnp.isclose(ece, 0.5 * 0.1 + 0.5 * 0.1))
    True
  """
  if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
    raise ValueError(f"expected_calibration_error: num_bins must be an integer >= 1, got {num_bins!r}.")
  log_probs, labels = _checked("expected_calibration_error", log_probs, labels)
  confidence = jnp.exp(jnp.max(log_probs, axis=-1)).ravel()
  correct = (jnp.argmax(log_probs, axis=-1) == labels).ravel().astype(confidence.dtype)
  bins = jnp.clip(jnp.ceil(confidence * num_bins).astype(jnp.int32) - 1, 0, num_bins - 1)
  gap = jax.ops.segment_sum(correct - confidence, bins, num_segments=num_bins)  # n_b (acc_b - conf_b)
  return jnp.sum(jnp.abs(gap)) / confidence.size
