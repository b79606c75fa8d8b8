"""Step-decay schedules given in epochs, as the paper's ResNet protocol states them."""

from __future__ import annotations

from collections.abc import Sequence

import optax


def step_decay(value: float, steps_per_epoch: int, decay_epochs: Sequence[int], factor: float) -> optax.Schedule:
  """``value * factor**k`` after ``k`` of the ``decay_epochs`` have passed (epoch ``e`` ends at step
  ``e * steps_per_epoch``); a repeated epoch multiplies by ``factor`` again."""
  boundaries: dict = {}
  for epoch in decay_epochs:
    step = epoch * steps_per_epoch
    boundaries[step] = boundaries.get(step, 1.0) * factor
  return optax.piecewise_constant_schedule(value, boundaries)


def thirds(epochs: int) -> tuple[int, ...]:
  """The decay epochs ``round(E/3), round(2E/3)`` (the paper's 50 and 100 of 150), those inside (0, E)."""
  return tuple(e for e in (round(epochs / 3), round(2 * epochs / 3)) if 0 < e < epochs)
