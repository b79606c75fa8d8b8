"""CoLA on many hosts: two processes with ``jax.distributed`` against one process.

Two processes of 2 CPU devices each join on the loopback address (gloo CPU
collectives) and train the problem of ``tests/sharding_check.py`` with noise
on a 2 x 2 mesh, in subprocesses that ``tests/multihost_check.py`` describes.
The quick suite checks that the two processes agree with each other (c-CoLA-ud);
with ``slow``, c-CoLA-ud, o-CoLA-od and o-CoLA-ud also equal one process with
4 devices bit for bit, and the orbax checkpoint the two processes wrote
restores into that process and continues identically.
"""

import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.integration  # processes of their own

pytest.importorskip("orbax.checkpoint")

CHECK = pathlib.Path(__file__).with_name("multihost_check.py")
TIMEOUT_S = 300  # for all the processes of a run; each also gives up on a lost peer within a minute
KEY = 42  # multihost_check.KEY


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def environment():
  # The project first on the path (as when pytest runs from the checkout), then this folder.
  root = str(CHECK.parent.parent)
  path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
  return dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1")


def run_processes(commands) -> None:
  """Runs ``commands`` at once; all are killed when ``TIMEOUT_S`` has passed."""
  processes = [
    subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for command in commands
  ]
  deadline = time.monotonic() + TIMEOUT_S
  try:
    outputs = [process.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for process in processes]
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  for process, output in zip(processes, outputs):
    assert process.returncode == 0, output[-4000:]


def two_processes(out: pathlib.Path, methods) -> None:
  port = str(free_port())
  run_processes([[sys.executable, str(CHECK), "worker", str(i), port, str(out), *methods] for i in (0, 1)])


def load(path: pathlib.Path) -> dict:
  with np.load(path) as arrays:
    return dict(arrays)


def assert_bitwise_equal(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def assert_noise_was_drawn(result: dict) -> None:
  # The key advanced (it is split once per noisy step) and the temperature is positive.
  initial = np.asarray(jax.random.key_data(jax.random.key(KEY)))
  assert not np.array_equal(result["['opt_state'].inner_state.key"], initial)
  assert result["['opt_state'].hyperparams['temperature']"] > 0


def test_two_processes_agree(tmp_path):
  two_processes(tmp_path, ["c_cola_ud"])
  first, second = (load(tmp_path / "c_cola_ud" / f"process{i}.npz") for i in (0, 1))
  assert_bitwise_equal(first, second)
  assert_noise_was_drawn(first)
  # Both processes wrote their shards of the checkpoint.
  checkpoint = tmp_path / "c_cola_ud" / "checkpoint"
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in checkpoint.iterdir()}


@pytest.mark.slow
def test_two_processes_equal_one_and_their_checkpoint_resumes_in_one(tmp_path):
  methods = ["c_cola_ud", "o_cola_od", "o_cola_ud"]
  two_processes(tmp_path, methods)
  run_processes([[sys.executable, str(CHECK), "single", str(tmp_path), *methods]])
  for method in methods:
    results = {name: load(tmp_path / method / f"{name}.npz") for name in ("process0", "uninterrupted", "resumed")}
    assert_noise_was_drawn(results["process0"])
    assert_bitwise_equal(results["process0"], load(tmp_path / method / "process1.npz"))
    # Two processes x 2 devices equal one process x 4 devices, noise included.
    assert_bitwise_equal(results["process0"], results["uninterrupted"])
    # Written by two processes, restored by one: it continues as they did.
    assert_bitwise_equal(results["process0"], results["resumed"])
