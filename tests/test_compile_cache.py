"""A CoLA step compiles once for many runs: JAX's persistent compilation cache across processes.

``tests/compile_cache_check.py`` compiles a noisy CoLA-ud step in a process of
its own with the cache at a folder. A second process with another seed must
load the first one's program (the seed is data in the optimizer state, and the
program may not depend on the process: Python's hash seed, object ids), and
that program must compute exactly what a fresh compile computes.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # processes of their own

CHECK = pathlib.Path(__file__).with_name("compile_cache_check.py")
HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
TIMEOUT_S = 300


def environment():
  root = str(CHECK.parent.parent)
  path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
  # Each process its own hash seed: the program must not depend on it.
  return dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="random")


def start(cache: pathlib.Path, seed: int) -> subprocess.Popen:
  command = [sys.executable, str(CHECK), str(cache), str(seed)]
  return subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(process: subprocess.Popen) -> dict:
  try:
    out, err = process.communicate(timeout=TIMEOUT_S)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  assert process.returncode == 0, err[-4000:]
  return json.loads(out.strip().splitlines()[-1])


def test_another_seed_in_another_process_loads_the_step_and_computes_what_a_fresh_compile_does(tmp_path):
  shared, fresh = tmp_path / "shared", tmp_path / "fresh"
  first, uncached = start(shared, 1), start(fresh, 2)
  first, uncached = result(first), result(uncached)
  again = result(start(shared, 2))

  assert first["cache_events"] == [MISS] and uncached["cache_events"] == [MISS]
  assert again["cache_events"] == [HIT]
  # The loaded program draws the new seed's noise, exactly as the program compiled afresh.
  assert again["digest"] == uncached["digest"]
  assert again["digest"] != first["digest"]
