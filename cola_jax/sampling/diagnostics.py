r"""Convergence diagnostics of scalar observables across chains: effective sample size and potential scale reduction.

Arrays follow blackjax's layout: chains along ``chain_axis`` (0), samples along ``sample_axis`` (1), any other
axes index independent scalar observables (each gets its own value). A pytree (what
:func:`cola_jax.sampling.sample_chains` stores) gets a diagnostic per leaf. With blackjax installed, its
``blackjax.diagnostics`` computes them; otherwise the same formulas, written here.

For ``M`` chains of ``N`` samples, with ``W`` the mean of the chains' variances (``ddof=1``) and ``B / N`` the
variance of their means (``ddof=1``), the pooled variance estimate is
``var+ = (N - 1) / N W + B / N``. The potential scale reduction (Gelman and Rubin) is

.. math::
  \hat{R} = \sqrt{\mathrm{var}^+ / W},

near 1 when the chains sample the same law. The effective sample size is

.. math::
  \mathrm{ESS} = \frac{M N}{\hat\tau}, \qquad \hat\tau = -1 + 2 \sum_{k=0}^{K} \hat P_k + \hat\rho_{2K+2},

with ``rho_t = 1 - (W - mean_c acov_c(t)) / var+`` the autocorrelation at lag ``t`` (each chain's
autocovariance with divisor ``N``, averaged over the chains), ``P_k = rho_{2k} + rho_{2k+1}`` made monotone
(Geyer's initial monotone sequence: ``P_k <- min(P_k, P_{k-1})``), ``K`` the last ``k`` before the first
``P_k <= 0``, and ``rho_{2K+2}`` counted when positive; ``tau`` is at least ``1 / log10(M N)``. A chain
that does not move has ESS 0; a NaN draw gives NaN.

References:
  Gelman and Rubin, *Inference from iterative simulation using multiple sequences*, Statistical Science, 1992.
  Geyer, *Practical Markov chain Monte Carlo*, Statistical Science, 1992.
  Stan Development Team, *Stan Reference Manual*, "Effective sample size".
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _blackjax_diagnostics():
  try:
    from blackjax import diagnostics
  except ImportError:
    return None
  return diagnostics


def _standard(x, chain_axis: int, sample_axis: int, owner: str, least_chains: int):
  """``x`` as (chains, samples, ...), checked."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    x = x.astype(jnp.result_type(float))
  if x.ndim < 2:
    raise ValueError(f"{owner}: samples must have a chain axis and a sample axis, got shape {x.shape}.")
  x = jnp.moveaxis(x, (chain_axis, sample_axis), (0, 1))
  if x.shape[0] < least_chains:
    raise ValueError(f"{owner}: needs at least {least_chains} chains (axis {chain_axis}), got shape {x.shape}.")
  if x.shape[1] < 2:
    raise ValueError(f"{owner}: needs at least 2 samples per chain (axis {sample_axis}), got shape {x.shape}.")
  return x


def _variances(x):
  """W (the chains' mean variance) and var+ (the pooled estimate), over axes (chains, samples)."""
  n = x.shape[1]
  within = jnp.mean(jnp.var(x, axis=1, ddof=1), axis=0)
  between_over_n = jnp.var(jnp.mean(x, axis=1), axis=0, ddof=1) if x.shape[0] > 1 else jnp.zeros_like(within)
  return within, (n - 1) / n * within + between_over_n


@jax.jit
def _rhat(x):
  within, pooled = _variances(x)
  return jnp.sqrt(pooled / within)


def _autocovariance(x):
  """Each chain's autocovariance at lags 0..N-1 (divisor N), averaged over the chains, by FFT: (N, ...)."""
  n = x.shape[1]
  centred = x - jnp.mean(x, axis=1, keepdims=True)
  size = 1 << int(np.ceil(np.log2(2 * n)))  # zero padding: no wrap-around
  spectrum = jnp.fft.rfft(centred, n=size, axis=1)
  acov = jnp.fft.irfft(spectrum * jnp.conj(spectrum), n=size, axis=1)[:, :n] / n
  return jnp.mean(acov, axis=0)


