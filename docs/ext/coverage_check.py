"""Fails the build when a name in ``cola_jax.__all__`` has no entry (``cola_jax.NAME``) in the API reference, or a
name in a public subpackage's ``__all__`` none (``cola_jax.sampling.NAME``)."""

import importlib
import types

from sphinx.errors import ExtensionError

PACKAGE = "cola_jax"


def missing_entries(package, documented) -> list[str]:
  """The public names of ``package`` (those of its public subpackages as ``sub.NAME``) whose full name
  (``PACKAGE.NAME``) is not among the ``documented`` Python objects."""
  missing = []
  for name in sorted(package.__all__):
    obj = getattr(package, name)
    if f"{package.__name__}.{name}" not in documented:
      missing.append(name)
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__") and hasattr(obj, "__all__"):
      missing += [f"{name}.{member}" for member in missing_entries(obj, documented)]
  return missing


def _check(app, env):
  missing = missing_entries(importlib.import_module(PACKAGE), env.get_domain("py").objects)
  if missing:
    raise ExtensionError(
      f"the API reference has no entry for {', '.join(f'{PACKAGE}.{n}' for n in missing)} "
      f"(names in {PACKAGE}.__all__): document them in the API reference."
    )


def setup(app):
  app.connect("env-check-consistency", _check)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
