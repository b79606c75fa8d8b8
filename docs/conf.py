"""Sphinx configuration: the cola_jax documentation site (MyST Markdown, notebooks with their committed outputs).

Build offline with ``python -m sphinx -W -b html docs docs/_build/html`` after ``pip install -e ".[docs]"``.
"""

import pathlib
import sys
import tomllib

DOCS = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "ext")]

import cola_jax  # noqa: E402

REPOSITORY = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]["urls"]["Repository"]

project = "cola_jax"
author = "The cola_jax developers"
copyright = "the cola_jax developers"
release = version = cola_jax.__version__

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx-mathjax-offline",  # MathJax served with the site (copied into _static/mathjax/), not from a CDN
  "sphinx.ext.viewcode",
  "api_reference",
  "coverage_check",
]

exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints", "ext"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
# The maths render with no network, the site opened from disk: MathJax 3 from the sphinx-mathjax-offline package
# (the docs extra), a path under _static/ (tests/test_docs.py checks it is not an address).
mathjax_path = "mathjax/tex-chtml.js"

# The notebooks are shown with the outputs committed in the repository (a full-size run each), never re-executed.
nb_execution_mode = "off"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
# Annotations as written (the modules that use them have ``from __future__ import annotations``), not optax's
# three-line union.
autodoc_type_aliases = {"optax.ScalarOrSchedule": "optax.ScalarOrSchedule"}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = f"cola_jax {release}"
html_theme_options = {
  "repository_url": REPOSITORY,
  "use_repository_button": True,
  "show_toc_level": 2,
}
html_static_path: list[str] = []
