"""The private numerical kernels' own contracts, which no public name shows as sharply.

Sine and cosine of every finite float32 angle (the ``sincos`` mechanism's
plain-arithmetic kernel and the exact reduction), the exact power-of-two
scaling behind every overflow-safe norm, the NaN-safe maximum, the pivoting
elimination of ``Implicit``'s small systems and manifold Muon's ADMM. This
file, ``tests/test_platform.py``, ``tests/test_platform_noise.py`` and the
canaries are the only tests that import private names
(checked below): a refactor of a kernel edits these alone.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cola_jax import _numerics as numerics
from cola_jax.constraints.implicit import _solve
from cola_jax.stiefel_direction import _admm, steepest_tangent_direction

F32_MAX = float(np.finfo(np.float32).max)


def _stiefel(rng, n, p):
  return np.linalg.qr(rng.normal(size=(n, p)))[0].astype(np.float32)


# --------------------------------------------------------------------------------------
# Sine and cosine of any float32 angle


@pytest.mark.extended  # quick: test_sincos_is_exact_for_every_finite_float32_angle
def test_sincos_matches_float64_to_float32_accuracy():
  x = jnp.linspace(-100.0, 100.0, 400_001, dtype=jnp.float32)
  sin, cos = numerics.sincos(x)
  x64 = np.asarray(x, np.float64)
  assert np.max(np.abs(np.asarray(sin, np.float64) - np.sin(x64))) <= 1.2e-7
  assert np.max(np.abs(np.asarray(cos, np.float64) - np.cos(x64))) <= 1.2e-7


def _all_exponents(n, seed=0):
  """Float32 angles with random bits, every exponent from subnormal to 3.4e38, both signs."""
  bits = np.random.default_rng(seed).integers(0, 0x7F800000, size=n, dtype=np.int64)
  x = bits.astype(np.uint32).view(np.float32)
  return np.concatenate([x, -x])


@pytest.mark.parametrize("fn", ["sincos", "with_sincos"])
def test_sincos_is_exact_for_every_finite_float32_angle(fn):
  special = np.float32([1e-30, 1e-7, 1.0, 8191.999, 8192.0, 1e7, 1e8, 1e20, 1e30, 3.4e38, F32_MAX])
  x = np.concatenate([_all_exponents(100_000), special, -special])
  if fn == "sincos":
    sin, cos = jax.jit(numerics.sincos)(x)
  else:
    sin, cos = jax.jit(lambda x: numerics.with_sincos(lambda sincos, x: sincos(x), x))(x)
  sin, cos = np.asarray(sin, np.float64), np.asarray(cos, np.float64)
  x64 = x.astype(np.float64)  # numpy's float64 sin and cos reduce exactly
  assert np.max(np.abs(sin - np.sin(x64))) <= 1.2e-7
  assert np.max(np.abs(cos - np.cos(x64))) <= 1.2e-7
  assert np.max(np.abs(sin * sin + cos * cos - 1)) <= 2.5e-7
  normal = (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) < 1e-3)  # relative accuracy
  np.testing.assert_allclose(sin[normal], np.sin(x64[normal]), rtol=1.2e-7)


def test_sincos_fast_is_a_rotation_for_every_finite_float32_angle():
  x = np.concatenate([_all_exponents(100_000), np.float32([8192.0, 1e20, 3.4e38, F32_MAX])])
  sin, cos = (np.asarray(v, np.float64) for v in jax.jit(numerics.sincos_fast)(x))
  assert np.max(np.abs(sin * sin + cos * cos - 1)) <= 2.5e-7
  sin, cos = jax.jit(numerics.sincos_fast)(np.float32([np.inf, -np.inf, np.nan]))
  assert np.all(np.isnan(sin)) and np.all(np.isnan(cos))


def test_the_circles_sin_cos_is_exact_below_2_to_the_13_and_a_rotation_above():
  """``sin_cos`` is what the ``Circle``'s A step turns by: on XLA:CPU :func:`sincos_fast`, elsewhere ``jnp``'s."""
  below = np.random.default_rng(1).uniform(-(2.0**13), 2.0**13, 100_000).astype(np.float32)
  sin, cos = (np.asarray(v, np.float64) for v in jax.jit(numerics.sin_cos)(below))
  x64 = below.astype(np.float64)
  assert np.max(np.abs(sin - np.sin(x64))) <= 1.2e-7
  assert np.max(np.abs(cos - np.cos(x64))) <= 1.2e-7
  above = np.float32([8192.5, 1e20, -3.4e38, F32_MAX])
  sin, cos = (np.asarray(v, np.float64) for v in jax.jit(numerics.sin_cos)(above))
  assert np.max(np.abs(sin * sin + cos * cos - 1)) <= 2.5e-7


def test_sincos_of_inf_and_nan_is_nan():
  sin, cos = jax.jit(numerics.sincos)(np.float32([np.inf, -np.inf, np.nan]))
  assert np.all(np.isnan(sin)) and np.all(np.isnan(cos))


@pytest.mark.extended  # quick: test_sincos_is_exact_for_every_finite_float32_angle[with_sincos]
def test_with_sincos_takes_the_fast_path_only_where_it_is_exact():
  small = np.float32([0.5, -3.0, 8191.0])
  fast = jax.jit(lambda x: numerics.with_sincos(lambda sincos, x: sincos(x), x))(small)
  np.testing.assert_array_equal(fast, numerics.sincos_fast(jnp.asarray(small)))
  large = np.float32([0.5, 1e20])
  exact = jax.jit(lambda x: numerics.with_sincos(lambda sincos, x: sincos(x), x))(large)
  np.testing.assert_allclose(exact[0], np.sin(large.astype(np.float64)), atol=1.2e-7)


@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float64, marks=pytest.mark.extended)])  # quick: float32
def test_power_of_two_scale_is_exact_and_brings_every_size_to_order_one(dtype):
  with jax.enable_x64(dtype == np.float64):
    info = np.finfo(dtype)
    rng = np.random.default_rng(0)
    m = np.ldexp(rng.uniform(1, 2, 2000), rng.integers(info.minexp, info.maxexp, 2000))
    m = np.concatenate([m, [info.tiny, info.max, 1.0]]).astype(dtype)
    scale = np.asarray(numerics.power_of_two_scale(jnp.asarray(m)))
    assert scale.dtype == dtype
    mantissa, _ = np.frexp(scale)
    np.testing.assert_array_equal(mantissa, 0.5)  # a power of two: the product is exact
    assert np.all((m * scale >= 1) & (m * scale < 4))
    special = np.asarray(numerics.power_of_two_scale(jnp.asarray([0.0, np.inf, np.nan], dtype)))
    assert np.isfinite(special[0]) and np.all(np.isnan(special[1:]))


# --------------------------------------------------------------------------------------
# The NaN-safe maximum


def test_xla_cpu_max_drops_nan_so_checks_use_max_abs():
  # Pins XLA:CPU's behaviour (jax 0.10): if this starts failing, jnp.max
  # propagates NaN again and numerics.max_abs's workaround is no longer needed there.
  mostly_nan = np.full((64, 64), np.nan, np.float32)
  mostly_nan[0, 0] = 1.0
  one_nan = np.ones((64, 64), np.float32)
  one_nan[3, 5] = np.nan
  if jax.default_backend() == "cpu":
    assert not np.isnan(float(jnp.max(mostly_nan)))
    assert float(jax.jit(jnp.max)(one_nan)) == 1.0
  assert np.isnan(float(jnp.sum(one_nan)))  # the Frobenius checks rely on sums propagating NaN
  for reduce in (numerics.max_abs, jax.jit(numerics.max_abs, static_argnames="axis")):
    assert float(reduce(mostly_nan)) == np.inf
    assert float(reduce(one_nan)) == np.inf
    assert not bool(reduce(one_nan) <= 1e30)
    np.testing.assert_array_equal(reduce(one_nan, axis=0)[4:7], [1.0, np.inf, 1.0])
    assert float(reduce(-np.full((3, 3), np.inf, np.float32))) == np.inf
  assert float(numerics.max_abs(np.array([[-3.0, 2.0]], np.float32))) == 3.0
  assert float(numerics.max_abs(np.zeros((0, 3), np.float32))) == 0.0


# --------------------------------------------------------------------------------------
# Small linear systems and the ADMM


@pytest.mark.parametrize(  # quick: the smallest system with pivots
  "m", [m if m == 2 else pytest.param(m, marks=pytest.mark.extended) for m in (1, 2, 5, 8)]
)
def test_small_systems_are_solved_with_pivoting(m):
  """The elimination used for up to 8 components per unit agrees with LAPACK, batch and pivots included."""
  a = np.asarray(jax.random.normal(jax.random.key(m), (5, 3, m, m)), np.float64)
  if m > 1:
    a[0, 0, 0, 0] = 0.0  # no solution without a row swap
    a[1, 2] = np.triu(a[1, 2])[::-1]  # every step needs a row swap
  b = np.asarray(jax.random.normal(jax.random.key(100 + m), (5, 3, m)), np.float64)
  expected = np.linalg.solve(a, b[..., None])[..., 0]
  got = jax.jit(lambda a, b: _solve(a, b, symmetric=False))(a.astype(np.float32), b.astype(np.float32))
  scale = np.linalg.cond(a)[..., None] * np.abs(expected).max(axis=-1, keepdims=True)
  assert np.all(np.abs(np.asarray(got) - expected) <= 2e-6 * m * scale)


@pytest.mark.extended  # quick: test_manifold_muon.py's brute-force maximiser, its square case (the closed form)
def test_square_closed_form_equals_the_iterative_solution():
  rng = np.random.default_rng(2)
  w, g = _stiefel(rng, 6, 6), rng.normal(size=(6, 6)).astype(np.float32)
  closed, info = steepest_tangent_direction(jnp.asarray(w), jnp.asarray(g))
  assert int(info.iterations) == 0
  # The same problem in the coordinates of the tall case with an empty complement: W^T G alone.
  coordinates = jnp.asarray(w.T @ g / np.linalg.norm(g))
  omega, iterations, gap, _ = _admm(coordinates, 6, 1e-6, 2000, jnp.zeros((6, 6)))
  assert int(iterations) > 0 and float(gap) <= 1e-6
  np.testing.assert_allclose(np.asarray(closed), w @ np.asarray(omega), atol=2e-5)
  assert np.abs(np.asarray(omega) + np.asarray(omega).T).max() < 1e-5  # skew: tangent


# --------------------------------------------------------------------------------------
# Where private names may appear

PRIVATE_IMPORT = re.compile(r"^\s*(from cola_jax[\w.]* import .*\b_[a-z]\w*|from cola_jax\._|import cola_jax\._)", re.M)
MAY_IMPORT_PRIVATE_NAMES = {"test_kernels.py", "test_platform.py", "test_platform_noise.py", "test_canaries.py"}


def test_only_the_platform_and_kernel_tests_import_private_names():
  tests = pathlib.Path(__file__).parent
  importing = {path.name for path in tests.glob("*.py") if PRIVATE_IMPORT.search(path.read_text())}
  assert importing <= MAY_IMPORT_PRIVATE_NAMES, sorted(importing - MAY_IMPORT_PRIVATE_NAMES)
  assert importing >= {"test_kernels.py", "test_platform.py"}  # the pattern still finds what it looks for
