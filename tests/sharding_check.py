"""CoLA updates on 8 simulated CPU devices: shardings, noise, equivalence.

Not a test module: ``tests/test_sharding.py`` runs it in a subprocess, because
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` only takes effect if it
is set before JAX initialises its backends. Run it by hand with::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_check.py [method:layout ...]

It prints one JSON report (the last line of stdout) with, for every method and
layout named (all of them by default) and every temperature:

- ``shardings_kept``: the jitted training step returns parameters, momenta
  and slack variables with the shardings the parameters came in with (the
  gradients are constrained to the parameters' shardings, so that this checks
  the optimizer, not how XLA chose to shard the model's activations);
- ``max_rel_error``: ``max |sharded - single device| / max |single device|``
  over the leaves after 20 steps, at ``tau = 0`` and at ``tau > 0`` (which also
  compares the noise: with ``jax_threefry_partitionable`` the bits do not
  depend on the sharding). The temperature is injected with
  ``optax.inject_hyperparams``, so that one compiled step serves both;
- ``collectives``: the collectives of the compiled program, as
  ``(kind, shape, origin)`` with ``origin`` the JAX operation they come from;
- ``noise_collectives``: collectives whose origin is the random number
  generation (must be empty: the noise is never gathered);
- ``noise_elements`` and ``shard_elements``: the largest array the noise
  computation builds on one device and the largest parameter shard on one
  device (the noise is partitioned when the first is at most the second).

Layouts, on a 1-D mesh of 8 devices with ``AxisType.Auto`` (XLA propagates the
shardings, the classic ``jit`` model):

- ``data``: parameters replicated, batch sharded along its first axis;
- ``model_rows``: kernels ``(in, out)`` sharded along ``in`` (the rows of the
  tall matrix the orthogonal constraint sees), biases replicated;
- ``model_cols``: kernels sharded along ``out`` (columns), biases sharded.

``explicit`` repeats ``model_rows`` on ``jax.make_mesh``'s default axis type
(``Explicit`` in JAX 0.10), where an operation whose output sharding is
ambiguous is an error at trace time rather than a choice of XLA; a failure is
recorded in ``error``.
"""

import json
import os
import re
import sys

_DEVICES = 8
# A device count already in XLA_FLAGS wins: tests/multihost_check.py imports
# this module's problem and step with 2 or 4 devices.
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}={_DEVICES}").strip()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cola_jax as cola  # noqa: E402
from conftest import mlp_params  # noqa: E402  (this folder is on sys.path: the script's own)

STEPS = 20
SIZES = (32, 16, 8)  # every kernel (in, out) is tall: Q = W
TAUS = (0.0, 1e-4)

METHODS = {
  "c_cola_ud": lambda key: optax.inject_hyperparams(cola.c_cola_ud)(
    0.3, friction=1.0, radius=0.2, temperature=0.0, key=key
  ),
  "o_cola_od": lambda key: optax.inject_hyperparams(cola.o_cola_od)(0.05, temperature=0.0, key=key),
  "o_cola_ud": lambda key: optax.inject_hyperparams(cola.o_cola_ud)(0.1, friction=1.0, temperature=0.0, key=key),
}

# layout: (axis name, axis types, kernel spec, bias spec, batch spec)
LAYOUTS = {
  "data": ("data", (AxisType.Auto,), P(), P(), P("data", None)),
  "model_rows": ("model", (AxisType.Auto,), P("model"), P(), P()),
  "model_cols": ("model", (AxisType.Auto,), P(None, "model"), P("model"), P()),
  "explicit": ("model", None, P("model"), P(), P()),
}

