"""Canaries: each XLA:CPU mechanism of ``cola_jax/_platform.py`` still buys what it exists for.

Each test compiles one program with the mechanism and without it (``_platform.plain``: the program an
accelerator gets), in this process, and compares compile time, step time or XLA's temporary bytes
(``tests/_canary.py``). On jax 0.10.2, where the numbers in docs/development.md were measured, a mechanism
that saves less than 10 % fails its canary (and should go); on another jax the canaries report their
measurements as skips. Run them with ``pytest -m canary``; they are not in the quick suite.

``one_matrix_at_a_time`` has no canary here: it is not a saving but the guard against a deadlock of
jaxlib's batched CPU LAPACK kernels, which tests/test_lapack_under_vmap.py checks is in place.
"""

import math

import _canary
import jax
import jax.numpy as jnp
import optax
import pytest

import cola_jax as cola
from cola_jax import _platform

pytestmark = [
  pytest.mark.canary,
  pytest.mark.skipif(jax.default_backend() != "cpu" or jax.device_count() != 1, reason="XLA:CPU, one device"),
]


@pytest.fixture(autouse=True)
def _users_compiler():
  _canary.require_users_compiler()


def _update_step(make, constraint, n=8, shape=(512, 512)):
  """``(step, args)``: one noisy update of ``n`` leaves of ``shape`` on ``constraint``, applied (no model)."""
  keys = jax.random.split(jax.random.key(0), n)
  params = cola.project_params({f"w{i}": 0.05 * jax.random.normal(k, shape) for i, k in enumerate(keys)}, constraint)
  tx = make(constraint)
  grads = jax.tree.map(lambda p: 0.1 * jnp.cos(p), params)

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  return step, (params, tx.init(params), grads)


def _noisy_ud(constraint):
  return cola.cola_ud(0.1, friction=1.0, constraints=constraint, temperature=1e-4, key=jax.random.key(1))


def _check_the_update_saves(mechanism, constraint, recorded, executables=3):
  """The noisy CoLA-ud update of 8 kernels 512 x 512 on ``constraint`` is faster with ``mechanism`` than without.

  Each side's least time over ``executables`` compilations: on a shared machine one executable may run
  twice as slow as another of the same program for all its calls (measured: 5.5 against 13.8 ms).
  """
  step, args = _update_step(_noisy_ud, constraint)
  pairs = []
  for _ in range(executables):
    with_it = jax.jit(lambda *a: step(*a)).lower(*args).compile()
    with _platform.plain(mechanism):
      without = jax.jit(lambda *a: step(*a)).lower(*args).compile()
    pairs.append(_canary.step_times(with_it, without, args, repetitions=31))
  with_it, without = (min(times) for times in zip(*pairs))
  _canary.check_saves(mechanism, "update ms", with_it * 1e3, without * 1e3, recorded)


def _compile_times(mechanism, step, args):
  with_it = _canary.compile_cpu_s(step, *args)
  with _platform.plain(mechanism):
    without = _canary.compile_cpu_s(step, *args)
  return with_it, without


def test_the_gated_exact_angle_makes_the_ball_step_faster():
  """``MaxNorm``'s great-circle step: sine and cosine in plain arithmetic, the exact reduction only when needed."""
  _check_the_update_saves("sincos", cola.MaxNorm(1.0), "CoLA-ud MaxNorm, 8 kernels 512 x 512: 599 against 761")


def test_sine_and_cosine_in_plain_arithmetic_make_the_circle_step_faster():
  """XLA:CPU evaluates ``jnp.sin`` and ``jnp.cos`` as two scalar-heavy expansions, once per consumer."""
  _check_the_update_saves(
    "sincos",
    cola.Circle(0.5),
    "CoLA-ud Circle, 8 kernels 512 x 512: 5.85 against 7.84 (25 to 41 % saved in six runs, AVX-512 and AVX2)",
  )


