"""The notebooks' Colab set-up: the repository address, the Colab link, and what the install cell installs.

(The notebooks themselves run under nbmake, at COLA_NOTEBOOK_SIZE=small: see the root conftest.py.)
"""

import ast
import json
import pathlib
import re
import sys
import tomllib

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REPOSITORY = PROJECT["urls"]["Repository"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# cola-jax's own requirements, and the module each installable distribution provides.
CORE = {re.match(r"[\w-]+", r).group() for r in PROJECT["dependencies"]}
MODULE = {"scikit-learn": "sklearn"}
PIP_INSTALL = ["sys.executable", "'-m'", "'pip'", "'install'", "'-q'"]


def _code(path):
  cells = json.loads(path.read_text())["cells"]
  return [("".join(c["source"]), c["cell_type"]) for c in cells]


def _imported(sources):
  """Top-level modules the notebook imports, less the standard library and cola_jax; a notebook that imports the
  repository's benchmarks needs what they import, the ``benchmarks`` extra."""
  modules = set()
  for source in sources:
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, ast.Import):
        modules |= {alias.name.split(".")[0] for alias in node.names}
      elif isinstance(node, ast.ImportFrom):
        modules.add(node.module.split(".")[0])
  if "benchmarks" in modules:
    modules |= _requirements("benchmarks")
  return modules - set(sys.stdlib_module_names) - {"cola_jax", "benchmarks"}


def _requirements(extra):
  return {re.match(r"[\w-]+", r).group() for r in PROJECT["optional-dependencies"][extra]}


def _pip_install_arguments(install_cell):
  """The requirements of the cell's ``[sys.executable, "-m", "pip", "install", "-q", ...]`` call, as source text."""
  for node in ast.walk(ast.parse(install_cell)):
    if isinstance(node, ast.List) and [ast.unparse(e) for e in node.elts[:5]] == PIP_INSTALL:
      return [ast.unparse(e) for e in node.elts[5:]]
  raise AssertionError("no pip install call in the install cell")


def _installed(install_cell):
  """Modules the Colab install cell makes available: cola-jax's requirements, its extras, other packages named."""
  modules = set(CORE)
  for argument in _pip_install_arguments(install_cell):
    cola = re.fullmatch(
      r"'cola-jax(?:\[([\w,]+)\])? @ git\+' \+ REPO_URL|str\(REPO_ROOT\)(?: \+ '\[([\w,]+)\]')?", argument
    )
    if cola:
      for extra in (cola.group(1) or cola.group(2) or "").split(","):
        modules |= _requirements(extra) if extra else set()
    else:
      modules.add(re.fullmatch(r"'([\w-]+)'", argument).group(1))
  return {MODULE.get(m, m) for m in modules}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_colab_link_and_repository_address(path):
  cells = _code(path)
  link = f"https://colab.research.google.com/github/{REPOSITORY.removeprefix('https://github.com/')}/blob/main/notebooks/{path.name}"
  assert f"]({link})" in cells[0][0]
  install = cells[1][0]
  assert f'REPO_URL = "{REPOSITORY}"' in install
  assert all(REPOSITORY not in source for source, _ in cells[2:])  # the address in one place


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_install_cell_installs_exactly_what_the_notebook_imports(path):
  sources = [source for source, kind in _code(path) if kind == "code"]
  imported, installed = _imported(sources), _installed(sources[0])
  assert imported <= installed, f"imported but not installed in Colab: {imported - installed}"
  assert installed - CORE <= imported, f"installed but not imported: {installed - CORE - imported}"
