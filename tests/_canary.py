"""What the canaries share: the gate on the jax version their numbers were measured on, and the measurements.

A canary measures what one of the library's XLA:CPU mechanisms (``cola_jax/_platform.py``) buys: the same
program compiled with the mechanism and without it (``_platform.plain``), in one process, compared by compile
time, step time or XLA's temporary bytes. On the jax its number was measured on it asserts that the mechanism
still buys at least 10 % (the rule by which a mechanism stays); on another jax it reports the measurement as a
skip, with the number measured before, so that an upgrade prompts a re-measurement instead of a red build.

They measure the compiler users run: XLA's default backend optimisation level (3), not the level 0 that
``conftest.py`` sets for the other tiers (without LLVM's optimisations a written-out hash compiles as fast as
JAX's loop, and a step's time is not the time users see). Run them with
``XLA_FLAGS=--xla_backend_optimization_level=3``.
"""

import os
import re
import time

import jax
import pytest

MEASURED_ON = "0.10.2"  # the jax whose numbers docs/development.md records
AT_LEAST = 0.10  # the least a mechanism must save of the cost it was made for


USERS_LEVEL = 3  # XLA's default --xla_backend_optimization_level


def require_users_compiler() -> None:
  """Fail, naming the flag, unless XLA:CPU runs at its default optimisation level."""
  levels = re.findall(r"--xla_backend_optimization_level=(\d+)", os.environ.get("XLA_FLAGS", ""))
  level = int(levels[-1]) if levels else USERS_LEVEL
  if level != USERS_LEVEL:
    pytest.fail(
      f"the canaries measure the compiler users run, XLA's optimisation level {USERS_LEVEL}, not {level}: run them "
      f"with XLA_FLAGS=--xla_backend_optimization_level={USERS_LEVEL}"
    )


def check_saves(mechanism: str, cost: str, with_it: float, without: float, recorded: str) -> None:
  """Assert (on ``MEASURED_ON``) or report (elsewhere) that ``with_it`` is at least 10 % below ``without``."""
  saved = 1 - with_it / without
  report = (
    f"{mechanism}: {cost} {with_it:.4g} with it, {without:.4g} without ({saved:+.0%} saved; at least "
    f"{AT_LEAST:.0%} needed); recorded on jax {MEASURED_ON}: {recorded}"
  )
  print(report)
  if jax.__version__ != MEASURED_ON:
    pytest.skip(f"jax {jax.__version__}, not {MEASURED_ON}: re-measure. {report}")
  assert saved >= AT_LEAST, report


def compile_cpu_s(fn, *args, repetitions: int = 3) -> float:
  """The least process CPU time over ``repetitions`` of lowering and compiling ``jax.jit(fn)`` afresh."""
  times = []
  for _ in range(repetitions):
    jitted = jax.jit(lambda *a: fn(*a))  # a new function: nothing cached
    start = time.process_time()
    jitted.lower(*args).compile()
    times.append(time.process_time() - start)
  return min(times)


def temporaries(fn, *args, donate_argnums=()) -> int:
  """XLA's temporary bytes of ``jax.jit(fn)`` compiled for ``args``."""
  compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def step_times(first, second, args, *, repetitions: int = 15) -> tuple[float, float]:
  """The least seconds per call of two compiled functions of ``args``, timed in alternation (after a warm-up).

  The least of the calls, not their median: what each takes when nothing else runs on the cores (a CI
  machine's other work only ever adds to a call's time).
  """
  for f in (first, second):
    jax.block_until_ready(f(*args))
  times: tuple[list, list] = ([], [])
  for _ in range(repetitions):
    for f, kept in zip((first, second), times):
      start = time.perf_counter()
      jax.block_until_ready(f(*args))
      kept.append(time.perf_counter() - start)
  return min(times[0]), min(times[1])
