"""A noisy CoLA training step compiled through JAX's persistent compilation cache.

Not a test module: ``tests/test_compile_cache.py`` starts it, each run in a
process of its own, because the cache is for later processes. Run it by hand with::

    python tests/compile_cache_check.py CACHE_DIR SEED

It turns the cache on at ``CACHE_DIR`` (every program cached, however short
its compile), projects a small MLP onto its constraints (an orthogonal kernel,
a circle-constrained one, a unit-norm one; biases free), builds CoLA-ud with
noise from ``jax.random.key(SEED)`` and compiles its jitted training step,
then takes ``STEPS`` steps. It prints one JSON line: ``cache_events`` (JAX's
cache hit and miss events of the step's compile alone) and ``digest`` (a
SHA-256 of the parameters and the optimizer state after the steps, keys as
their key data).
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import numpy as np
import optax

import cola_jax as cola
from conftest import mlp_apply, mlp_params, regression_data  # this folder is on sys.path

STEPS = 5
CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")
CONSTRAINTS = {
  "layer0": {"w": cola.Orthogonal(), "b": None},
  "layer1": {"w": cola.Circle(0.5), "b": None},
  "layer2": {"w": cola.UnitNorm(1.0), "b": None},
}


def digest(tree) -> str:
  """SHA-256 of every leaf's bytes, in tree order (PRNG keys as their key data)."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


def main(cache_dir: str, seed: int) -> dict:
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  events = []
  jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))

  params = cola.project_params(mlp_params(jax.random.key(0), (16, 12, 8, 4)), CONSTRAINTS)
  x, y = regression_data(jax.random.key(1), 64, 16, 4)
  tx = cola.cola_ud(0.1, friction=1.0, constraints=CONSTRAINTS, temperature=1e-3, key=jax.random.key(seed))
  state = tx.init(params)

  def step(params, state):
    grads = jax.grad(lambda p: optax.l2_loss(mlp_apply(p, x), y).mean())(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  lowered = jax.jit(step).lower(params, state)
  events.clear()  # the projections' and init's programs are not the step's
  compiled = lowered.compile()
  cache_events = sorted(event for event in set(events) if event in CACHE_EVENTS)
  for _ in range(STEPS):
    params, state = compiled(params, state)
  return {"cache_events": cache_events, "digest": digest((params, state))}


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
