"""Every docstring example in cola_jax runs under doctest, prints what it shows and does not warn; every public entry
has one."""

import doctest
import importlib
import inspect
import io
import pathlib
import pkgutil
import sys
import types

import pytest
from _said import cola_warnings

import cola_jax

pytestmark = pytest.mark.integration

MODULES = sorted(m.name for m in pkgutil.walk_packages(cola_jax.__path__, "cola_jax."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report = io.StringIO()
  with cola_warnings() as said:
    for test in finder.find(module, name, globs={}):  # the module's own objects only
      runner.run(test, out=report.write)
  assert runner.failures == 0, report.getvalue()
  assert not said, f"an example in {name} warns: {said[0].message}"


def test_the_examples_are_found():
  """The public factories' examples are among those run (a finder that saw none would pass vacuously)."""
  finder = doctest.DocTestFinder(exclude_empty=True)
  names = {test.name for test in finder.find(cola_jax.transforms, "cola_jax.transforms")}
  assert {"cola_jax.transforms.cola_od", "cola_jax.transforms.cola_ud"} <= names
  assert "cola_jax.sampling.chain" in MODULES  # the subpackages' modules too


def public_entries(package=cola_jax) -> dict[str, object]:
  """The functions and classes of ``package.__all__`` (states included), for a module it names
  (``cola_jax.langevin``) the public functions defined in that module, and for a subpackage
  (``cola_jax.sampling``) the entries of its own ``__all__``, by the name a user writes."""
  entries = {}
  for name in package.__all__:
    obj = getattr(package, name)
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__") and hasattr(obj, "__all__"):
      entries.update({f"{name}.{member}": value for member, value in public_entries(obj).items()})
    elif isinstance(obj, types.ModuleType):
      for member, value in vars(obj).items():
        if not member.startswith("_") and inspect.isfunction(value) and value.__module__ == obj.__name__:
          entries[f"{name}.{member}"] = value
    elif inspect.isfunction(obj) or inspect.isclass(obj):
      entries[name] = obj
  return entries


def runnable_examples(obj) -> list[doctest.Example]:
  """The examples of ``obj``'s own docstring that doctest runs (not ``# doctest: +SKIP``)."""
  examples = doctest.DocTestParser().get_examples(obj.__doc__ or "")
  return [example for example in examples if not example.options.get(doctest.SKIP)]


def test_every_public_entry_has_an_example_that_runs():
  """A function or class added to ``cola_jax.__all__`` comes with an example (run by the test above)."""
  entries = public_entries()
  assert {"cola_od", "OverdampedState", "Orthogonal", "langevin.oba_step", "sampling.sample_chain"} <= set(entries)
  assert [name for name, obj in entries.items() if not runnable_examples(obj)] == []


def test_an_entry_without_a_runnable_example_is_named(monkeypatch):
  def no_example():
    """Does something."""

  def skipped_example():
    """Does something.

    >>> skipped_example()  # doctest: +SKIP
    """

  monkeypatch.setattr(cola_jax, "no_example", no_example, raising=False)
  monkeypatch.setattr(cola_jax, "skipped_example", skipped_example, raising=False)
  monkeypatch.setattr(cola_jax, "__all__", [*cola_jax.__all__, "no_example", "skipped_example"])
  entries = public_entries()
  assert [name for name, obj in entries.items() if not runnable_examples(obj)] == ["no_example", "skipped_example"]


def test_the_api_summary_rows_show_every_argument():
  """docs/ext/api_reference.py: a summary row names every argument, not autosummary's first 50 characters."""
  pytest.importorskip("sphinx")
  docs_ext = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ext"
  sys.path.insert(0, str(docs_ext))
  try:
    api_reference = importlib.import_module("api_reference")
  finally:
    sys.path.remove(str(docs_ext))
  assert api_reference.arguments(cola_jax.c_cola_ud) == (
    "(learning_rate, *[, friction, momentum, radius, mask, constraints, temperature, key, splitting, "
    "accumulator_dtype, free])"
  )
  assert api_reference.arguments(cola_jax.MaxNorm) == "(radius[, axis])"
  assert api_reference.arguments(cola_jax.langevin) == ""