def test_computing_the_circle_pair_together_makes_the_step_faster():
  """Without it, each of the new weight's, slack's and momentum's loops recomputes the normalised pair."""
  _check_the_update_saves(
    "computed_together", cola.Circle(0.5), "CoLA-ud Circle, 8 kernels 512 x 512: 539 against 1031"
  )


def test_grouped_draws_compile_faster():
  """A deep network's same-shape kernels: one program of draws per group, not a hash compiled into each leaf."""
  step, args = _update_step(
    lambda c: cola.cola_od(0.01, constraints=c, temperature=1e-4, key=jax.random.key(1)),
    cola.MaxNorm(1.0),
    n=24,
    shape=(64, 64),
  )
  with_it, without = _compile_times("grouped_draws", step, args)
  _canary.check_saves(
    "grouped_draws",
    "compile CPU s",
    with_it,
    without,
    "CoLA-od MaxNorm, 24 kernels 64 x 64, noisy update: 2.74 against 7.56",
  )


# The update's wait for the gradient (``_platform.computed_after``) keeps the ``MaxNorm`` and ``UnitNorm``
# points out of the forward and backward passes of a transformer. Without the wait XLA:CPU computes every
# kernel's point (the ball's slack pair, the normalised units) before the forward pass and holds it through
# the backward pass: on the 12-block width-512 transformer of ``python -m benchmarks.cost.update_memory``
# CoLA-od's temporaries are 100.5 MB for ``MaxNorm`` and 92.6 MB for ``UnitNorm`` with the wait
# (``results/cost/update_memory.json``) against 231.0 and 162.9 MB before it
# (``results/cost/update_memory_before.json``). The model here is the smallest transformer found that shows
# it for both families and both dynamics (4 post-norm blocks of width 256, 4 heads, 32 tokens), noiseless.

DEPTH, WIDTH, HEADS, TOKENS = 4, 256, 4, 32


