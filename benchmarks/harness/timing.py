"""Timing and sizes shared by the speed benchmarks: interleaved medians, compile cost, bytes, target lines.

Every time is a ratio's ingredient: a method and its baseline run in the same
process, back to back, after warm-up, with ``jax.block_until_ready`` after each
call, and the reported figure is a median.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import report


def time_call(fn: Callable, args: Sequence, repetitions: int, budget_s: float) -> np.ndarray:
  """Seconds per call of ``fn(*args)`` after one warm-up call: at most ``repetitions`` calls, stopping
  once ``budget_s`` seconds are spent (at least one call)."""
  jax.block_until_ready(fn(*args))
  samples = []
  start = time.perf_counter()
  for _ in range(repetitions):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
    if time.perf_counter() - start > budget_s:
      break
  return np.asarray(samples)


def measure_pair(fns: Sequence[Callable], carries: Sequence, warmup: int, repetitions: int, budget_s: float):
  """Interleaved timing of two step functions ``carry = fn(*carry)``; per-call seconds of each.

  The order within a pair alternates from one repetition to the next so that
  neither side always runs right after the other. Stops early once
  ``budget_s`` seconds are spent (at least 5 repetitions, fewer only if
  ``repetitions`` is smaller).
  """
  carries = list(carries)
  for i in (0, 1):
    for _ in range(warmup):
      carries[i] = jax.block_until_ready(fns[i](*carries[i]))
  samples = ([], [])
  start = time.perf_counter()
  for rep in range(repetitions):
    for i in (0, 1) if rep % 2 == 0 else (1, 0):
      t0 = time.perf_counter()
      carries[i] = jax.block_until_ready(fns[i](*carries[i]))
      samples[i].append(time.perf_counter() - t0)
    if rep >= 4 and time.perf_counter() - start > budget_s:
      break
  return np.asarray(samples[0]), np.asarray(samples[1])


def pair_summary(t_method: np.ndarray, t_baseline: np.ndarray) -> dict:
  """Medians (ms), their ratio, the median of the paired ratios and the interquartile ranges (ms)."""
  iqr = lambda t: float(np.percentile(t, 75) - np.percentile(t, 25)) * 1e3
  return {
    "method_ms": float(np.median(t_method)) * 1e3,
    "baseline_ms": float(np.median(t_baseline)) * 1e3,
    "ratio": float(np.median(t_method) / np.median(t_baseline)),
    "ratio_of_paired": float(np.median(t_method / t_baseline)),
    "method_iqr_ms": iqr(t_method),
    "baseline_iqr_ms": iqr(t_baseline),
    "repetitions": len(t_method),
  }


def against_adam(cost: dict, adam_cost: dict, timed: dict) -> dict:
  """A method's :func:`compile_cost` and :func:`pair_summary` beside Adam's: its compile seconds (wall, CPU),
  Adam's, the step times, and ``ratios`` to Adam's of the step and of both compile times."""
  return {
    **{k: cost[k] for k in ("compile_s", "compile_cpu_s")},
    "adam_compile_s": adam_cost["compile_s"],
    "adam_compile_cpu_s": adam_cost["compile_cpu_s"],
    "step": timed,
    "ratios": {
      "step": timed["ratio"],
      "compile_wall": cost["compile_s"] / adam_cost["compile_s"],
      "compile_cpu": cost["compile_cpu_s"] / adam_cost["compile_cpu_s"],
    },
  }


def tree_bytes(tree) -> int:
  """Bytes of a pytree's arrays (a typed PRNG key counted as its key data)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
  return total


def compile_cost(jitted, *args, compiler_options=None) -> tuple[object, dict]:
  """``jitted.lower(*args).compile(compiler_options)`` and what it cost: ``lower_s``, ``compile_s`` (seconds, wall
  clock), ``lower_cpu_s``, ``compile_cpu_s`` (this process's CPU seconds: on a shared machine the
  steadier measure) and XLA's ``memory_analysis()`` in bytes (``argument``, ``output``, ``alias``,
  ``temp``; None where the backend reports none), and the compiled program's size: ``fusions``
  (fusion instructions, each compiled to a kernel of its own) and ``while_loops``."""
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = jitted.lower(*args)
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile(compiler_options)
  t2, c2 = time.perf_counter(), time.process_time()
  cost = {"lower_s": t1 - t0, "compile_s": t2 - t1, "lower_cpu_s": c1 - c0, "compile_cpu_s": c2 - c1}
  memory = compiled.memory_analysis()
  for name in ("argument", "output", "alias", "temp"):
    cost[f"{name}_bytes"] = None if memory is None else int(getattr(memory, f"{name}_size_in_bytes"))
  text = compiled.as_text() or ""
  cost["fusions"] = len(re.findall(r" fusion\(", text))
  cost["while_loops"] = len(re.findall(r" while\(", text))
  return compiled, cost


def target_lines(targets: Sequence[dict], value: Callable[[dict], str] = lambda t: f"{t['value']:.2f}") -> list[str]:
  """``target: name: value <= limit  MET`` for each target (``name``, ``value``, ``limit``, ``met``)."""
  lines = []
  for t in targets:
    shown = "n/a" if t["value"] is None else value(t)
    met = {None: "not measured", True: "MET", False: "MISSED"}[t["met"]]
    lines.append(f"target: {t['name']}: {shown} <= {t['limit']}  {met}")
  return lines


def speed_parser(
  doc: str, smoke_help: str, *, repetitions: int | None = None, budget_s: float | None = None
) -> argparse.ArgumentParser:
  """A parser described by ``doc``'s first paragraph (the rest shown as written), with ``--smoke``
  (``smoke_help``), ``--out`` (default results/cost/, a --smoke run a new temporary folder) and
  ``--seed``; for a script that times, ``--repetitions`` and ``--budget`` with these defaults."""
  p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help=smoke_help)
  p.add_argument(
    "--out", default=None, help="output directory (default: results/cost/; a --smoke run: a new temporary folder)"
  )
  p.add_argument("--seed", type=int, default=0)
  if repetitions is not None:
    p.add_argument(
      "--repetitions", type=int, default=repetitions, help="timed calls (or pairs) per measurement at most"
    )
    p.add_argument("--budget", type=float, default=budget_s, help="seconds at most per measurement")
  return p


def speed_output(args: argparse.Namespace, name: str) -> str:
  """The folder of a speed parser's ``--out``, created: by default results/cost/, for ``--smoke`` a new
  temporary folder named after ``name``."""
  return report.output_dir(args.out or (None if args.smoke else "results/cost/"), name)


def started_run(parse_args: Callable, argv: Sequence[str] | None) -> tuple[list[str], argparse.Namespace, float]:
  """The command line (``sys.argv[1:]`` where ``argv`` is None), ``parse_args`` of it, and the
  ``time.perf_counter()`` reading that the run's wall time counts from."""
  argv = list(sys.argv[1:] if argv is None else argv)
  return argv, parse_args(argv), time.perf_counter()
