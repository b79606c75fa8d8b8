"""Every docstring example in cola_jax runs under doctest and prints what it shows."""

import doctest
import importlib
import io
import pkgutil

import pytest

import cola_jax

MODULES = sorted(m.name for m in pkgutil.walk_packages(cola_jax.__path__, "cola_jax."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report = io.StringIO()
  for test in finder.find(module, name, globs={}):  # the module's own objects only
    runner.run(test, out=report.write)
  assert runner.failures == 0, report.getvalue()


def test_the_examples_are_found():
  """The public factories' examples are among those run (a finder that saw none would pass vacuously)."""
  finder = doctest.DocTestFinder(exclude_empty=True)
  names = {test.name for test in finder.find(cola_jax.transforms, "cola_jax.transforms")}
  assert {"cola_jax.transforms.cola_od", "cola_jax.transforms.cola_ud"} <= names
