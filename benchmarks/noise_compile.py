#!/usr/bin/env python
"""Compile time of a noisy CoLA step with and without grouped noise, on the deep transformer of scale.py.

On XLA's CPU backend with one device, leaves that share a constraint, a shape
and a dtype draw their noise in one program for the group
(``cola_jax._shared_noise``). This script measures what that saves: for each
method, one process compiles SGD-m's training step and the method's noisy step
with the grouping on, another with it off (the two alternate), and the
process CPU time of ``lower(...).compile()`` is compared.

Usage::

  OPENBLAS_NUM_THREADS=1 python benchmarks/noise_compile.py            # results/noise_compile.json
  python benchmarks/noise_compile.py --methods ud_circle --depth 2      # a quick look
"""

import argparse
import json
import os
import resource
import sys
import time

from _common import child_report, write_report


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def compile_seconds(method: str, grouped: bool, depth: int) -> dict:
  """In this process: CPU seconds to compile SGD-m's step and ``method``'s noisy step (``dynamics_family``)."""
  import jax
  import scale
  from harness.transformer import TransformerLM

  import cola_jax as cola
  from cola_jax import transforms

  transforms._sharing_noise_pays = lambda: grouped
  dynamics, family = method.split("_", 1)
  model = TransformerLM(
    vocab_size=1024, d_model=512, n_heads=8, d_ff=2048, n_layers=depth, dropout=0.0, scan_layers=False
  )
  tokens = jax.random.randint(jax.random.key(2), (2, 64), 0, 1024)
  params = jax.jit(lambda k: model.init(k, tokens[:, :-1])["params"])(jax.random.key(0))
  seconds = {}
  for name in ("sgd_m", "sgd_m", f"{method}_noisy"):  # the first SGD-m compile pays the compiler's first use
    tx, constraints = scale.make_method(name, None if name == "sgd_m" else family, dynamics, 1e-6, False)
    start = params if constraints is None else cola.project_params(params, constraints)
    lowered = scale.training_step(model, tx).lower(start, tx.init(start), tokens)
    before = _cpu_seconds()
    lowered.compile()
    seconds[name] = _cpu_seconds() - before
  return {"sgd_m": seconds["sgd_m"], "noisy": seconds[f"{method}_noisy"]}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--methods", nargs="+", default=["ud_circle", "od_orthogonal"])
  parser.add_argument("--depth", type=int, default=12)
  parser.add_argument("--out", default="results/")
  parser.add_argument("--child", nargs=2, metavar=("METHOD", "GROUPED"), help=argparse.SUPPRESS)
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  started = time.perf_counter()
  if args.child:
    print(json.dumps(compile_seconds(args.child[0], args.child[1] == "on", args.depth)))
    return {}
  rows = []
  for method in args.methods:
    row = {"method": method}
    for grouped in ("off", "on"):
      row[grouped] = child_report(__file__, ["--depth", str(args.depth), "--child", method, grouped], method, 600)
      row[grouped]["ratio"] = row[grouped]["noisy"] / row[grouped]["sgd_m"]
    rows.append(row)
    off, on = row["off"], row["on"]
    print(
      f"{method:16s} compile CPU s, noisy / SGD-m: grouping off {off['noisy']:5.1f} / {off['sgd_m']:.1f}"
      f" = {off['ratio']:.2f}x, on {on['noisy']:5.1f} / {on['sgd_m']:.1f} = {on['ratio']:.2f}x",
      flush=True,
    )
  config = {
    "depth": args.depth,
    "width": 512,
    "vocab": 1024,
    "tokens": "2x64",
    "temperature": 1e-6,
    "blocks": "one module each (48 constrained kernels at depth 12)",
  }
  os.makedirs(args.out, exist_ok=True)
  return write_report(args.out, "noise_compile.json", argv, started, config, rows=rows)


if __name__ == "__main__":
  main()
