"""The CoLA methods' update rules over a driver's leaves, shared by the optax transforms and the samplers.

Each rule takes an :class:`~cola_jax._engine.Update` (the leaves, their points
after their gradients, their noise) and the step's hyperparameters, and returns
the stepped leaves' new values and constraint states (and momenta).
"""

import jax
import optax

from cola_jax import langevin
from cola_jax._engine import Update
from cola_jax.langevin import Splitting


def overdamped_draw(constraint, key, point):
  """A leaf's numbers for an overdamped step."""
  return langevin.draw_noise(constraint, key, point, "overdamped")


def overdamped(update: Update, h, noise_scale) -> tuple[list, ...]:
  """Each stepped leaf's new value and constraint state after the Euler-Maruyama step and the projection."""

  def leaf_step(c, param, point, grad, noise):
    return c.unpack(langevin.overdamped_step(c, point, grad, h, noise_scale, noise), param)

  return update.map(2, leaf_step, (None, None), update.leaves.compute, update.points, update.grads, update.noises)


def _cast(tree, dtype):
  return jax.tree.map(lambda a: a.astype(dtype), tree)


def underdamped(update: Update, splitting: Splitting, h, decay, temperature, first) -> tuple[list, ...]:
  """Each stepped leaf's new value, constraint state and momentum (stored as before) after a call of ``splitting``."""

  def leaf_step(c, param, point, grad, stored, noise):
    momentum = c.load_momentum(_cast(stored, param.dtype))
    point, momentum = splitting.step(
      c, point, momentum, grad, h, decay, first=first, temperature=temperature, noises=noise
    )
    new_param, new_aux = c.unpack(point, param)
    new_stored = jax.tree.map(lambda new, old: new.astype(old.dtype), c.store_momentum(momentum, param), stored)
    return new_param, new_aux, new_stored

  return update.map(
    3,
    leaf_step,
    (None, None, optax.MaskedNode()),
    update.leaves.compute,
    update.points,
    update.grads,
    update.momenta,
    update.noises,
  )
