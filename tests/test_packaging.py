"""The wheel and the sdist: what they contain and what their metadata says."""

import email
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

import cola_jax

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE = sorted(
  str(p.relative_to(ROOT)) for p in (ROOT / "cola_jax").rglob("*") if p.suffix == ".py" or p.name == "py.typed"
)


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
  """(wheel, sdist) built from a copy of the repository (the checkout gets no build/ or egg-info)."""
  pytest.importorskip("build")
  tmp = tmp_path_factory.mktemp("dist")
  source = tmp / "source"
  shutil.copytree(
    ROOT,
    source,
    ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"),
  )
  build = [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(tmp / "dist")]
  subprocess.run([*build, str(source)], check=True, capture_output=True)
  (wheel,), (sdist,) = (tmp / "dist").glob("*.whl"), (tmp / "dist").glob("*.tar.gz")
  return wheel, sdist


def test_wheel_holds_only_the_package(dists):
  with zipfile.ZipFile(dists[0]) as wheel:
    names = wheel.namelist()
    metadata = email.message_from_bytes(wheel.read(f"cola_jax-{cola_jax.__version__}.dist-info/METADATA"))
  info = f"cola_jax-{cola_jax.__version__}.dist-info/"
  assert sorted(n for n in names if not n.startswith(info)) == PACKAGE
  assert info + "licenses/LICENSE" in names
  assert metadata["Version"] == cola_jax.__version__
  assert metadata["License-Expression"] == "Apache-2.0"
  assert metadata.get_all("Project-URL") == [f"Repository, {PYPROJECT['project']['urls']['Repository']}"]


def test_sdist_holds_the_package_and_leaves_the_tests_out(dists):
  """The tests need the repository (benchmarks/, notebooks/, both conftest files): they run from a clone."""
  with tarfile.open(dists[1]) as sdist:
    names = [m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name and not m.isdir()]
  files = {n for n in names if not n.startswith("cola_jax.egg-info")}
  assert files == set(PACKAGE) | {"LICENSE", "MANIFEST.in", "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg"}


def test_license_is_the_apache_license():
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License\n                           Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
