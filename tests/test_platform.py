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

import cola_jax as cola
from cola_jax import _platform

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
  return jax.export.export(jax.jit(step), platforms=[platform])(*shapes)


def _operations(exported) -> collections.Counter:
  ops = collections.Counter(re.findall(r"\b(?:stablehlo|chlo)\.[a-z_]+\b", exported.mlir_module()))
  for wrapper in ("stablehlo.case", "stablehlo.return", "stablehlo.constant"):
    del ops[wrapper]
  return ops


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_step_exports_for_an_accelerator_as_the_plain_program(method, platform):
  exported = _exported(METHODS[method], platform)
  assert exported.platforms == (platform,)
  with _platform.plain():
    plain = _exported(METHODS[method], platform)
  assert _operations(exported) == _operations(plain)


@pytest.mark.parametrize("method", ["c_cola_ud", "cola_od", "o_cola_od"])
def test_the_cpu_program_holds_the_cpu_mechanisms(method):
  # The comparison above can tell the programs apart: on CPU they differ.
  exported = _exported(METHODS[method], "cpu")
  with _platform.plain():
    plain = _exported(METHODS[method], "cpu")
  assert _operations(exported) != _operations(plain)


def test_plain_names_its_mechanisms():
  with pytest.raises(ValueError, match="unknown mechanisms"):
    with _platform.plain("stacking"):
      pass
