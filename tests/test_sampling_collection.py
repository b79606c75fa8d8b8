r"""cola_jax.sampling's chain collection (sample_chain, sample_chains) with blackjax's sgld and hand-written steps.

The statistical tests sample the tempered posterior of a Gaussian mean: data ``y_1..N ~ N(theta, 1)``, prior
``theta ~ N(0, s^2)``. Its precision is ``lambda = 1 / s^2 + N`` and its mean ``sum(y) / lambda``; at temperature
``T`` the law is Gaussian with variance ``T / lambda``. SGLD with the full batch is Euler-Maruyama for the OU
process, an AR(1) chain ``theta' - m = phi (theta - m) + sqrt(2 T h) R``, ``phi = 1 - h lambda``, whose stationary
variance is exactly ``T / (lambda (1 - h lambda / 2))`` (its bias, in closed form); stored every ``k`` steps, the
samples are AR(1) with coefficient ``phi**k``, so their ESS is ``M n (1 - phi**k) / (1 + phi**k)``.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cola_jax import sampling

blackjax = pytest.importorskip("blackjax")

PRIOR_SCALE, DATA_SIZE = 2.0, 20
DATA = 1.5 + jax.random.normal(jax.random.key(7), (DATA_SIZE,))
PRECISION = 1 / PRIOR_SCALE**2 + DATA_SIZE
MEAN = float(jnp.sum(DATA) / PRECISION)


def grad_estimator():
  logprior = lambda theta: -0.5 * theta**2 / PRIOR_SCALE**2
  loglikelihood = lambda theta, y: -0.5 * (y - theta) ** 2
  return blackjax.sgmcmc.gradients.grad_estimator(logprior, loglikelihood, DATA_SIZE)


def sgld():
  return blackjax.sgld(grad_estimator())


def discrete_variance(temperature, step_size):
  return temperature / (PRECISION * (1 - step_size * PRECISION / 2))


def sample_gaussian(temperature, num_chains, num_samples, thinning, step_size, seed=0):
  algorithm = sgld()
  starts = jax.vmap(algorithm.init)(jnp.linspace(-3.0, 3.0, num_chains))
  keys = jax.random.split(jax.random.key(seed), num_chains)
  run = jax.jit(
    lambda states, keys: sampling.sample_chains(
      algorithm.step,
      states,
      keys,
      DATA,
      num_samples=num_samples,
      step_size=step_size,
      temperature=temperature,
      num_burnin=500,
      thinning=thinning,
    )
  )
  return run(starts, keys).samples


def check_tempered_gaussian(temperature, num_chains, num_samples, thinning, step_size, tolerance):
  samples = sample_gaussian(temperature, num_chains, num_samples, thinning, step_size)
  assert samples.shape == (num_chains, num_samples)
  variance = discrete_variance(temperature, step_size)
  phi = (1 - step_size * PRECISION) ** thinning
  ess_expected = num_chains * num_samples * (1 - phi) / (1 + phi)
  # The mean's standard error is sqrt(variance / ESS), the variance's about variance * sqrt(2 / ESS).
  assert abs(float(jnp.mean(samples)) - MEAN) < 4 * np.sqrt(variance / ess_expected)
  assert float(jnp.var(samples)) == pytest.approx(variance, rel=tolerance)
  ess = float(sampling.effective_sample_size(samples))
  assert ess == pytest.approx(ess_expected, rel=0.15)
  assert abs(float(sampling.potential_scale_reduction(samples)) - 1) < 0.01


@pytest.mark.slow  # the quick law: tests/test_sampling.py runs blackjax sgld beside cola's sampler
def test_blackjax_sgld_samples_the_tempered_gaussian():
  check_tempered_gaussian(1.0, num_chains=32, num_samples=500, thinning=4, step_size=0.01, tolerance=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.1, 3.0])
def test_blackjax_sgld_samples_the_tempered_gaussian_long(temperature):
  check_tempered_gaussian(temperature, num_chains=64, num_samples=4000, thinning=4, step_size=0.01, tolerance=0.02)


@pytest.mark.extended  # the power of the slow test's tolerance; quick law: tests/test_sampling.py's sgld test
def test_the_discrete_variance_is_what_the_statistical_test_can_tell_apart():
  """The quick test's tolerance rejects the continuous law's variance T / lambda at a larger step (its bias)."""
  samples = sample_gaussian(1.0, num_chains=32, num_samples=500, thinning=4, step_size=0.03)
  assert float(jnp.var(samples)) == pytest.approx(discrete_variance(1.0, 0.03), rel=0.05)
  assert float(jnp.var(samples)) != pytest.approx(1 / PRECISION, rel=0.05)


def by_hand(step, state, key, batch_at, step_size_at, temperature_at, num_burnin, num_samples, thinning):
  """The chain sample_chain documents, one eager step at a time."""
  positions, i = [], 0
  for _ in range(num_burnin):
    state = step(jax.random.fold_in(key, i), state, batch_at(i), step_size_at(i), temperature_at(i))
    i += 1
  for _ in range(num_samples):
    for _ in range(thinning):
      state = step(jax.random.fold_in(key, i), state, batch_at(i), step_size_at(i), temperature_at(i))
      i += 1
    positions.append(state)
  return jnp.stack(positions), state


def minibatch_at(i):
  """A minibatch of 5 data points chosen by the step index, from the data the function closes over."""
  return jax.random.choice(jax.random.fold_in(jax.random.key(3), i), DATA, (5,), replace=False)


def test_the_chain_is_the_documented_loop_of_blackjax_sgld():
  """Step i uses fold_in(key, i), minibatch(i) and the schedules' values at i; burn-in and thinning as documented."""
  step = jax.jit(sgld().step)
  schedule = optax.exponential_decay(0.02, transition_steps=10, decay_rate=0.5)
  temperature = lambda i: 1.0 + 0.1 * i
  key = jax.random.key(11)
  chain = sampling.sample_chain(
    step,
    jnp.float32(0.5),
    key,
    minibatch_at,
    num_samples=6,
    step_size=schedule,
    temperature=temperature,
    num_burnin=7,
    thinning=3,
  )
  expected, last = by_hand(step, jnp.float32(0.5), key, minibatch_at, schedule, temperature, 7, 6, 3)
  np.testing.assert_allclose(chain.samples, expected, rtol=1e-6)
  np.testing.assert_allclose(chain.state, last, rtol=1e-6)
  assert int(chain.num_steps) == 7 + 6 * 3


