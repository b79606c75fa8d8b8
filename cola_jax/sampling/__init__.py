"""Sampling on the manifold: constrained SG-MCMC samplers in blackjax's shape."""

from cola_jax.sampling.samplers import (
  OverdampedSamplerState,
  SamplingAlgorithm,
  UnderdampedSamplerState,
  overdamped,
  underdamped,
)

__all__ = [
  "OverdampedSamplerState",
  "SamplingAlgorithm",
  "UnderdampedSamplerState",
  "overdamped",
  "underdamped",
]
