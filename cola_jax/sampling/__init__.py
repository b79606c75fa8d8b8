"""Sampling the posterior: SG-MCMC samplers in blackjax's shape, and what a Bayesian user does with their chains.

A sampler is an ``(init, step)`` pair (blackjax's ``SamplingAlgorithm``): ``init(position) -> state``,
``step(rng_key, state, minibatch, step_size, temperature=1.0) -> state``; :func:`overdamped` and
:func:`underdamped` are the CoLA dynamics as such samplers, on the manifolds of the constraints.
:func:`sample_chain` and :func:`sample_chains` run any such sampler (cola's, or blackjax's ``sgld`` and
``sghmc``) with burn-in and thinning; :func:`effective_sample_size` and :func:`potential_scale_reduction`
tell whether the chains have mixed; :func:`posterior_predictive` averages a classifier's predictive over the
samples, and :func:`accuracy`, :func:`negative_log_likelihood` and :func:`expected_calibration_error` score it.
"""

from cola_jax.sampling.chain import Chain, sample_chain, sample_chains
from cola_jax.sampling.diagnostics import effective_sample_size, potential_scale_reduction
from cola_jax.sampling.metrics import accuracy, expected_calibration_error, negative_log_likelihood
from cola_jax.sampling.predictive import posterior_predictive
from cola_jax.sampling.samplers import (
  OverdampedSamplerState,
  SamplingAlgorithm,
  UnderdampedSamplerState,
  overdamped,
  underdamped,
)

__all__ = [
  "Chain",
  "OverdampedSamplerState",
  "SamplingAlgorithm",
  "UnderdampedSamplerState",
  "accuracy",
  "effective_sample_size",
  "expected_calibration_error",
  "negative_log_likelihood",
  "overdamped",
  "posterior_predictive",
  "potential_scale_reduction",
  "sample_chain",
  "sample_chains",
  "underdamped",
]
