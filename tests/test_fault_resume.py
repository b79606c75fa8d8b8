"""A training run killed hard (SIGKILL) mid-run and resumed from its last orbax
checkpoint ends bit-identical to the run that was never interrupted.

The run (``tests/fault_run.py``) is noisy CoLA (``cola_ud`` at temperature > 0,
circle and orthogonal leaves) and saves asynchronously every few steps, so the
kill may land in a step or in the middle of writing a checkpoint; the resumed
process must find the last complete checkpoint and continue from it with the
same PRNG key, slacks and momenta. The processes share a persistent
compilation cache (as a cluster's restarted jobs would), so that only the first
compiles the step.
"""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.integration  # processes of their own

pytest.importorskip("orbax.checkpoint")

WORKER = pathlib.Path(__file__).with_name("fault_run.py")
TIMEOUT = 240  # seconds for one subprocess on a busy machine


def load_worker():
  spec = importlib.util.spec_from_file_location("fault_run", WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def worker(directory, cache, *args):
  repo = str(WORKER.parents[1])
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    "JAX_COMPILATION_CACHE_DIR": str(cache),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  return subprocess.Popen(
    [sys.executable, str(WORKER), str(directory), *args],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def assert_trees_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(x) == jax.random.key_impl(y)
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def finish(process):
  out, err = process.communicate(timeout=TIMEOUT)
  assert process.returncode == 0, err
  return [int(step) for step in out.split()]


def test_run_killed_mid_training_resumes_bit_identical(tmp_path):
  run = load_worker()
  directory, cache = tmp_path / "run", tmp_path / "compilation_cache"

  # Killed once two checkpoints have been started: the save at step EVERY is
  # then complete (orbax finishes one save before it starts the next).
  killed = worker(directory, cache)
  watchdog = threading.Timer(TIMEOUT, killed.kill)
  watchdog.start()
  kill_after = 2 * run.EVERY + 1
  reached = 0
  for line in killed.stdout:
    reached = int(line)
    if reached >= kill_after:
      killed.send_signal(signal.SIGKILL)
      break
  watchdog.cancel()
  assert killed.wait() == -signal.SIGKILL and reached >= kill_after, killed.stderr.read()
  killed.stdout.close()
  killed.stderr.close()

  last, _ = run.restore(directory)
  assert last >= run.EVERY
  until = last + run.EVERY + 2  # the resumed run saves at least once more, then at the end
  resumed_steps = finish(worker(directory, cache, "--until", str(until)))
  assert resumed_steps == list(range(last + 1, until + 1))  # from the checkpoint, not from the start
  finish(worker(tmp_path / "uninterrupted", cache, "--until", str(until)))

  step, resumed = run.restore(directory)
  assert step == until
  _, uninterrupted = run.restore(tmp_path / "uninterrupted", until)
  assert_trees_identical(resumed, uninterrupted)
  state = uninterrupted["opt_state"]
  assert int(state.count) == until
  assert float(jnp.max(jnp.abs(state.momentum["layer1"]["w"]))) > 0
  assert not np.array_equal(jax.random.key_data(state.key), jax.random.key_data(jax.random.key(1)))
  assert int(uninterrupted["opt_state"].count) == until
  assert float(jnp.max(jnp.abs(uninterrupted["opt_state"].momentum["layer1"]["w"]))) > 0
