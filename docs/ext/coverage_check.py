"""Fails the build when a name in ``cola_jax.__all__`` has no entry (``cola_jax.NAME``) in the API reference."""

import importlib

from sphinx.errors import ExtensionError

PACKAGE = "cola_jax"


def missing_entries(package, documented) -> list[str]:
  """The public names of ``package`` whose ``PACKAGE.NAME`` is not among the ``documented`` Python objects."""
  return [name for name in sorted(package.__all__) if f"{package.__name__}.{name}" not in documented]


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