def _transformer():
  """(params, loss): ``DEPTH`` post-norm blocks (causal attention, a 4x-wide ReLU MLP), as benchmarks/cost's."""
  keys = iter(jax.random.split(jax.random.key(0), 4 * DEPTH))
  kernel = lambda rows, columns: 0.05 * jax.random.normal(next(keys), (rows, columns))
  d, c = WIDTH, WIDTH // HEADS
  params = {
    f"block_{i}": {
      "in_proj": kernel(d, 3 * d),
      "out_proj": kernel(d, d),
      "linear1": kernel(d, 4 * d),
      "linear2": kernel(4 * d, d),
      "scale1": jnp.ones(d),
      "scale2": jnp.ones(d),
    }
    for i in range(DEPTH)
  }
  x0 = jax.random.normal(jax.random.key(1), (TOKENS, d))
  causal = jnp.tril(jnp.ones((TOKENS, TOKENS), bool))

  def norm(x, scale):
    return scale * (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

  def loss(p):
    x = x0
    for i in range(DEPTH):
      b = p[f"block_{i}"]
      q, k, v = (y.reshape(TOKENS, HEADS, c) for y in jnp.split(x @ b["in_proj"], 3, axis=-1))
      scores = jnp.where(causal, jnp.einsum("qhc,khc->hqk", q, k) / math.sqrt(c), -jnp.inf)
      attended = jnp.einsum("hqk,khc->qhc", jax.nn.softmax(scores, -1), v).reshape(TOKENS, d)
      x = norm(x + attended @ b["out_proj"], b["scale1"])
      x = norm(x + jax.nn.relu(x @ b["linear1"]) @ b["linear2"], b["scale2"])
    return jnp.sum(x**2)

  return params, loss


_RECORDED = {  # MiB of temporaries with the wait against without, jax 0.10.2 (2 CPU cores)
  ("MaxNorm", "od"): "10.1 against 17.1",
  ("MaxNorm", "ud"): "14.9 against 29.3",
  ("UnitNorm", "od"): "7.7 against 12.2",
  ("UnitNorm", "ud"): "16.6 against 23.2",
}


@pytest.mark.parametrize("dynamics", ["od", "ud"])
@pytest.mark.parametrize("family", [cola.MaxNorm, cola.UnitNorm], ids=lambda f: f.__name__)
def test_the_wait_for_the_gradient_keeps_the_points_out_of_the_transformer_passes(family, dynamics):
  params, loss = _transformer()
  constraint = family(1.0)
  spec = jax.tree.map(lambda leaf: constraint if leaf.ndim == 2 else None, params)  # every kernel
  if dynamics == "od":
    tx = cola.cola_od(0.01, constraints=spec)
  else:
    tx = cola.cola_ud(0.1, friction=1.0, constraints=spec)

  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  args = (params, tx.init(params))
  with_it = _canary.temporaries(lambda *a: step(*a), *args, donate_argnums=(0, 1))
  with _platform.plain("computed_after"):
    without = _canary.temporaries(lambda *a: step(*a), *args, donate_argnums=(0, 1))
  recorded = _RECORDED[(family.__name__, dynamics)]
  _canary.check_saves("computed_after", "temporary MiB", with_it / 2**20, without / 2**20, recorded)


def test_the_written_out_hash_compiles_the_noisy_transformer_step_faster():
  """JAX's Threefry on CPU is a loop of passes over each draw, compiled into the program once per draw; written out,
  the draw fuses with its consumer. Measured on the noisy CoLA-ud step of the transformer above, every kernel on the
  circle."""
  params, loss = _transformer()
  spec = jax.tree.map(lambda leaf: cola.Circle(0.5) if leaf.ndim == 2 else None, params)
  tx = cola.cola_ud(0.1, friction=1.0, constraints=spec, temperature=1e-4, key=jax.random.key(3))

  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  with_it, without = _compile_times("threefry", step, (params, tx.init(params)))
  _canary.check_saves("threefry", "compile CPU s", with_it, without, "2.79 against 4.92")


def temporaries_in_leaves(dynamics: str, constraint, temperature: float) -> float:
  """XLA's temporary bytes of a jitted, donated training step of six 512 x 512 layers, in layers' bytes.

  At a batch of 2048 the forward activations dominate: the temporaries peak in the backward pass.
  """
  keys = jax.random.split(jax.random.key(0), 6)
  params = cola.project_params(
    {f"w{i}": 0.05 * jax.random.normal(k, (512, 512)) for i, k in enumerate(keys)}, constraint
  )
  x = jax.random.normal(jax.random.key(1), (2048, 512))

  def loss(p):
    h = x
    for i in range(6):
      h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h**2)

  noise = {"temperature": temperature, "key": jax.random.key(2)} if temperature > 0 else {}
  if dynamics == "od":
    tx = cola.cola_od(0.01, constraints=constraint, **noise)
  else:
    tx = cola.cola_ud(0.1, friction=1.0, constraints=constraint, **noise)

  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / (512 * 512 * 4)


@pytest.mark.parametrize(
  "dynamics, constraint, arrays_per_member",
  [
    pytest.param("od", cola.Circle(0.5), 2, id="circle-od"),
    pytest.param("ud", cola.UnitNorm(1.0), 1, id="unit_norm-ud"),
  ],
)
def test_the_groups_noise_is_drawn_after_the_gradients_not_held_through_the_backward_pass(
  dynamics, constraint, arrays_per_member
):
  # Drawn from the key alone, the whole group's noise (6 members' arrays) was drawn first and held. At most
  # two members' draws are alive at once (jax 0.10.2: 2.0 layers for both), and the keys (bytes). A bound
  # on buffer sizes: on another jax, reported.
  extra = temporaries_in_leaves(dynamics, constraint, 1e-4) - temporaries_in_leaves(dynamics, constraint, 0.0)
  if jax.__version__ != _canary.MEASURED_ON:
    pytest.skip(
      f"jax {jax.__version__}: the noise adds {extra:.2f} layers of temporaries (2.0 on {_canary.MEASURED_ON})"
    )
  assert extra < 2 * arrays_per_member + 0.01
