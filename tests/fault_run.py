"""A noisy CoLA training run that checkpoints with orbax and resumes from its last checkpoint.

Not a test module: ``tests/test_fault_resume.py`` runs it in subprocesses,
kills one with SIGKILL mid-run and resumes it in another. Run it by hand with::

    python tests/fault_run.py DIRECTORY [--until N]

It trains a small MLP (a circle-constrained, an orthogonal and a free layer)
with ``cola_ud`` at temperature > 0, so the state holds a PRNG key, slacks,
momenta and projection diagnostics. It starts from the latest complete
checkpoint in DIRECTORY if there is one, saves one after its first step and
every ``EVERY`` steps (orbax ``CheckpointManager``, asynchronous as by default)
and prints the number of each finished step. With ``--until N`` it stops after
step N and saves it; without, it trains until it is killed.
"""

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

import cola_jax as cola

EVERY = 5
SIZES = (6, 16, 12, 3)
BATCH, N = 8, 64


def initial_params():
  params = {}
  for i, key in enumerate(jax.random.split(jax.random.key(0), len(SIZES) - 1)):
    params[f"layer{i}"] = {
      "w": jax.random.normal(key, SIZES[i : i + 2]) / jnp.sqrt(SIZES[i]),
      "b": jnp.zeros(SIZES[i + 1]),
    }
  return params


def transform():
  constraints = {
    "layer0": {"w": cola.Circle(0.3), "b": None},
    "layer1": {"w": cola.Orthogonal(), "b": None},
    "layer2": None,
  }
  return cola.cola_ud(0.2, friction=1.0, constraints=constraints, temperature=1e-3, key=jax.random.key(1))


def make_step(tx):
  kx, kw = jax.random.split(jax.random.key(2))
  x = jax.random.normal(kx, (N, SIZES[0]))
  y = jnp.tanh(x @ jax.random.normal(kw, (SIZES[0], SIZES[-1])))

  def loss(params, i):
    xb = jax.lax.dynamic_slice_in_dim(x, (i * BATCH) % N, BATCH)
    yb = jax.lax.dynamic_slice_in_dim(y, (i * BATCH) % N, BATCH)
    for name in ("layer0", "layer1"):
      xb = jnp.tanh(xb @ params[name]["w"] + params[name]["b"])
    return jnp.mean((xb @ params["layer2"]["w"] + params["layer2"]["b"] - yb) ** 2)

  @jax.jit
  def step(tree, i):
    params, opt_state = tree["params"], tree["opt_state"]
    updates, opt_state = tx.update(jax.grad(loss)(params, i), opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}

  return step


def manager(directory):
  options = ocp.CheckpointManagerOptions(save_interval_steps=EVERY, max_to_keep=3)
  return ocp.CheckpointManager(directory, options=options)


def initial_tree():
  tx = transform()
  params = initial_params()
  return tx, {"params": params, "opt_state": tx.init(params)}


def restore(directory, step=None):
  """(step, tree) of the checkpoint ``step`` (default: the latest complete one) in ``directory``."""
  _, like = initial_tree()
  with manager(directory) as checkpoints:
    step = checkpoints.latest_step() if step is None else step
    if step is None:
      return 0, like
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return step, checkpoints.restore(step, args=ocp.args.StandardRestore(target))


def train(directory, until=None, report=print):
  """Trains from the latest checkpoint in ``directory`` until step ``until`` (None: forever)."""
  tx, _ = initial_tree()
  step_fn = make_step(tx)
  step, tree = restore(directory)
  with manager(directory) as checkpoints:
    while until is None or step < until:
      tree = step_fn(tree, step)
      step += 1
      checkpoints.save(step, args=ocp.args.StandardSave(tree))  # every EVERY steps
      report(step)
    checkpoints.wait_until_finished()
    if checkpoints.latest_step() != step:
      checkpoints.save(step, args=ocp.args.StandardSave(tree), force=True)
  return tree


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("directory")
  parser.add_argument("--until", type=int, default=None)
  args = parser.parse_args()
  train(os.path.abspath(args.directory), args.until, report=lambda step: print(step, flush=True))
