"""Every method's step exports for CUDA and for TPU from this host, as the plain program.

The library's choices for XLA:CPU are taken by the platform a program is
compiled for (``cola_jax/_platform.py``), not by the backend of the process
that traces it: a step exported for an accelerator from a CPU host holds the
accelerator's (plain ``jnp`` and ``jax.random``) computation. The plain
program to compare with is the step traced with every CPU mechanism switched
off (``_platform.plain``, the one private name here: this file tests the
platform policy itself). Compared as the multiset of StableHLO operations:
what ``platform_dependent`` adds around the chosen branch (a ``case`` on the
platform index and its ``return``) and the constants, which jax may
duplicate across the branch's boundary, are left out, so that the check does
not depend on how jax wraps the branch.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended
from jax import export

import cola_jax as cola
from cola_jax import _noise, _platform, _step_noise

_KEY = jax.random.key(0)
_T = 1e-3


def _kernels(constraint):
  return cola.path_constraints([(r"kernel$", constraint)])


def _kernel_mask(params):
  return {layer: {name: name == "kernel" for name in leaves} for layer, leaves in params.items()}


# One step of every method, with noise where it has noise. Dense kernels of
# two shapes, a bias and a conv kernel: the grouped draws, the stacked
# LAPACK calls of a conv kernel and the free leaves all appear.
METHODS = {
  "cola_od": lambda: cola.cola_od(0.05, constraints=_kernels(cola.MaxNorm(1.0)), temperature=_T, key=_KEY),
  "cola_ud": lambda: cola.cola_ud(
    0.05, friction=1.0, constraints=_kernels(cola.UnitNorm(1.0)), temperature=_T, key=_KEY
  ),
  "c_cola_od": lambda: cola.c_cola_od(0.05, radius=0.5, mask=_kernel_mask, temperature=_T, key=_KEY),
  "c_cola_ud": lambda: cola.c_cola_ud(0.05, radius=0.5, friction=1.0, mask=_kernel_mask, temperature=_T, key=_KEY),
  "o_cola_od": lambda: cola.o_cola_od(0.05, mask=_kernel_mask, temperature=_T, key=_KEY),
  "o_cola_ud": lambda: cola.o_cola_ud(0.05, friction=1.0, mask=_kernel_mask, temperature=_T, key=_KEY),
  "constrained_adam": lambda: cola.constrained(
    optax.adam(1e-2), constraints=cola.orthogonal_constraints(mask=_kernel_mask)
  ),
  "manifold_muon": lambda: cola.manifold_muon(0.05, constraints=_kernels(cola.Orthogonal())),
  "hyperspherical_descent": lambda: cola.hyperspherical_descent(0.05, constraints=_kernels(cola.UnitNorm(1.0))),
}


def _params():
  q = np.linalg.qr(np.random.default_rng(0).normal(size=(16, 8)))[0].astype(np.float32)
  return {
    "dense_0": {"kernel": jnp.asarray(q), "bias": jnp.zeros(8)},
    "dense_1": {"kernel": jnp.asarray(q[:8, :4] * 0.5), "bias": jnp.zeros(4)},
    "conv": {"kernel": jnp.asarray(np.tile(q[:4, :4], (3, 3, 1, 1)) / 3)},
  }


def _exported(make, platform: str):
  tx = make()
  params = _params()
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state, params))
  return export.export(jax.jit(step), platforms=[platform])(*shapes)


def _operations(exported) -> collections.Counter:
  ops = collections.Counter(re.findall(r"\b(?:stablehlo|chlo)\.[a-z_]+\b", exported.mlir_module()))
  for wrapper in ("stablehlo.case", "stablehlo.return", "stablehlo.constant"):
    del ops[wrapper]
  return ops


@pytest.mark.parametrize(  # quick: o_cola_ud for cuda (noise, stacked LAPACK calls, free leaves), cola_ud for tpu
  ("method", "platform"),
  quick_or_extended(
    [(m, p) for p in ("cuda", "tpu") for m in sorted(METHODS)],
    {("o_cola_ud", "cuda"), ("cola_ud", "tpu")},
    ids=lambda m, p: f"{m}-{p}",
  ),
)
def test_every_step_exports_for_an_accelerator_as_the_plain_program(method, platform):
  exported = _exported(METHODS[method], platform)
  assert exported.platforms == (platform,)
  with _platform.plain():
    plain = _exported(METHODS[method], platform)
  assert _operations(exported) == _operations(plain)


@pytest.mark.parametrize(  # one suffices to show the comparison can fail; the others under slow
  "method", ["c_cola_ud", *(pytest.param(m, marks=pytest.mark.slow) for m in ("cola_od", "o_cola_od"))]
)
def test_the_cpu_program_holds_the_cpu_mechanisms(method):
  # The comparison above can tell the programs apart: on CPU they differ.
  exported = _exported(METHODS[method], "cpu")
  with _platform.plain():
    plain = _exported(METHODS[method], "cpu")
  assert _operations(exported) != _operations(plain)


def test_plain_names_its_mechanisms():
  with pytest.raises(ValueError, match="unknown mechanisms"), _platform.plain("stacking"):
    pass


# ----------------------------------------------------------------------------------------------
# Both branches compute the same values: the same numbers where a mechanism is a schedule.


def one_noisy_step(make, params):
  tx = make()
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  return updates, getattr(state, "momentum", None)


def implicit_zero_sum():
  return cola.Implicit(equality=lambda u: jnp.stack([jnp.sum(u), jnp.sum(u * u) - 1]), axis=0)


@pytest.mark.extended  # quick: test_step_noise.py's test_a_free_leaf_reads_the_draw_of_its_own_key, the hash test below
@pytest.mark.parametrize(
  "make, constraint",
  [
    pytest.param(
      lambda c: cola.cola_od(0.1, constraints=c, temperature=1e-2, key=jax.random.key(0)),
      cola.Circle(0.5),
      id="od",
      marks=pytest.mark.extended,
    ),
    pytest.param(
      lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, temperature=1e-2, key=jax.random.key(0)),
      cola.MaxNorm(1.0),
      id="ud-oba",
    ),
    pytest.param(
      lambda c: cola.cola_ud(
        0.1, friction=1.0, constraints=c, temperature=1e-2, key=jax.random.key(0), splitting="BAOAB"
      ),
      cola.Orthogonal(),
      id="ud-baoab",
      marks=pytest.mark.slow,  # the draws are the constraint's and splitting's business in neither case
    ),
    pytest.param(
      lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, temperature=1e-2, key=jax.random.key(0)),
      implicit_zero_sum(),
      id="ud-implicit",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_a_seed_gives_the_same_numbers_however_the_draws_are_compiled(make, constraint, monkeypatch):
  # One program per group, a pass per member, leaf by leaf, or as an accelerator's program draws them
  # (leaf by leaf with jax's Threefry primitive instead of the written-out hash): the same numbers.
  params = {f"w{i}": jax.random.normal(jax.random.key(i), (16, 8)) for i in range(3)}
  params = cola.project_params(params, constraint)
  grouped = one_noisy_step(lambda: make(constraint), params)
  monkeypatch.setattr(_step_noise, "_ONE_PASS_BYTES", 0)
  per_member = one_noisy_step(lambda: make(constraint), params)
  with _platform.plain("grouped_draws"):
    leaf_by_leaf = one_noisy_step(lambda: make(constraint), params)
  # The mechanisms of the draws (the others change where XLA fuses, and so its rounding).
  with _platform.plain("grouped_draws", "threefry"):
    accelerators = one_noisy_step(lambda: make(constraint), params)
  for other in (per_member, leaf_by_leaf, accelerators):
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(other)):
      np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("computed_together", [_platform.computed_together, _platform.computed_together_on_cpu])
def test_computed_together_returns_its_arguments(computed_together):
  x = jax.random.normal(jax.random.key(0), (3, 5))
  y = jnp.arange(15.0).reshape(3, 5) - 7
  n = jnp.arange(15, dtype=jnp.int32).reshape(3, 5)
  x = x.at[0, 0].set(-0.0)
  together = jax.jit(computed_together)(x, y, n)
  for a, b in zip(together, (x, y, n)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.signbit(np.asarray(together[0])[0, 0])  # -0 stays -0: x + (-0) is x exactly
  batched = jax.vmap(computed_together)(x, y)
  np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(y))
  # The identity's derivative, under grad and jvp.
  grad = jax.grad(lambda a: jnp.sum(computed_together(a, a * a)[1]))(x)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(2 * x), rtol=1e-6)
  _, tangent = jax.jvp(lambda a: computed_together(a)[0], (x,), (y,))
  np.testing.assert_array_equal(np.asarray(tangent), np.asarray(y))


SPECIAL = [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 2.0])
def test_computed_after_leaves_every_value_bit_for_bit(dtype, first):
  x = jnp.asarray(SPECIAL, dtype)
  grad = jnp.asarray([first, 1.0], dtype)
  y, count, key = jax.jit(_platform.computed_after_on_cpu)(grad, (x, jnp.int32(7), jax.random.key(5)))
  # XLA:CPU of jaxlib 0.7 flushes subnormal results of float arithmetic to zero (every operation does; later
  # releases keep them): the subnormals may come back as zeros of their sign, every other value bit for bit.
  x = np.asarray(x)
  subnormal = (x != 0) & (np.abs(x.astype(np.float64)) < float(jnp.finfo(dtype).tiny))
  flushed = np.where(subnormal, np.copysign(np.zeros_like(x), x), x)
  assert np.asarray(y).tobytes() in (x.tobytes(), flushed.tobytes())
  assert int(count) == 7
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(5)))


@pytest.mark.parametrize("shape", [(5,), (16, 8), (3, 4, 6)], ids=str)
def test_the_hash_gives_the_same_numbers_written_out_and_as_jaxs_primitive(shape):
  key = jax.random.key(7)
  draws = lambda k: (
    _noise.normal(k, shape, jnp.float32),
    _noise.normal_paired(k, shape, jnp.float32),
    *_noise.normal_pair(k, shape, jnp.float32),
    jax.random.key_data(_noise.fold_in(k, 3)),
  )
  written = jax.jit(draws)(key)
  with _platform.plain("threefry"):
    primitive = jax.jit(lambda k: draws(k))(key)
  for a, b in zip(written, primitive):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
