#!/usr/bin/env python
"""Compile once for many runs: JAX's persistent compilation cache on the deep transformer of scale.py.

With ``jax.config.update("jax_compilation_cache_dir", DIR)`` JAX writes each
compiled program to ``DIR`` and a later process that compiles the same program
loads it instead. A CoLA step's program does not depend on the seed (the key is
part of the optimizer state, an argument), so runs over seeds in separate
processes, a restarted notebook or a resumed overnight run compile once. For
each method (the optax baselines, then every family and dynamics of scale.py
with noise), one process compiles the training step at the small batch with a
fresh cache (a miss: compiled and written), then another process with another
seed compiles it again (a hit: loaded). Measured in each: this process's CPU
seconds and the wall clock of ``lower(...).compile()``, and JAX's cache events.

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.compile_cache  # 12 blocks, width 512: about 15 min on 2 cores
  python -m benchmarks.cost.compile_cache --families circle --dynamics od --depth 2  # a quick look
  python -m benchmarks.cost.compile_cache --smoke  # a 1-block width-32 model, a temporary folder

Writes ``compile_cache.json`` under ``--out``. JSON keys: ``meta`` (command,
date, machine, versions), ``config``, ``results`` (one record per method:
``name``, ``family``, ``dynamics``, ``temperature``, ``miss`` and ``hit``, each
with ``seed``, ``compile_cpu_s``, ``compile_s`` and ``cache_events``).
"""

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from benchmarks.harness.records import child_report, write_report
from benchmarks.harness.timing import speed_output

CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")


def compile_with_cache(name: str, family: str | None, dynamics: str | None, seed: int, cache: str, args) -> dict:
  """In this process, with the persistent cache at ``cache``: compile ``name``'s step and what it cost."""
  import jax

  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  events = []
  jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))

  from benchmarks.cost import scale

  lowered = scale.lowered_step(args, name, family, dynamics, args.temperature if family else 0.0, seed)
  events.clear()  # what the model's init and the projections compiled is not the step's
  wall, cpu = time.perf_counter(), time.process_time()
  lowered.compile()
  return {
    "seed": seed,
    "compile_cpu_s": time.process_time() - cpu,
    "compile_s": time.perf_counter() - wall,
    "cache_events": sorted(event for event in set(events) if event in CACHE_EVENTS),
  }


def rows(args) -> list[tuple]:
  """(name, family, dynamics): the optax baselines, then every family and dynamics with noise."""
  out = [("sgd_m", None, None), ("adam", None, None)]
  return out + [(f"{d}_{f}_noisy", f, d) for f in args.families for d in args.dynamics]


def parse_args(argv=None):
  from benchmarks.cost import scale

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true", help="a 1-block width-32 model: a check that runs in a minute")
  p.add_argument("--out", default=None, help="output folder (default: results/cost/; --smoke: a new temporary folder)")
  scale.add_step_arguments(p)
  p.add_argument("--families", nargs="+", default=list(scale.FAMILIES), choices=scale.FAMILIES)
  p.add_argument("--dynamics", nargs="+", default=list(scale.DYNAMICS), choices=scale.DYNAMICS)
  p.add_argument("--child", nargs=5, metavar=("NAME", "FAMILY", "DYNAMICS", "SEED", "CACHE"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    scale.smoke_step(args)
  return args


def main(argv=None) -> dict:
  from benchmarks.cost import scale

  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.child:
    name, family, dynamics, seed, cache = args.child
    family, dynamics = (None if v == "-" else v for v in (family, dynamics))
    print(json.dumps(compile_with_cache(name, family, dynamics, int(seed), cache, args)))
    return {}
  started = time.perf_counter()
  args.out = speed_output(args, "compile_cache")
  flags = scale.step_arguments(args)
  results = []
  with tempfile.TemporaryDirectory(prefix="cola_compile_cache_") as cache:
    for name, family, dynamics in rows(args):
      temperature = args.temperature if family else 0.0
      record = {"name": name, "family": family, "dynamics": dynamics, "temperature": temperature}
      for outcome, seed in (("miss", 1), ("hit", 2)):
        child = ["--child", name, family or "-", dynamics or "-", str(seed), cache]
        record[outcome] = child_report("benchmarks.cost.compile_cache", [*flags, *child], f"{name}, {outcome}")
      results.append(record)
      miss, hit = record["miss"], record["hit"]
      print(
        f"{name:24s} compile CPU s: first {miss['compile_cpu_s']:6.2f} {miss['cache_events']}, "
        f"another seed {hit['compile_cpu_s']:6.2f} {hit['cache_events']}",
        flush=True,
      )
  config = {
    "smoke": args.smoke,
    "model": {"depth": args.depth, "width": args.width, "vocab": args.vocab, "scan": False},
    "batch": args.batch,
    "temperature": args.temperature,
    "families": args.families,
    "dynamics": args.dynamics,
  }
  return write_report(args.out, "compile_cache.json", argv, started, config, results=results)


if __name__ == "__main__":
  main()
