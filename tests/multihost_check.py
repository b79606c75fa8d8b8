"""Noisy CoLA on two processes x 2 CPU devices, against one process x 4 devices.

Not a test module: ``tests/test_multihost.py`` starts it, because the number of
CPU devices and the distributed runtime are fixed when JAX initialises. Modes::

    python tests/multihost_check.py worker PROCESS_ID PORT OUT [method ...]   # ids 0 and 1, at once
    python tests/multihost_check.py single OUT [method ...]

A worker joins the two-process runtime (``jax.distributed.initialize`` with the
coordinator on ``127.0.0.1:PORT``, gloo CPU collectives), builds the problem
of ``tests/sharding_check.py`` on a 2 x 2 mesh ``("data", "model")`` (batch
split along ``data``, kernels' rows along ``model``, biases replicated) and
for each method trains ``STOP`` steps at temperature ``TAU``, writes the
parameters and optimizer state with orbax into ``OUT/<method>/checkpoint``
(both processes write their shards), trains on to ``TOTAL`` and writes the
whole result, gathered to the host, to ``OUT/<method>/process<ID>.npz``.

``single`` makes the same mesh of 4 devices in one process, trains ``TOTAL``
steps uninterrupted (``uninterrupted.npz``), then restores the two processes'
checkpoint onto its mesh and trains from ``STOP`` to ``TOTAL``
(``resumed.npz``). The arrays are named by their tree paths; PRNG keys are
written as their key data.
"""

import os
import pathlib
import sys

_MODE = sys.argv[1]
_DEVICES = 2 if _MODE == "worker" else 4
# The inherited flags (the test suite's compiler level) and this mode's device count.
_COUNT = "--xla_force_host_platform_device_count"
_FLAGS = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if not flag.startswith(_COUNT)]
os.environ["XLA_FLAGS"] = " ".join([*_FLAGS, f"{_COUNT}={_DEVICES}"])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharding_check import METHODS, init_at, make_step, problem  # noqa: E402  (this folder is on sys.path)

STOP, TOTAL = 3, 6
TAU = 1e-4
KEY = 42  # every process builds the same key: each draws the noise of its own shards from it
TIMEOUT_S = 60


def mesh_and_problem():
  """The 2 x 2 mesh, and the problem's parameters, data and gradient shardings on it."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
  params, x, y = problem()
  shardings = {name: {"w": NamedSharding(mesh, P("model", None)), "b": NamedSharding(mesh, P())} for name in params}
  batch = NamedSharding(mesh, P("data", None))
  # From host values that every process computes alike: each device takes its shard.
  params = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a), s), params, shardings)
  x, y = (jax.device_put(np.asarray(a), batch) for a in (x, y))
  return mesh, params, x, y, shardings


def train(step, params, state, x, y, start, stop):
  for _ in range(start, stop):
    params, state = jax.block_until_ready(step(params, state, x, y))
  return params, state


def save_result(path: pathlib.Path, params, state) -> None:
  """Every leaf as a whole host array (gathered from all processes), named by its path."""
  tree = {"params": params, "opt_state": state}
  is_key = lambda a: jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
  tree = jax.tree.map(lambda a: jax.random.key_data(a) if is_key(a) else a, tree)
  gathered = multihost_utils.process_allgather(tree, tiled=True)
  flat = jax.tree_util.tree_flatten_with_path(gathered)[0]
  path.parent.mkdir(parents=True, exist_ok=True)
  np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})


def worker(process_id: int, port: int, out: pathlib.Path, methods) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    # A process that dies or never comes is an error within a minute, not a hang.
    initialization_timeout=TIMEOUT_S,
    heartbeat_timeout_seconds=TIMEOUT_S,
    shutdown_timeout_seconds=TIMEOUT_S,
  )
  assert (jax.process_count(), jax.local_device_count(), jax.device_count()) == (2, 2, 4)
  mesh, params, x, y, shardings = mesh_and_problem()
  for method in methods:
    tx = METHODS[method](jax.random.key(KEY))
    step = make_step(tx, shardings)
    stopped = train(step, params, init_at(tx, params, TAU, mesh), x, y, 0, STOP)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / method / "checkpoint", {"params": stopped[0], "opt_state": stopped[1]})
    checkpointer.wait_until_finished()
    checkpointer.close()
    save_result(out / method / f"process{process_id}.npz", *train(step, *stopped, x, y, STOP, TOTAL))
  jax.distributed.shutdown()


def single(out: pathlib.Path, methods) -> None:
  assert (jax.process_count(), jax.device_count()) == (1, 4)
  mesh, params, x, y, shardings = mesh_and_problem()
  for method in methods:
    tx = METHODS[method](jax.random.key(KEY))
    step = make_step(tx, shardings)
    initial = init_at(tx, params, TAU, mesh)
    save_result(out / method / "uninterrupted.npz", *train(step, params, initial, x, y, 0, TOTAL))
    like = {"params": params, "opt_state": initial}
    checkpointer = ocp.StandardCheckpointer()
    restored = checkpointer.restore(out / method / "checkpoint", jax.tree.map(ocp.utils.to_shape_dtype_struct, like))
    checkpointer.close()
    resumed = train(step, restored["params"], restored["opt_state"], x, y, STOP, TOTAL)
    save_result(out / method / "resumed.npz", *resumed)


if __name__ == "__main__":
  if _MODE == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]), sys.argv[5:] or list(METHODS))
  else:
    single(pathlib.Path(sys.argv[2]), sys.argv[3:] or list(METHODS))