class State(NamedTuple):
  position: jax.Array
  steps: jax.Array


class Info(NamedTuple):
  increment: jax.Array


def counting_step(key, state, batch, step_size, temperature):
  """A sampler's step of blackjax's other shape, (state, info), its state a NamedTuple with a position."""
  increment = step_size * batch + temperature * jax.random.uniform(key)
  return State(state.position + increment, state.steps + 1), Info(increment)


def test_a_step_returning_state_and_info_and_observables_of_the_position():
  key = jax.random.key(5)
  chain = sampling.sample_chain(
    counting_step,
    State(jnp.zeros(2), jnp.int32(0)),
    key,
    jnp.array([1.0, -1.0]),
    num_samples=4,
    step_size=0.5,
    temperature=0.0,
    num_burnin=2,
    thinning=2,
    observable=lambda x: {"sum": jnp.sum(x), "first": x[0]},
  )
  # temperature 0: the position moves by step_size * batch each step; samples after steps 4, 6, 8, 10.
  np.testing.assert_allclose(chain.samples["first"], 0.5 * jnp.array([4.0, 6.0, 8.0, 10.0]))
  np.testing.assert_allclose(chain.samples["sum"], jnp.zeros(4), atol=0)
  assert int(chain.state.steps) == 10 and int(chain.num_steps) == 10
  noisy = sampling.sample_chain(
    counting_step,
    State(jnp.zeros(2), jnp.int32(0)),
    key,
    jnp.zeros(2),
    num_samples=1,
    step_size=0.5,
    temperature=1.0,
    num_burnin=2,
  )
  uniforms = [jax.random.uniform(jax.random.fold_in(key, i)) for i in range(3)]
  np.testing.assert_allclose(noisy.samples, jnp.full((1, 2), sum(uniforms)), rtol=1e-6)


def run(num_burnin, num_samples, start=0, state=None, key=None, **kwargs):
  state = jnp.float32(2.0) if state is None else state
  key = jax.random.key(0) if key is None else key
  schedule = optax.linear_schedule(0.02, 0.005, transition_steps=40)
  return sampling.sample_chain(
    sgld().step,
    state,
    key,
    minibatch_at,
    num_samples=num_samples,
    step_size=schedule,
    temperature=1.0,
    num_burnin=num_burnin,
    thinning=3,
    start=start,
    **kwargs,
  )


