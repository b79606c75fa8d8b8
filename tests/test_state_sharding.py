"""The optimizer state sharded like the parameters through ``optax.tree.map_params`` (FSDP-style).

``tests/state_sharding_check.py`` runs in a subprocess on 8 simulated CPU
devices (fixed when JAX initialises); see it for what is measured.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # processes of their own

CHECK = pathlib.Path(__file__).with_name("state_sharding_check.py")
KERNELS = ("['layer0']['w']", "['layer1']['w']")
PARAM_SHAPED = {
  "cola_ud_circle": [f".momentum{k}" for k in KERNELS],
  "o_cola_ud": [f".momentum{k}" for k in KERNELS],
  "constrained_adam_orthogonal": [f".inner_state[0].{m}{k}" for m in ("mu", "nu") for k in KERNELS],
  "constrained_adamw_sphere": [f".inner_state[0].{m}{k}" for m in ("mu", "nu") for k in KERNELS],
}


@functools.cache
def report() -> dict:
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", PARAM_SHAPED)
def test_map_params_shards_the_state_like_the_parameters_and_the_step_is_unchanged(name):
  found = report()
  assert found["devices"] == 8
  entry = found["reports"][name]
  # Momenta and an inner optimizer's moments take the kernels' row sharding; the
  # constraint states (slacks, flags), the count and the key are non-parameters.
  assert sorted(entry["param_shaped"]) == sorted(PARAM_SHAPED[name])
  assert entry["shardings_kept"]
  assert entry["max_rel_error"] <= 1e-5
  assert entry["max_residual"] <= 1e-5
