r"""cola_jax.sampling's posterior predictive (Bayesian model averaging) and the metrics of a classification paper.

The predictive is checked against the average of softmax probabilities written out, for a Flax linen MLP's
params and an nnx model's state (nnx.split / nnx.merge), and its memory against the number of samples; the
metrics against small cases computed by hand.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cola_jax import sampling

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402


class MLP(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(3)(jax.nn.tanh(linen.Dense(8)(x)))


INPUTS = jax.random.normal(jax.random.key(0), (16, 4))


def linen_samples(num_samples):
  """Parameter samples of the MLP, stacked along a leading axis (as a chain's samples are)."""
  model = MLP()
  init = lambda key: model.init(key, INPUTS)["params"]
  return model, jax.vmap(init)(jax.random.split(jax.random.key(1), num_samples))


def average_written_out(apply_fn, samples, num_samples):
  probs = [jax.nn.softmax(apply_fn(jax.tree.map(lambda x: x[s], samples), INPUTS)) for s in range(num_samples)]
  return sum(probs) / num_samples


@pytest.mark.parametrize("batch_size", [pytest.param(1, marks=pytest.mark.extended), 3])  # quick: batches of 3
def test_the_predictive_of_a_linen_mlp_is_the_average_of_its_probabilities(batch_size):
  model, samples = linen_samples(6)
  apply_fn = lambda params, x: model.apply({"params": params}, x)
  log_probs = sampling.posterior_predictive(apply_fn, samples, INPUTS, batch_size=batch_size)
  assert log_probs.shape == (16, 3)
  np.testing.assert_allclose(jnp.exp(log_probs), average_written_out(apply_fn, samples, 6), rtol=1e-5)
  jitted = jax.jit(lambda s: sampling.posterior_predictive(apply_fn, s, INPUTS, batch_size=batch_size))
  np.testing.assert_allclose(jitted(samples), log_probs, rtol=1e-6)


def test_chains_times_samples_with_sample_axes_two():
  model, samples = linen_samples(6)
  apply_fn = lambda params, x: model.apply({"params": params}, x)
  by_chain = jax.tree.map(lambda x: x.reshape(2, 3, *x.shape[1:]), samples)
  np.testing.assert_allclose(
    sampling.posterior_predictive(apply_fn, by_chain, INPUTS, sample_axes=2),
    sampling.posterior_predictive(apply_fn, samples, INPUTS),
    rtol=1e-6,
  )


@pytest.mark.extended  # quick: the linen MLP's predictive above (any apply_fn of a pytree of samples)
def test_the_predictive_of_an_nnx_model_by_split_and_merge():
  model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), jax.nn.tanh, nnx.Linear(8, 3, rngs=nnx.Rngs(1)))
  graphdef, state = nnx.split(model)
  noise = lambda key, x: x + 0.3 * jax.random.normal(key, x.shape)
  samples = jax.vmap(lambda key: jax.tree.map(lambda x: noise(key, x), state))(jax.random.split(jax.random.key(2), 4))
  apply_fn = lambda state, x: nnx.merge(graphdef, state)(x)
  log_probs = sampling.posterior_predictive(apply_fn, samples, INPUTS, batch_size=2)
  np.testing.assert_allclose(jnp.exp(log_probs), average_written_out(apply_fn, samples, 4), rtol=1e-5)


def test_a_class_every_sample_finds_unlikely_keeps_a_finite_log_probability():
  apply_fn = lambda w, x: x @ w
  samples = jnp.stack([jnp.array([[200.0, 0.0]]), jnp.array([[300.0, 0.0]])])  # class 1: log p = -200 and -300
  log_probs = sampling.posterior_predictive(apply_fn, samples, jnp.ones((1, 1)))
  np.testing.assert_allclose(log_probs[0, 1], jnp.logaddexp(-200.0, -300.0) - jnp.log(2.0), rtol=1e-6)
  assert float(sampling.negative_log_likelihood(log_probs, jnp.array([1]))) == pytest.approx(200 + np.log(2), rel=1e-6)


def temporaries(num_samples):
  model, samples = linen_samples(num_samples)
  apply_fn = lambda params, x: model.apply({"params": params}, x)
  predictive = lambda s: sampling.posterior_predictive(apply_fn, s, INPUTS, batch_size=2)
  return jax.jit(predictive).lower(samples).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.extended  # quick: the linen MLP's predictive above with batch_size=3 (samples a batch at a time)