@pytest.mark.extended  # quick: test_many_chains_by_sample_chains_and_by_vmap_are_the_single_chains resumes chains
def test_a_chain_resumed_from_its_returned_state_is_the_same_chain():
  whole = run(num_burnin=5, num_samples=12)
  first = run(num_burnin=5, num_samples=8)
  rest = run(num_burnin=0, num_samples=4, start=first.num_steps, state=first.state)
  np.testing.assert_array_equal(jnp.concatenate([first.samples, rest.samples]), whole.samples)
  np.testing.assert_array_equal(rest.state, whole.state)
  assert int(rest.num_steps) == int(whole.num_steps) == 5 + 12 * 3
  jitted = jax.jit(lambda state, start: run(num_burnin=0, num_samples=4, start=start, state=state))
  np.testing.assert_array_equal(jitted(first.state, first.num_steps).samples, rest.samples)


def test_one_seed_one_chain():
  a, b = run(3, 5, key=jax.random.key(1)), run(3, 5, key=jax.random.key(1))
  np.testing.assert_array_equal(a.samples, b.samples)
  c = run(3, 5, key=jax.random.key(2))
  assert not np.any(np.asarray(a.samples) == np.asarray(c.samples))


def test_many_chains_by_sample_chains_and_by_vmap_are_the_single_chains():
  algorithm = sgld()
  states = jax.vmap(algorithm.init)(jnp.array([-1.0, 0.0, 4.0]))
  keys = jax.random.split(jax.random.key(9), 3)
  options = dict(num_samples=5, step_size=0.01, num_burnin=4, thinning=2)
  chains = sampling.sample_chains(algorithm.step, states, keys, minibatch_at, **options)
  assert chains.samples.shape == (3, 5) and chains.num_steps.shape == ()
  vmapped = jax.vmap(lambda s, k: sampling.sample_chain(algorithm.step, s, k, minibatch_at, **options))(states, keys)
  np.testing.assert_array_equal(vmapped.samples, chains.samples)
  single = jax.jit(lambda s, k: sampling.sample_chain(algorithm.step, s, k, minibatch_at, **options).samples)
  for c in range(3):
    np.testing.assert_allclose(chains.samples[c], single(states[c], keys[c]), rtol=1e-6)
  more = sampling.sample_chains(
    algorithm.step, chains.state, keys, minibatch_at, **{**options, "num_burnin": 0}, start=chains.num_steps
  )
  whole = sampling.sample_chains(algorithm.step, states, keys, minibatch_at, **{**options, "num_samples": 10})
  np.testing.assert_allclose(jnp.concatenate([chains.samples, more.samples], axis=1), whole.samples, rtol=1e-6)


def memory(num_burnin, num_samples, thinning=1, observable=None):
  """The compiled chain's temporaries and outputs, in bytes, for a position of 1000 floats."""
  step = lambda key, x, batch, h, T: x - h * x + jnp.sqrt(2 * h * T) * jax.random.normal(key, x.shape)
  chain = lambda x, key: sampling.sample_chain(
    step,
    x,
    key,
    None,
    num_samples=num_samples,
    step_size=0.01,
    num_burnin=num_burnin,
    thinning=thinning,
    observable=observable,
  )
  analysis = jax.jit(chain).lower(jnp.zeros(1000), jax.random.key(0)).compile().memory_analysis()
  return analysis.temp_size_in_bytes, analysis.output_size_in_bytes


@pytest.mark.extended  # quick: test_many_chains_store_their_samples_in_place (the chain's memory is its samples)
def test_memory_is_what_is_stored_whatever_the_burn_in_and_thinning():
  temp, out = memory(num_burnin=10, num_samples=20, thinning=2)
  assert memory(num_burnin=20_000, num_samples=20, thinning=2) == (temp, out)
  assert memory(num_burnin=10, num_samples=20, thinning=500) == (temp, out)
  _, out_more = memory(num_burnin=10, num_samples=40, thinning=2)
  assert out_more - out == 20 * 1000 * 4  # 20 more positions of 1000 float32
  _, out_scalar = memory(num_burnin=10, num_samples=40, thinning=2, observable=jnp.sum)
  assert out_more - out_scalar == 40 * 999 * 4  # a scalar stored instead of each position