_COLLECTIVE = re.compile(
  r"= (\([^=]*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)
_NOISE_ORIGIN = re.compile(r"jit\(_normal\)|jit\(_uniform\)|random_bits|threefry2x32|erf_inv")
_SHAPE = re.compile(r"= \w+\[([\d,]*)\]")


def problem():
  """An MLP regression: (params, x, y)."""
  kp, kx, kt = jax.random.split(jax.random.key(0), 3)
  params = mlp_params(kp, SIZES)
  x = jax.random.normal(kx, (64, SIZES[0]))
  y = jnp.tanh(x @ jax.random.normal(kt, (SIZES[0], SIZES[-1])) / np.sqrt(SIZES[0]))
  return params, x, y


def loss(params, x, y):
  for i in range(len(SIZES) - 1):
    layer = params[f"layer{i}"]
    x = x @ layer["w"] + layer["b"]
    if i < len(SIZES) - 2:
      x = jnp.tanh(x)
  return jnp.mean((x - y) ** 2)


def make_step(tx, shardings=None):
  """One jitted training step; gradients constrained to ``shardings``."""

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(loss)(params, x, y)
    if shardings is not None:
      grads = jax.lax.with_sharding_constraint(grads, shardings)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def init_at(tx, params, tau, mesh=None):
  """``tx.init`` at temperature ``tau``.

  Called eagerly, so that momenta and slacks take the shardings of the
  parameters (under ``jit`` with auto axes ``zeros_like`` would come out
  replicated); the scalars (count, key, hyperparameters) are then replicated
  on the mesh, where the step's outputs will put them.
  """
  state = tx.init(params)
  state = state._replace(hyperparams=dict(state.hyperparams, temperature=jnp.float32(tau)))
  if mesh is not None:
    state = jax.tree.map(lambda a: a if a.ndim else replicated(a, mesh), state)
  return state


def replicated(scalar, mesh):
  """``scalar`` on every device of ``mesh``, through its host value.

  (``jax.device_put`` takes an array on one device to a sharding that spans
  other processes' devices only from host values, which every process has.)
  """
  sharding = NamedSharding(mesh, P())
  if not jnp.issubdtype(scalar.dtype, jax.dtypes.prng_key):
    return jax.device_put(np.asarray(scalar), sharding)
  data = jax.device_put(np.asarray(jax.random.key_data(scalar)), sharding)
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(scalar))


def train(step, params, state, x, y):
  for _ in range(STEPS):
    # One execution at a time: queued executions of a program with collectives
    # can exhaust the CPU client's threads on a 2-core machine and stall a
    # rendezvous (8 simulated devices share them).
    params, state = jax.block_until_ready(step(params, state, x, y))
  return params, state


def collectives(hlo: str):
  found = []
  for line in hlo.splitlines():
    match = _COLLECTIVE.search(line)
    if match:
      origin = re.search(r'op_name="([^"]*)"', line)
      shape = re.sub(r"\{[^}]*\}", "", match.group(1))  # without layouts
      found.append((match.group(2), shape, origin.group(1) if origin else ""))
  return found


def noise_elements(hlo: str) -> int:
  """The largest array built by the random number generation, on one device."""
  largest = 0
  for line in hlo.splitlines():
    origin = re.search(r'op_name="([^"]*)"', line)
    shape = _SHAPE.search(line)
    if origin and shape and _NOISE_ORIGIN.search(origin.group(1)):
      dims = [int(d) for d in shape.group(1).split(",") if d]
      largest = max(largest, int(np.prod(dims)) if dims else 1)
  return largest


def sharding_matches(array, like) -> bool:
  return array.sharding.is_equivalent_to(like.sharding, array.ndim)


