#!/usr/bin/env python
"""Where a step's compile time goes: XLA's HLO passes and its code generation, with noise and without.

For each variant, in a process of its own, the 12-block transformer of
scale.py (``--depth`` blocks) and a method's training step at 2 x 64 tokens:
the instructions of the program XLA receives (``lower(...).as_text("hlo")``,
and the ``xor`` among them: the written-out noise hashes), then its compile
under ``jax.profiler``, whose trace of XLA's own events splits the compile's
wall clock into the HLO passes (optimisation, fusion, layout, scheduling) and
the rest (each fusion's code generated and compiled by LLVM, the program
assembled). Also the compile's process CPU seconds, the compiled fusions and
XLA's temporary bytes.

Variants: SGD-m; CoLA-od and CoLA-ud on ``Circle(0.2)`` at temperature 0 and
with noise; with noise also ``one pass``: each group of same-shape leaves drawing
its noise in one pass (``cola_jax._shared_noise._ONE_PASS_BYTES`` unbounded),
where by default a group of large leaves draws one pass per member once its
gradient exists: fewer copies of the hash in the program, against holding the
group's noise at once.

Usage::

  OPENBLAS_NUM_THREADS=1 python benchmarks/compile_phases.py          # results/compile_phases.json, a few minutes
  python benchmarks/compile_phases.py --smoke                         # a 1-block width-32 model, a temporary folder

JSON keys: ``meta``, ``config``, ``results`` (one record per variant: ``name``,
``method``, ``one_pass``, ``hlo_instructions``, ``hlo_xor``, ``compile_cpu_s``,
``compile_s``, ``backend_s`` (XLA's compile and load, wall clock), ``hlo_passes_s``
(its HLO passes), ``codegen_s`` (the difference), ``fusions`` and ``compiled_xor``
(of the compiled program: a hash written into several kernels counts once in each),
``temp_bytes``).
"""

import argparse
import glob
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
from _common import child_report, write_report
from harness import report

# (name, method of scale.py, whether the groups draw in one pass)
VARIANTS = (
  ("sgd_m", "sgd_m", False),
  ("od_circle", "od_circle", False),
  ("od_circle_noisy", "od_circle_noisy", False),
  ("od_circle_noisy_one_pass", "od_circle_noisy", True),
  ("ud_circle", "ud_circle", False),
  ("ud_circle_noisy", "ud_circle_noisy", False),
  ("ud_circle_noisy_one_pass", "ud_circle_noisy", True),
)


def xla_event_seconds(trace_dir: str) -> dict:
  """Wall-clock seconds of XLA's compile and load, and of its HLO passes, from a profiler trace."""
  (path,) = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
  with gzip.open(path) as f:
    events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
  total = lambda prefix: sum(e["dur"] for e in events if e["name"].startswith(prefix)) / 1e6
  return {"backend_s": total("backend_compile_and_load"), "hlo_passes_s": total("HLO passes ")}


def measure(method: str, one_pass: bool, args) -> dict:
  """In this process: the program's size and its compile's phases."""
  import jax
  import scale

  from cola_jax import _shared_noise

  if one_pass:
    _shared_noise._ONE_PASS_BYTES = float("inf")
  dynamics, _, rest = method.partition("_")
  family = None if method == "sgd_m" else rest.removesuffix("_noisy")
  temperature = args.temperature if method.endswith("_noisy") else 0.0
  lowered = scale.lowered_step(args, method, family, dynamics, temperature)
  hlo = lowered.as_text(dialect="hlo")
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    jax.profiler.stop_trace()
    phases = xla_event_seconds(trace_dir)
  text = compiled.as_text() or ""
  return {
    "hlo_instructions": len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", hlo, flags=re.MULTILINE)),
    "hlo_xor": len(re.findall(r" xor\(", hlo)),
    "compile_cpu_s": cpu,
    "compile_s": wall,
    **phases,
    "codegen_s": phases["backend_s"] - phases["hlo_passes_s"],
    "fusions": len(re.findall(r" fusion\(", text)),
    "compiled_xor": len(re.findall(r" xor\(", text)),
    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
  }


def parse_args(argv=None):
  import scale

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true", help="a 1-block width-32 model: a check that runs in a minute")
  p.add_argument("--out", default=None, help="output directory (default: results/; --smoke: a new temporary folder)")
  scale.add_step_arguments(p)
  p.add_argument("--child", nargs=2, metavar=("METHOD", "ONE_PASS"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    scale.smoke_step(args)
  return args


def main(argv=None) -> dict:
  import scale

  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.child:
    print(json.dumps(measure(args.child[0], args.child[1] == "one_pass", args)))
    return {}
  started = time.perf_counter()
  args.out = report.output_dir(args.out or (None if args.smoke else "results/"), "compile_phases")
  flags = scale.step_arguments(args)
  results = []
  for name, method, one_pass in VARIANTS:
    child = ["--child", method, "one_pass" if one_pass else "default"]
    record = {"name": name, "method": method, "one_pass": one_pass, **child_report(__file__, [*flags, *child], name)}
    results.append(record)
    print(
      f"{name:26s} {record['hlo_instructions']:6d} HLO instructions ({record['hlo_xor']:5d} xor), "
      f"compile {record['compile_cpu_s']:5.1f} CPU s: HLO passes {record['hlo_passes_s']:4.1f} s, "
      f"codegen {record['codegen_s']:4.1f} s; {record['fusions']} fusions ({record['compiled_xor']} xor), "
      f"temporaries {record['temp_bytes'] / 1e6:6.1f} MB",
      flush=True,
    )
  config = {
    "smoke": args.smoke,
    "model": {"depth": args.depth, "width": args.width, "vocab": args.vocab, "scan": False},
    "batch": args.batch,
    "temperature": args.temperature,
  }
  return write_report(args.out, "compile_phases.json", argv, started, config, results=results)


if __name__ == "__main__":
  main()