def test_many_chains_store_their_samples_in_place():
  """16 chains of 50 samples of 1000 numbers: the output is the samples (and the states), and the temporaries
  stay far below them (the samples are not stacked and then transposed to the chain-major layout, a copy)."""
  sampler = sampling.underdamped(lambda q, batch: -q, friction=1.0)
  states = jax.vmap(sampler.init)(jnp.zeros((16, 1000)))
  chains = lambda s, k: sampling.sample_chains(
    sampler.step, s, k, None, num_samples=50, num_burnin=10, thinning=2, step_size=0.1
  )
  analysis = jax.jit(chains).lower(states, jax.random.split(jax.random.key(0), 16)).compile().memory_analysis()
  samples_bytes = 16 * 50 * 1000 * 4
  assert samples_bytes <= analysis.output_size_in_bytes < samples_bytes + 16 * 3 * 1000 * 4 + 1024
  assert analysis.temp_size_in_bytes < samples_bytes / 4


def test_the_progress_bar_changes_no_result_and_counts_every_step(capsys):
  pytest.importorskip("tqdm")
  plain = jax.jit(lambda: run(num_burnin=5, num_samples=40))()
  with_bar = jax.jit(lambda: run(num_burnin=5, num_samples=40, progress_bar=True))
  chain = with_bar()
  jax.effects_barrier()
  np.testing.assert_array_equal(chain.samples, plain.samples)
  err = capsys.readouterr().err
  assert err.count("| 0/125 ") == 1 and "| 125/125 " in err  # 5 + 40 * 3 steps
  with_bar()  # the same compiled program, run again: a bar of its own
  jax.effects_barrier()
  err = capsys.readouterr().err
  assert err.count("| 0/125 ") == 1 and "| 125/125 " in err


@pytest.mark.extended  # quick: test_the_progress_bar_changes_no_result_and_counts_every_step
def test_one_progress_bar_for_many_chains(capsys):
  pytest.importorskip("tqdm")
  algorithm = sgld()
  states = jax.vmap(algorithm.init)(jnp.zeros(4))
  keys = jax.random.split(jax.random.key(0), 4)
  options = dict(num_samples=30, step_size=0.01, num_burnin=10)
  chains = sampling.sample_chains(algorithm.step, states, keys, DATA, progress_bar=True, **options)
  jax.effects_barrier()
  err = capsys.readouterr().err
  assert err.count("| 0/40 ") == 1 and "| 40/40 " in err  # one bar, not one per chain
  np.testing.assert_array_equal(
    chains.samples, sampling.sample_chains(algorithm.step, states, keys, DATA, **options).samples
  )


@pytest.mark.parametrize(
  ("kwargs", "error", "message"),
  [
    (dict(num_samples=0), ValueError, "sample_chain: num_samples must be an integer >= 1, got 0"),
    (dict(num_samples=2.5), TypeError, "sample_chain: num_samples must be an integer, got 2.5"),
    (dict(num_burnin=-1), ValueError, "sample_chain: num_burnin must be an integer >= 0, got -1"),
    (dict(thinning=0), ValueError, "sample_chain: thinning must be an integer >= 1, got 0"),
    (dict(step_size=-0.1), ValueError, "sample_chain: step_size must be positive and finite, got -0.1"),
    (dict(step_size=float("nan")), ValueError, "sample_chain: step_size must be positive and finite"),
    (dict(temperature=-1.0), ValueError, "sample_chain: temperature must be non-negative and finite, got -1.0"),
    (dict(temperature=float("inf")), ValueError, "sample_chain: temperature must be non-negative and finite"),
    (dict(observable="x"), TypeError, "sample_chain: observable must be None .* or a function"),
    (dict(start=-3), ValueError, "sample_chain: start must be >= 0, got -3"),
    (dict(start=1.5), TypeError, r"sample_chain: start must be an integer scalar \(a chain's num_steps\), got 1.5"),
    (dict(start=jnp.zeros(2, jnp.int32)), TypeError, "sample_chain: start must be an integer scalar"),
  ],
)
def test_bad_arguments_are_named(kwargs, error, message):
  options = {"num_samples": 2, "step_size": 0.01, **kwargs}
  with pytest.raises(error, match=message):
    sampling.sample_chain(sgld().step, jnp.float32(0.0), jax.random.key(0), DATA, **options)


def test_a_step_that_does_not_return_the_state_is_named():
  bad = lambda key, x, batch, h, T: (x, x, x)
  with pytest.raises(TypeError, match=r"sample_chain: step must return the state .* or \(state, info\)"):
    sampling.sample_chain(bad, jnp.float32(0.0), jax.random.key(0), None, num_samples=2, step_size=0.1)
  with pytest.raises(TypeError, match="sample_chains: step must be a sampler's step function"):
    sampling.sample_chains(
      None, jnp.zeros(2), jax.random.split(jax.random.key(0), 2), None, num_samples=2, step_size=0.1
    )