@jax.jit
def _ess(x):
  m, n = x.shape[:2]
  within, pooled = _variances(x)
  moves = jnp.any(x != x[:1, :1], axis=(0, 1)) & (within > 0)
  pooled = jnp.where(moves, pooled, 1.0)
  rho = 1.0 - (within - _autocovariance(x)) / pooled  # rho[0] = 1 - (W - (N-1)/N W) / var+, set to 1 below
  rho = rho.at[0].set(1.0)
  pairs = n // 2
  even, odd = rho[0 : 2 * pairs : 2], rho[1 : 2 * pairs : 2]
  initial = jnp.cumprod(even + odd > 0, axis=0).astype(bool)  # Geyer's initial positive sequence
  last = jnp.sum(initial, axis=0) - 1  # K
  monotone = jax.lax.cummin(jnp.where(initial, even + odd, jnp.inf), axis=0)
  summed = jnp.sum(jnp.where(initial, monotone, 0.0), axis=0)
  following = jnp.take_along_axis(even, jnp.minimum(last + 1, pairs - 1)[None], axis=0)[0]
  following = jnp.where((last + 1 < pairs) & (following > 0), following, 0.0)
  tau = jnp.maximum(-1.0 + 2.0 * summed + following, 1.0 / np.log10(m * n))
  ess = jnp.where(moves, m * n / tau, 0.0)
  return jnp.where(jnp.any(jnp.isnan(x), axis=(0, 1)), jnp.nan, ess)


def _per_leaf(samples, compute, owner, chain_axis, sample_axis, least_chains):
  return jax.tree.map(
    lambda x: compute(_standard(x, chain_axis, sample_axis, owner, least_chains)),
    samples,
  )


def effective_sample_size(samples: Any, chain_axis: int = 0, sample_axis: int = 1) -> Any:
  r"""The effective sample size of each scalar observable, over all chains.

  About ``num_chains * num_samples`` for independent draws, less for correlated ones (for an AR(1) chain of
  coefficient ``phi``, ``(1 - phi) / (1 + phi)`` times that). One chain is allowed.

  Args:
    samples: an array (or a pytree of arrays) with a chain axis and a sample axis; further axes are
      observables of their own.
    chain_axis: the axis of the chains.
    sample_axis: the axis of the samples.

  Returns:
    For each leaf, the ESS per observable (the chain and sample axes removed).

  Example:
    >>> import jax, cola_jax as cola
    >>> draws = jax.random.normal(jax.random.key(0), (4, 1000))  # 4 chains of independent draws
    >>> ess = cola.sampling.effective_sample_size(draws)
    >>> bool(3000 < ess < 5000)
    True
  """
  diagnostics = _blackjax_diagnostics()
  compute = _ess if diagnostics is None else lambda x: diagnostics.effective_sample_size(x, 0, 1)
  return _per_leaf(samples, compute, "effective_sample_size", chain_axis, sample_axis, 1)


def potential_scale_reduction(samples: Any, chain_axis: int = 0, sample_axis: int = 1) -> Any:
  r"""The potential scale reduction (Gelman and Rubin's R-hat) of each scalar observable across chains.

  About 1 when the chains sample one law; above 1 (1.1 is the usual alarm) when they have not mixed.

  Args:
    samples: an array (or a pytree of arrays) with a chain axis (at least 2 chains) and a sample axis; further
      axes are observables of their own.
    chain_axis: the axis of the chains.
    sample_axis: the axis of the samples.

  Returns:
    For each leaf, R-hat per observable (the chain and sample axes removed).

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> draws = jax.random.normal(jax.random.key(0), (4, 1000))
    >>> bool(abs(cola.sampling.potential_scale_reduction(draws) - 1) < 0.01)
    True
    >>> stuck = draws + jnp.arange(4.0)[:, None]  # each chain about its own mean
    >>> bool(cola.sampling.potential_scale_reduction(stuck) > 1.1)
    True
  """
  diagnostics = _blackjax_diagnostics()
  compute = _rhat if diagnostics is None else lambda x: diagnostics.potential_scale_reduction(x, 0, 1)
  return _per_leaf(samples, compute, "potential_scale_reduction", chain_axis, sample_axis, 2)
