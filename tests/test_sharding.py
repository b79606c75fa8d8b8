"""CoLA on many devices: 8 simulated CPU devices, data and model parallelism.

The checks run in a subprocess (``tests/sharding_check.py``): the number of
CPU devices is fixed when JAX initialises, which this pytest process has done
already. See that file for what is measured; here are the assertions.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _cases import quick_or_slow

pytestmark = pytest.mark.integration  # processes of their own

CHECK = pathlib.Path(__file__).with_name("sharding_check.py")
METHODS_AND_LAYOUTS = [
  (method, layout) for method in ("c_cola_ud", "o_cola_od") for layout in ("data", "model_rows", "model_cols")
] + [("o_cola_ud", "model_rows"), ("c_cola_ud", "explicit")]
# The quick suite checks row shards (the orthogonal Gram all-reduce) and the
# explicit mesh; data parallelism, column shards and o-CoLA-ud run with `slow`.
QUICK = (("c_cola_ud", "model_rows"), ("o_cola_od", "model_rows"), ("c_cola_ud", "explicit"), ("o_cola_od", "explicit"))
ALL = tuple(METHODS_AND_LAYOUTS) + (("o_cola_od", "explicit"),)

# Relative agreement with the single-device run after 20 steps. The circle
# geometry is elementwise: only the gradients' reductions are reordered.
# Orthogonal results are defined to the projection tolerance (1e-6 on
# max |Q^T Q - I|): a gradient one ulp off can change the number of
# quasi-Newton iterations, so they agree to 10x that.
TOLERANCE = {"c_cola_ud": 1e-6, "o_cola_od": 1e-5, "o_cola_ud": 1e-5}


@functools.cache
def report(combinations: tuple) -> dict:
  """The script's report on ``combinations`` of (method, layout), run once per test process."""
  # The script adds the 8-device flag to the XLA_FLAGS it inherits.
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", JAX_PLATFORMS="cpu")
  command = [sys.executable, str(CHECK), *(f"{method}:{layout}" for method, layout in combinations)]
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def entry(method, layout):
  (found,) = [
    r
    for r in report(QUICK if (method, layout) in QUICK else ALL)["reports"]
    if r["method"] == method and r["layout"] == layout
  ]
  return found


def test_eight_devices_and_partitionable_threefry():
  found = report(QUICK)
  assert found["devices"] == 8
  # The default since JAX 0.5: random bits depend on the key and the index of
  # the element only, not on how the array is sharded.
  assert found["threefry_partitionable"] is True


@pytest.mark.parametrize("method,layout", quick_or_slow(METHODS_AND_LAYOUTS, QUICK))
def test_sharded_update(method, layout):
  found = entry(method, layout)
  assert "error" not in found, found["error"]
  # The step returns parameters, momenta and slacks sharded as they came in.
  assert found["shardings_kept"], found["output_specs"]
  # Sharded and single-device runs agree, with and without noise (the same key
  # gives the same noise on one device and on eight).
  for tau, error in found["max_rel_error"].items():
    assert error <= TOLERANCE[method], (tau, error)
  for tau, residual in found["max_residual"].items():
    assert residual <= 1e-5, (tau, residual)
  # The noise is never communicated.
  assert found["noise_collectives"] == []


@pytest.mark.parametrize("method,layout", quick_or_slow([m for m in METHODS_AND_LAYOUTS if m[1] != "explicit"], QUICK))
def test_noise_is_drawn_shard_by_shard(method, layout):
  found = entry(method, layout)
  # No device builds a noise array larger than its largest parameter shard:
  # each draws the noise of its own shard (replicated leaves: all of it).
  assert found["noise_elements"] <= found["shard_elements"], found


def update_collectives(method, layout):
  """The collectives of the compiled step that do not come from the model's gradient."""
  return [c for c in entry(method, layout)["collectives"] if "jvp" not in c]


def test_collectives_on_row_shards():
  """The communication row shards need, and only that."""
  # Circle constraints are elementwise: model parallelism adds nothing to
  # the model's own forward/backward collectives.
  assert update_collectives("c_cola_ud", "model_rows") == []
  # Orthogonal, rows sharded (the long side of the tall matrix): the Gram
  # matrices Q^T Q (s x s) are all-reduced; full matrices are gathered only by
  # the SVD of the polar fallback, which runs when a projection fails.
  update = update_collectives("o_cola_od", "model_rows")
  assert update and all(c.startswith("all-reduce") or "svd" in c for c in update), update


@pytest.mark.slow
def test_collectives_of_data_parallelism_column_shards_and_rattle():
  # Data parallel: the gradient mean is the only reduction; the update itself,
  # noise and projections included, runs on every device without talking.
  for method in ("c_cola_ud", "o_cola_od"):
    assert update_collectives(method, "data") == []
  assert update_collectives("c_cola_ud", "model_cols") == []
  kinds = {c.split()[0] for c in entry("o_cola_ud", "model_rows")["collectives"]}
  assert kinds <= {"all-reduce", "all-gather"}, kinds
  # Orthogonal, columns sharded: the Gram needs whole columns, so the matrices
  # are all-gathered in every projection iteration.
  cols = update_collectives("o_cola_od", "model_cols")
  assert any(c.startswith("all-gather") and "svd" not in c for c in cols), cols


def test_orthogonal_on_an_explicit_mesh():
  found = entry("o_cola_od", "explicit")
  assert "error" not in found, found["error"]
  assert found["shardings_kept"]
  for error in found["max_rel_error"].values():
    assert error <= TOLERANCE["o_cola_od"]


def test_noise_is_drawn_shard_by_shard_on_an_explicit_mesh():
  found = entry("c_cola_ud", "explicit")
  assert found["noise_elements"] <= found["shard_elements"], found
