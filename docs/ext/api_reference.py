"""The API reference, generated from ``cola_jax.__all__``: each public name its own entry (anchor ``cola_jax.NAME``).

A page holding the line ``{cola-api-reference}`` gets, in its place, one section per group of names (grouped by the
module that defines them), each a summary table followed by the autodoc entries. A name added to ``__all__`` appears
without editing the page; one from a module no group lists goes under "More".

A subpackage in ``__all__`` (``cola_jax.sampling``) is documented with its own public names: its section lists
``cola_jax.sampling.NAME`` for every name of the subpackage's ``__all__``, each its own entry.

The summary tables are autosummary's, except that a row lists every argument of its entry, the optional ones in
brackets (``c_cola_ud(learning_rate, *, friction, radius[, mask, ...])``): autosummary itself cuts a row's arguments
to some 50 characters (``c_cola_ud(learning_rate, *, ...[, ...])``).
"""

import importlib
import inspect
import types

MARKER = "{cola-api-reference}"
SUMMARY_DIRECTIVE = "cola-autosummary"
GROUPS = {  # section title -> the modules (prefixes of ``__module__``) whose public names it shows
  "The paper's methods": ("cola_jax.alias",),
  "Constrained Langevin transforms": ("cola_jax.transforms",),
  "Any optax optimizer on the manifold": ("cola_jax.constrained",),
  "Muon and the sphere": ("cola_jax.hyperspherical", "cola_jax.manifold_muon", "cola_jax.stiefel_direction"),
  "Constraints": ("cola_jax.constraints",),
  "Declaring constraints on the model": ("cola_jax.declared", "cola_jax.path_rules"),
  "Initialisation and diagnostics": ("cola_jax.initialization", "cola_jax.diagnostics"),
  "The Langevin steps": ("cola_jax.langevin",),
  "Checking a constraint": ("cola_jax.testing",),
  "Sampling the posterior": ("cola_jax.sampling",),
  "Guards for a constraint's own factorisations": ("cola_jax._platform",),
}
MORE = "More"
# Classes whose methods are part of what a user calls or implements; the others show their docstring only.
WITH_MEMBERS = {"Constraint"}


def _module_of(obj) -> str:
  return obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "") or ""


def grouped(package) -> dict[str, list[str]]:
  """The names of ``package.__all__`` by section, in ``GROUPS``'s order (then "More"), each sorted."""
  sections: dict[str, list[str]] = {title: [] for title in [*GROUPS, MORE]}
  for name in sorted(package.__all__):
    module = _module_of(getattr(package, name))
    title = next((t for t, prefixes in GROUPS.items() if module.startswith(prefixes)), MORE)
    sections[title].append(name)
  return {title: names for title, names in sections.items() if names}


def is_subpackage(obj) -> bool:
  """A package (not a plain module) with public names of its own, documented name by name."""
  return isinstance(obj, types.ModuleType) and hasattr(obj, "__path__") and hasattr(obj, "__all__")


def documented_names(package_name: str, name: str, obj) -> list[str]:
  """The full names an entry of ``__all__`` documents: its own, and for a subpackage each of its public names."""
  full = f"{package_name}.{name}"
  return [full, *(f"{full}.{member}" for member in sorted(obj.__all__))] if is_subpackage(obj) else [full]


def _entry(full: str, obj) -> str:
  if is_subpackage(obj):
    return f".. automodule:: {full}\n"
  if isinstance(obj, types.ModuleType):
    return f".. automodule:: {full}\n   :members:\n"
  if inspect.isclass(obj):
    members = "   :members:\n" if full.rsplit(".", 1)[-1] in WITH_MEMBERS else ""
    return f".. autoclass:: {full}\n{members}"
  return f".. autofunction:: {full}\n"


def reference(package_name: str = "cola_jax") -> str:
  """The MyST text of the API reference of ``package_name``'s ``__all__``."""
  package = importlib.import_module(package_name)
  parts = []
  for title, names in grouped(package).items():
    fulls = [full for n in names for full in documented_names(package_name, n, getattr(package, n))]
    table = "\n".join(f"   {full}" for full in fulls)
    entries = "\n".join(_entry(full, _resolve(full)) for full in fulls)
    parts.append(f"## {title}\n\n```{{eval-rst}}\n.. {SUMMARY_DIRECTIVE}::\n\n{table}\n\n{entries}```\n")
  return "\n".join(parts)


def _resolve(full: str):
  """The object a dotted name (``cola_jax.sampling.Chain``) names, by attribute from its top-level package."""
  first, *rest = full.split(".")
  obj = importlib.import_module(first)
  for attribute in rest:
    obj = getattr(obj, attribute)
  return obj


def arguments(obj) -> str:
  """``obj``'s arguments as a summary row shows them: every name, the optional ones in brackets; ``""`` for a module."""
  from sphinx.ext.autosummary import mangle_signature

  try:
    signature = inspect.signature(obj)
  except (TypeError, ValueError):  # a module, or an object without a signature
    return ""
  bare = signature.replace(
    parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
    return_annotation=signature.empty,
  )
  return mangle_signature(str(bare), max_chars=1_000_000)


def _summary_directive():
  """autosummary, its rows with every argument (:func:`arguments`) rather than the first 50 characters' worth."""
  from sphinx.ext.autosummary import Autosummary

  class AutosummaryWithArguments(Autosummary):
    def get_items(self, names):
      rows = []
      for display_name, signature, summary, real_name in super().get_items(names):
        if signature:  # None: no signatures wanted; "": a module
          signature = arguments(self.import_by_name(real_name, prefixes=[None])[1])
        rows.append((display_name, signature, summary, real_name))
      return rows

  return AutosummaryWithArguments


def _insert_reference(app, docname, source):
  if MARKER in source[0]:
    source[0] = source[0].replace(MARKER, reference())


def setup(app):
  app.setup_extension("sphinx.ext.autosummary")
  app.add_directive(SUMMARY_DIRECTIVE, _summary_directive())
  app.connect("source-read", _insert_reference)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