def test_memory_does_not_grow_with_the_number_of_samples():
  assert temporaries(400) == temporaries(20)


def test_bad_samples_and_batch_sizes_are_named():
  apply_fn = lambda w, x: x @ w
  with pytest.raises(ValueError, match=r"batch_size must be a positive integer dividing the number of samples \(5\)"):
    sampling.posterior_predictive(apply_fn, jnp.zeros((5, 1, 2)), jnp.ones((1, 1)), batch_size=2)
  with pytest.raises(ValueError, match="every leaf of samples must share its first 1 axes"):
    sampling.posterior_predictive(apply_fn, {"a": jnp.zeros((5, 1)), "b": jnp.zeros((4, 1))}, jnp.ones((1, 1)))
  with pytest.raises(TypeError, match="apply_fn must be a function"):
    sampling.posterior_predictive(None, jnp.zeros((5, 1, 2)), jnp.ones((1, 1)))


# Hand-computed cases: probabilities (3 classes), labels, and what each metric must give.
PROBS = jnp.array(
  [
    [0.70, 0.20, 0.10],  # confidence 0.70 (bin 11 of 15: (10/15, 11/15]), correct
    [0.10, 0.80, 0.10],  # 0.80 (bin 12: (11/15, 12/15]), wrong (label 0)
    [0.30, 0.30, 0.40],  # 0.40 (bin 6: (5/15, 6/15]), correct
    [0.05, 0.05, 0.90],  # 0.90 (bin 14: (13/15, 14/15]), correct
    [0.68, 0.12, 0.20],  # 0.68 (bin 11), wrong (label 2)
  ]
)
LABELS = jnp.array([0, 0, 2, 2, 2])


def test_accuracy_and_nll_by_hand():
  assert float(sampling.accuracy(jnp.log(PROBS), LABELS)) == pytest.approx(3 / 5)
  nll = -(np.log(0.7) + np.log(0.1) + np.log(0.4) + np.log(0.9) + np.log(0.2)) / 5
  assert float(sampling.negative_log_likelihood(jnp.log(PROBS), LABELS)) == pytest.approx(nll, rel=1e-6)


def test_the_metrics_read_logits_as_their_log_softmax():
  logits = jnp.log(PROBS) + jnp.array([[3.0], [-1.0], [0.5], [2.0], [7.0]])  # each row shifted: the same softmax
  for metric in (sampling.accuracy, sampling.negative_log_likelihood, sampling.expected_calibration_error):
    assert float(metric(logits, LABELS)) == pytest.approx(float(metric(jnp.log(PROBS), LABELS)), rel=1e-5)


def test_expected_calibration_error_with_15_bins_by_hand():
  # bin 11: confidences 0.70, 0.68 (mean 0.69), accuracy 1/2; bin 12: 0.80, accuracy 0; bin 6: 0.40, accuracy 1;
  # bin 14: 0.90, accuracy 1.
  expected = (2 * abs(0.5 - 0.69) + abs(0 - 0.8) + abs(1 - 0.4) + abs(1 - 0.9)) / 5
  assert float(sampling.expected_calibration_error(jnp.log(PROBS), LABELS)) == pytest.approx(expected, rel=1e-5)
  # One bin: |accuracy - mean confidence| over all examples.
  one_bin = abs(3 / 5 - float(jnp.mean(jnp.max(PROBS, axis=1))))
  assert float(sampling.expected_calibration_error(jnp.log(PROBS), LABELS, num_bins=1)) == pytest.approx(one_bin)
  perfectly_calibrated = jnp.log(jnp.array([[0.5, 0.5], [0.5, 0.5]]))
  assert float(sampling.expected_calibration_error(perfectly_calibrated, jnp.array([0, 1]))) == pytest.approx(0.0)


def test_bad_metric_inputs_are_named():
  with pytest.raises(ValueError, match=r"accuracy: log_probs must have the labels' shape plus a class axis"):
    sampling.accuracy(jnp.zeros((4, 3)), jnp.zeros(5, jnp.int32))
  with pytest.raises(TypeError, match="negative_log_likelihood: labels must be integers"):
    sampling.negative_log_likelihood(jnp.zeros((4, 3)), jnp.zeros(4))
  with pytest.raises(ValueError, match="expected_calibration_error: num_bins must be an integer >= 1, got 0"):
    sampling.expected_calibration_error(jnp.zeros((4, 3)), jnp.zeros(4, jnp.int32), num_bins=0)
