"""The optimizer state sharded like the parameters, its shardings built by ``optax.tree.map_params``.

Not a test module: ``tests/test_state_sharding.py`` runs it in a subprocess
(the 8 CPU devices are fixed when JAX initialises). Run it by hand with::

    python tests/state_sharding_check.py

FSDP-style training on a 1-D mesh of 8 devices: every kernel of the problem of
``tests/sharding_check.py`` is sharded along its rows, biases replicated. The
state's shardings come from the parameters' through optax's own recipe,
``optax.tree.map_params(tx, lambda _, s: s, state, shardings,
transform_non_params=lambda _: replicated)``; the jitted step takes and returns
the state with them. It prints one JSON report (the last line of stdout) with,
per transform:

- ``param_shaped``: the tree paths of the state that ``map_params`` gave a
  parameter's sharding (the momenta, an inner optimizer's moments);
- ``shardings_kept``: every output leaf has the sharding it was given;
- ``max_rel_error``: ``max |sharded - unsharded| / max |unsharded|`` over the
  parameters after ``STEPS`` steps against the same step without shardings.
"""

import json
import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharding_check import loss, problem  # noqa: E402  (this folder is on sys.path)

import cola_jax as cola  # noqa: E402

STEPS = 5
KEY = jax.random.key(7)
TRANSFORMS = {
  "cola_ud_circle": lambda: cola.cola_ud(
    0.3, friction=1.0, constraints=cola.path_constraints([(r"/w$", cola.Circle(0.2))]), temperature=1e-4, key=KEY
  ),
  "o_cola_ud": lambda: cola.o_cola_ud(0.1, friction=1.0, temperature=1e-4, key=KEY),
  "constrained_adam_orthogonal": lambda: cola.constrained(optax.adam(1e-2), constraints=cola.orthogonal_constraints()),
  "constrained_adamw_sphere": lambda: cola.constrained(
    optax.adamw(1e-2), constraints=cola.path_constraints([(r"/w$", cola.MaxNorm(1.0))])
  ),
}


def train(tx, params, x, y, shardings=None):
  """``STEPS`` steps from ``tx.init(params)``; with ``shardings``, the state sharded as map_params says."""
  state = tx.init(params)
  if shardings is None:
    step = jax.jit(lambda p, s: _step(tx, p, s, x, y))
    state_shardings = None
  else:
    replicated = NamedSharding(shardings["layer0"]["b"].mesh, P())
    state_shardings = optax.tree.map_params(
      tx, lambda _, sharding: sharding, state, shardings, transform_non_params=lambda _: replicated
    )
    state = jax.device_put(state, state_shardings)
    step = jax.jit(
      lambda p, s: _step(tx, p, s, x, y),
      in_shardings=(shardings, state_shardings),
      out_shardings=(shardings, state_shardings),
    )
  for _ in range(STEPS):
    params, state = jax.block_until_ready(step(params, state))
  return params, state, state_shardings


def _step(tx, params, state, x, y):
  grads = jax.grad(loss)(params, x, y)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def kept(tree, shardings) -> bool:
  """Every array of ``tree`` has the sharding given for it (a prefix of ``tree``)."""
  found = []

  def compare(sharding, subtree):
    found.extend(a.sharding.is_equivalent_to(sharding, a.ndim) for a in jax.tree.leaves(subtree))

  jax.tree.map(compare, shardings, tree, is_leaf=lambda s: isinstance(s, NamedSharding))
  return bool(found) and all(found)


def main():
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  params, x, y = problem()
  shardings = {name: {"w": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P())} for name in params}
  reports = {}
  for name, make in TRANSFORMS.items():
    tx = make()
    reference, _, _ = train(tx, params, x, y)
    trained, state, state_shardings = train(tx, jax.device_put(params, shardings), x, y, shardings)
    param_shaped = [
      jax.tree_util.keystr(path)
      for path, s in jax.tree_util.tree_leaves_with_path(state_shardings)
      if s.spec == P("fsdp")
    ]
    errors = [
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
      for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(reference))
    ]
    reports[name] = {
      "param_shaped": param_shaped,
      "shardings_kept": kept(trained, shardings) and kept(state, state_shardings),
      "max_rel_error": max(errors),
      "max_residual": max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(trained, state))),
    }
  print(json.dumps({"devices": jax.device_count(), "reports": reports}))


if __name__ == "__main__":
  main()
