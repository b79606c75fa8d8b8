"""Checks of hyperparameters at construction, with errors that name the argument and the function called.

A number known at construction must be a finite real scalar in its range.
Schedules and traced values (``optax.inject_hyperparams``, ``jit``) cannot be
checked then; the transforms read a schedule's rounding below zero as zero.
"""

import contextlib
import contextvars
import math
from typing import Any

import jax.numpy as jnp

from cola_jax._numerics import concrete_float

_CALLED_AS: contextvars.ContextVar[str | None] = contextvars.ContextVar("cola_jax_called_as", default=None)


@contextlib.contextmanager
def called_as(name: str):
  """Within, the factories name ``name`` in their errors: the function the user called (a preset)."""
  token = _CALLED_AS.set(name)
  try:
    yield
  finally:
    _CALLED_AS.reset(token)


def caller(default: str) -> str:
  """The name errors give the function the user called: ``default``, or the preset's inside :func:`called_as`."""
  return _CALLED_AS.get() or default


def _known(owner: str, name: str, value: Any) -> float | None:
  """The value as a float when known now (None for schedules and traced values)."""
  if callable(value):
    return None
  if value is None or isinstance(value, (str, bytes, bool)):
    raise TypeError(f"{owner}: {name} must be a number, got {value!r}.")
  try:
    dtype = jnp.result_type(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(f"{owner}: {name} must be a real number, got {value!r}.")
  if jnp.ndim(value) != 0:
    raise ValueError(f"{owner}: {name} must be a scalar, got shape {jnp.shape(value)}.")
  return concrete_float(value)


def check_positive(owner: str, name: str, value: Any) -> None:
  """Raises unless ``value`` is a schedule, traced, or a finite number ``> 0``."""
  x = _known(owner, name, value)
  if x is not None and not (math.isfinite(x) and x > 0):
    raise ValueError(f"{owner}: {name} must be positive and finite, got {value!r}.")


def check_static_positive(owner: str, name: str, value: Any) -> float:
  """``value`` as a Python float; raises unless it is a finite number ``> 0`` known now.

  For a hyperparameter that fixes the manifold (a scale): neither a schedule
  nor a traced value, since it is part of the constraint's static identity.
  """
  if callable(value):
    raise TypeError(f"{owner}: {name} must be a number, not a schedule.")
  x = _known(owner, name, value)
  if x is None:
    raise TypeError(f"{owner}: {name} must be a concrete number (it fixes the manifold), got a traced value.")
  if not (math.isfinite(x) and x > 0):
    raise ValueError(f"{owner}: {name} must be positive and finite, got {value!r}.")
  return float(x)


def check_nonnegative(owner: str, name: str, value: Any) -> None:
  """Raises unless ``value`` is a schedule, traced, or a finite number ``>= 0``."""
  x = _known(owner, name, value)
  if x is not None and not (math.isfinite(x) and x >= 0):
    raise ValueError(f"{owner}: {name} must be non-negative and finite, got {value!r}.")


def check_positive_integer(owner: str, name: str, value: Any) -> None:
  """Raises unless ``value`` is traced or a whole number ``>= 1``."""
  if callable(value):
    raise TypeError(f"{owner}: {name} must be a number, not a schedule.")
  x = _known(owner, name, value)
  if x is not None and not (math.isfinite(x) and x >= 1 and x == int(x)):
    raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}.")


def check_floating_dtype(owner: str, name: str, value: Any) -> Any:
  """``value`` as a NumPy dtype; raises unless it names a real floating point type (None passes)."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{owner}: {name} must be a floating point dtype such as jnp.bfloat16, got {value!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{owner}: {name} must be a floating point dtype such as jnp.bfloat16, got {dtype}.")
  return dtype


def check_loop(owner: str, loop) -> None:
  """``loop`` of a constraint: ``"while"`` or ``"fixed"`` (see :func:`cola_jax._numerics.bounded_while_loop`)."""
  if loop not in ("while", "fixed"):
    raise ValueError(f"{owner}: loop must be 'while' or 'fixed', got {loop!r}.")
