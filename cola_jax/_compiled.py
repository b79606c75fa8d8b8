"""Constraint work outside ``jit`` (``init``, ``project_params``, ``constraint_residuals``), compiled.

Called outside ``jit``, a constraint's ``init``, projection or residual runs
op by op: JAX compiles every operation, and every while loop, on its own the
first time it sees it, seconds for a handful of small leaves. :func:`call`
runs it as one program instead, compiled once per function, static values
(constraints are hashable) and argument shapes, and reused by every later
call; under an outer ``jit`` it is traced inline as before.
"""

import functools
from collections.abc import Callable

import jax


@functools.partial(jax.jit, static_argnums=(0, 1))
def _call(fn, static, *args):
  return fn(*static, *args)


def call(fn: Callable, static: tuple, *args):
  """``fn(*static, *args)``, compiled (op by op where a static value is not hashable)."""
  try:
    hash(static)
  except TypeError:
    return fn(*static, *args)
  return _call(fn, static, *args)
