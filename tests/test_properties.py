"""Generated inputs: every method keeps shapes and dtypes and ends on the manifold, or says it did not.

For every constraint of the registry, both dynamics and both splittings,
hypothesis draws a leaf (zero-size, wide, tall, N-d kernels), a dtype
(float16, bfloat16, float32, float64), hyperparameters and gradients from
1e-30 to 1e30 (random signs, Gaussian, or rank one: a large tangential step
on a matrix manifold, where a projection may have no root), inf and NaN.
After two updates each leaf must keep its shape and dtype and be on its
manifold to the dtype's tolerance, or the step is flagged
(``ProjectionInfo.converged`` / ``ImplicitState.converged`` False), or a NaN
shows in the parameter or its residual.

Profiles: ``quick`` (few derandomized examples; compilation dominates, so
each method and constraint compiles once, for one tree with a leaf of every
kind and dtype, and hypothesis draws the values: hyperparameters are traced
arguments; the extended tier runs three of its cases, one per method, the slow
tier the others) and ``long`` (``pytest -m slow``: the leaves' shapes and
dtypes are drawn too).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended
from _constraints import CASES, VARIANTS, takes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cola_jax as cola

# The constraints under test: a free leaf and every case of the registry.
CONSTRAINTS = {"free": None, **{name: c for name, c, _ in CASES + VARIANTS}}


# Dynamics: name -> transform from (learning_rate, temperature, friction, constraint, key).
METHODS = {
  "cola_od": lambda h, tau, gamma, c, key: cola.cola_od(h, constraints=c, temperature=tau, key=key),
  "cola_ud_oba": lambda h, tau, gamma, c, key: cola.cola_ud(
    h, friction=gamma, constraints=c, temperature=tau, key=key, splitting="OBA"
  ),
  "cola_ud_baoab": lambda h, tau, gamma, c, key: cola.cola_ud(
    h, friction=gamma, constraints=c, temperature=tau, key=key, splitting="BAOAB"
  ),
}

SHAPES = [(), (5,), (0, 3), (3, 0), (1, 1), (6, 2), (2, 5), (4, 4), (2, 2, 3), (3, 3, 2, 4)]
# The quick profile's tree: tall, wide, N-d, square, zero-size and vector leaves.
QUICK_SHAPES = [(6, 2), (2, 5), (2, 2, 3), (3, 3), (0, 3), (5,)]
DTYPES = ["float32", "float16", "bfloat16", "float64"]
# Gradient scales, and the special values that may replace one entry.
SCALES = [1e-30, 1e-10, 1e-3, 0.3, 1.0, 3.0, 30.0, 1e3, 1e10, 1e19, 1e30]
# How the gradient's entries are drawn before scaling to a largest entry of 1.
PATTERNS = ["sign", "normal", "rank_one"]
SPECIALS = [None, 0.0, float("inf"), -float("inf"), float("nan")]

# Tolerance on the residual after an update, by parameter dtype: a leaf is
# stored in its own dtype, so its rounding (relative eps) bounds what the
# residual can show, a few times over.
TOLERANCE = {"float16": 8e-3, "bfloat16": 6e-2, "float32": 2e-5, "float64": 2e-5}

settings.register_profile(
  "quick",
  max_examples=10,
  derandomize=True,
  database=None,
  deadline=None,
  print_blob=True,
  suppress_health_check=[HealthCheck.too_slow],
)
# 50 random examples a case (a new draw each run), each compiling its own layout: the 77 cases are 91 min of
# test time (results/tests/slow_tier.json), so the slow tier runs this file apart with --dist load.
settings.register_profile(
  "long", max_examples=50, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)


def fixed_layout(constraint_name):
  """The quick shapes the constraint takes, the dtypes in turn: one compilation covers them all."""
  shapes = [s for s in QUICK_SHAPES if CONSTRAINTS[constraint_name] is None or takes(CONSTRAINTS[constraint_name], s)]
  return tuple((shape, DTYPES[i % len(DTYPES)]) for i, shape in enumerate(shapes))


def drawn_layouts(constraint_name):
  shapes = [s for s in SHAPES if CONSTRAINTS[constraint_name] is None or takes(CONSTRAINTS[constraint_name], s)]
  leaf = st.tuples(st.sampled_from(shapes), st.sampled_from(DTYPES))
  return st.lists(leaf, min_size=1, max_size=3).map(tuple)


@st.composite
def problems(draw, layouts):
  layout = draw(layouts)
  return dict(
    layout=layout,
    seed=draw(st.integers(0, 2**16)),
    scales=[draw(st.sampled_from(SCALES)) for _ in layout],
    patterns=[draw(st.sampled_from(PATTERNS)) for _ in layout],
    specials=[draw(st.sampled_from(SPECIALS)) for _ in layout],
    h=draw(st.sampled_from([1e-4, 1e-2, 0.1, 0.3, 1.0])),
    tau=draw(st.sampled_from([0.0, 1e-6, 1e-3, 1.0])),
    gamma=draw(st.sampled_from([0.0, 0.1, 1.0, 10.0])),
  )


# Bounded: each compiled step holds its XLA:CPU executable, whose JIT-compiled kernels take ~200-300 memory
# mappings; the long profile draws a new layout per example, and an unbounded cache reaches Linux's
# vm.max_map_count (65530) after ~300 compilations: LLVM then fails ("Cannot allocate memory") and the
# worker segfaults or aborts. The quick profile compiles one layout per case, which a small cache keeps.
@functools.lru_cache(maxsize=8)
def _compiled_steps(method, constraint_name, layout, x64):
  """Two updates as one compiled function of (params, grads, h, tau, gamma, key)."""
  del layout, x64  # part of the cache key: jit compiles per shape and dtype anyway
  constraint = CONSTRAINTS[constraint_name]

  def run(params, grads, h, tau, gamma, key):
    constraints = {name: (None if name == "b" else constraint) for name in params}
    tx = METHODS[method](h, tau, gamma, constraints, key)

    def step(carry, _):
      params, state = carry
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), (updates, state)

    # A scan compiles the update once for both steps.
    (params, state), (updates, states) = jax.lax.scan(step, (params, tx.init(params)), length=2)
    return params, updates, states, cola.constraint_residuals(params, state)

  return jax.jit(run)


def test_compiled_steps_are_not_all_kept():
  # The long profile compiles a new layout per example: kept, their executables' mappings crash the worker.
  assert _compiled_steps.cache_info().maxsize is not None


def _flagged(states, name) -> bool:
  converged = getattr(states.constraint_states[name], "converged", None)  # one per step
  return converged is not None and not bool(jnp.all(converged))


def _pattern(rng, pattern, shape):
  """Gradient entries with a largest magnitude of 1 (0 for no entries)."""
  if pattern == "sign":
    return np.sign(rng.standard_normal(shape))
  if pattern == "normal" or len(shape) < 2:
    g = rng.standard_normal(shape)
  else:
    g = np.multiply.outer(rng.standard_normal(shape[:-1]), rng.standard_normal(shape[-1]))
  return g / max(np.abs(g).max(initial=0.0), 1e-30)


def check_method(method, constraint_name, problem):
  rng = np.random.default_rng(problem["seed"])
  params, grads = {"b": jnp.zeros(3)}, {"b": jnp.ones(3)}
  drawn = zip(problem["layout"], problem["scales"], problem["patterns"], problem["specials"])
  for i, ((shape, dtype), scale, pattern, special) in enumerate(drawn):
    grad = _pattern(rng, pattern, shape) * scale
    if special is not None and grad.size:
      grad.flat[rng.integers(grad.size)] = special
    params[f"w{i}"] = jnp.asarray(0.3 * rng.standard_normal(shape), dtype)
    with np.errstate(over="ignore"):  # 1e30 is inf in float16: meant
      grads[f"w{i}"] = jnp.asarray(grad, dtype)
  step = _compiled_steps(method, constraint_name, problem["layout"], jax.config.jax_enable_x64)
  new, updates, states, residuals = step(
    params, grads, problem["h"], problem["tau"], problem["gamma"], jax.random.key(problem["seed"])
  )

  shapes = jax.tree.map(lambda p: (p.shape, p.dtype), params)
  assert jax.tree.map(lambda u: (u.shape[1:], u.dtype), updates) == shapes  # both steps' updates
  assert jax.tree.map(lambda p: (p.shape, p.dtype), new) == shapes
  for i, (shape, dtype) in enumerate(problem["layout"]):
    name, residual = f"w{i}", residuals[f"w{i}"]
    if residual is None:  # a free leaf, or one without entries
      continue
    visible_nan = not (bool(jnp.all(jnp.isfinite(new[name]))) and math.isfinite(float(residual)))
    on_manifold = float(residual) <= TOLERANCE[dtype]
    assert on_manifold or _flagged(states, name) or visible_nan, (
      f"{method} with {constraint_name}: residual {float(residual):.3g} after a silent step "
      f"(leaf {shape} {dtype}, h={problem['h']}, tau={problem['tau']}, gamma={problem['gamma']}, "
      f"|grad| = {problem['scales'][i]:.3g} ({problem['patterns'][i]}), special entry {problem['specials'][i]})"
    )


def _test(method, constraint_name, data, layouts):
  problem = data.draw(problems(layouts))
  with jax.enable_x64(any(dtype == "float64" for _, dtype in problem["layout"])):
    check_method(method, constraint_name, problem)


CASES = [pytest.param(m, c, id=f"{m}-{c}") for m in METHODS for c in CONSTRAINTS]
# The quick profile takes every constraint once, the methods in turn (compilation
# dominates); the extended tier keeps one case per method (Newton's iterations, a matrix manifold's
# projection, the spectral ball), the slow tier the others; the long profile takes every pair. Quick:
# tests/test_reliability.py (steps of any size flagged, planted NaNs shown) and the low-precision dtype tests.
QUICK_CASES = quick_or_extended(
  list(zip(list(METHODS) * len(CONSTRAINTS), CONSTRAINTS)),
  (),
  ids=lambda m, c: f"{m}-{c}",
  extended={
    ("cola_od", "implicit"),
    ("cola_ud_oba", "orthogonal_scaled_wide"),
    ("cola_ud_baoab", "max_spectral_norm"),
  },
)


@pytest.mark.parametrize("method, constraint_name", QUICK_CASES)
@settings(settings.get_profile("quick"))
@given(data=st.data())
def test_update_keeps_shapes_and_the_manifold_or_flags(method, constraint_name, data):
  _test(method, constraint_name, data, st.just(fixed_layout(constraint_name)))


@pytest.mark.slow
@pytest.mark.parametrize("method, constraint_name", CASES)
@settings(settings.get_profile("long"))
@given(data=st.data())
def test_update_keeps_shapes_and_the_manifold_or_flags_long(method, constraint_name, data):
  _test(method, constraint_name, data, drawn_layouts(constraint_name))
