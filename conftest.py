"""Test-run defaults: notebooks execute at their small size (COLA_NOTEBOOK_SIZE), in the ``integration`` tier.

The tests compile far more than they run, so XLA's CPU backend is told to
skip LLVM's optimisation of the generated code (``XLA_FLAGS``
``--xla_backend_optimization_level=0``, unless ``XLA_FLAGS`` sets a level):
the compile-bound tests of the transforms, properties, axes and Implicit ran
in 135 s instead of 217 s on 2 cores, the long-running statistical ones
slower (test_splitting and MaxNorm's uniform law: 72 s instead of 41 s). XLA's
own optimisations of the program (fusion, layouts, algebraic simplification)
are unchanged. Set here, before anything imports JAX, so that
pytest's workers, notebook kernels and subprocesses inherit it.
"""

import os

import pytest

os.environ.setdefault("COLA_NOTEBOOK_SIZE", "small")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()


def pytest_collection_modifyitems(items):
  """The notebooks (nbmake's items) belong to the ``integration`` tier, as the tests of the docs do."""
  for item in items:
    if item.path.suffix == ".ipynb":
      item.add_marker(pytest.mark.integration)