def check(method: str, layout: str, references) -> dict:
  axis, axis_types, w_spec, b_spec, batch_spec = LAYOUTS[layout]
  if axis_types is None:
    mesh = jax.make_mesh((_DEVICES,), (axis,))
  else:
    mesh = jax.make_mesh((_DEVICES,), (axis,), axis_types=axis_types)
  params, x, y = problem()
  shardings = {name: {"w": NamedSharding(mesh, w_spec), "b": NamedSharding(mesh, b_spec)} for name in params}
  params = jax.device_put(params, shardings)
  x, y = jax.device_put((x, y), NamedSharding(mesh, batch_spec))
  report = {"method": method, "layout": layout, "axis_types": [str(t) for t in mesh.axis_types]}
  tx = METHODS[method](jax.random.key(42))
  # Under explicit axes the gradients' shardings are part of their types already
  # (and with_sharding_constraint only takes auto axes).
  step = make_step(tx, None if mesh.explicit_axes else shardings)
  try:
    state = init_at(tx, params, TAUS[-1], mesh)
    # The new parameters and the state's leaves shaped like them (momenta, slacks).
    new_params, new_state = jax.block_until_ready(step(params, state, x, y))
    results = {tau: train(step, params, init_at(tx, params, tau, mesh), x, y) for tau in TAUS}
    hlo = step.lower(params, state, x, y).compile().as_text()
  except Exception as error:  # recorded for the test to report
    report["error"] = f"{type(error).__name__}: {error}"[:600]
    return report
  inner = new_state.inner_state
  flat_params = jax.tree.leaves(params)
  kept = all(sharding_matches(a, b) for a, b in zip(jax.tree.leaves(new_params), flat_params))
  if hasattr(inner, "momentum"):
    kept &= all(sharding_matches(a, b) for a, b in zip(jax.tree.leaves(inner.momentum), flat_params))
  for name, aux in inner.constraint_states.items():
    if isinstance(aux["w"], cola.CircleState):
      kept &= sharding_matches(aux["w"].slack, params[name]["w"])
  report["shardings_kept"] = bool(kept)
  report["output_specs"] = jax.tree.map(lambda a: str(a.sharding.spec), new_params)

  report["max_rel_error"] = {}
  report["max_residual"] = {}
  for tau, (trained, trained_state) in results.items():
    errors = [
      float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))
      for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(references[tau]))
    ]
    report["max_rel_error"][str(tau)] = max(errors)
    residuals = jax.tree.leaves(cola.constraint_residuals(trained, trained_state))
    report["max_residual"][str(tau)] = max(float(r) for r in residuals)

  found = collectives(hlo)
  report["collectives"] = sorted({f"{kind} {shape} <- {origin.split('/', 1)[-1]}" for kind, shape, origin in found})
  report["noise_collectives"] = sorted(
    {f"{kind} {shape} <- {origin}" for kind, shape, origin in found if _NOISE_ORIGIN.search(origin)}
  )
  report["noise_elements"] = noise_elements(hlo)
  report["shard_elements"] = max(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) for leaf in flat_params)
  return report


def single_device_references(method: str):
  params, x, y = problem()
  tx = METHODS[method](jax.random.key(42))
  step = make_step(tx)
  return {tau: jax.tree.map(np.asarray, train(step, params, init_at(tx, params, tau), x, y)[0]) for tau in TAUS}


# o_cola_ud shares o_cola_od's projection; its RATTLE step adds the cotangent
# projection (another Gram-sized product), checked on row shards.
ALL_CHECKS = tuple((method, layout) for method in ("c_cola_ud", "o_cola_od") for layout in LAYOUTS) + (
  ("o_cola_ud", "model_rows"),
)


def main(argv):
  assert jax.device_count() == _DEVICES, jax.devices()
  wanted = [tuple(arg.split(":")) for arg in argv] or ALL_CHECKS
  unknown = [w for w in wanted if w not in ALL_CHECKS]
  assert not unknown, f"unknown method:layout {unknown}; known: {ALL_CHECKS}"
  reports = []
  for method in METHODS:
    layouts = [layout for m, layout in wanted if m == method]
    if layouts:
      references = single_device_references(method)
      reports.extend(check(method, layout, references) for layout in layouts)
  print(
    json.dumps(
      {
        "devices": jax.device_count(),
        "threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
        "default_make_mesh_axis_types": [str(t) for t in jax.make_mesh((_DEVICES,), ("a",)).axis_types],
        "reports": reports,
      }
    )
  )


if __name__ == "__main__":
  main(sys.argv[1:])
