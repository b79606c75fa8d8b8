#!/usr/bin/env python
"""Compile and step time of a noisy CoLA step by how its noise is lowered.

cola_jax draws its noise with a written-out Threefry hash (:mod:`cola_jax._noise`)
that XLA fuses into the kernels that consume the numbers. This script compiles,
in one process and in turn, the training step of ``benchmarks/scale.py``'s
transformer (``--depth`` blocks, width 512, batch 2 x 64 tokens) under:

* ``sgd_m``, and ``od_circle`` and ``ud_unit_norm`` at temperature 0: no noise;
* ``od_circle_noisy``, ``ud_unit_norm_noisy``: the written-out hash (the
  default), at temperature 1e-6; ``od_circle_noisy_again`` repeats the first
  at the end, a measure of the drift within the run;
* ``..._jaxrandom``: ``jax_threefry_partitionable`` off, under which cola_jax
  draws with ``jax.random`` (XLA writes out its Threefry rounds too);
* ``..._gpukernel``: that and ``jax_threefry_gpu_kernel_lowering`` on, under
  which ``jax.random``'s Threefry is, on GPU, a call of JAX's precompiled kernel
  (a custom call); on CPU the flag changes nothing;
* ``od_circle_noisy_kernel``: ``jax_threefry_gpu_kernel_lowering`` alone, in
  the default partitionable mode (cola_jax defers to ``jax.random`` under it).

SGD-m is compiled once before, uncounted (the compiler's first use). Reported
per variant: the compile's wall-clock and CPU seconds, the compiled program's
fusions, its ``xor`` operations (each copy of the hash has 20 rounds with one
xor each: how many copies XLA compiled) and custom calls, XLA's temporary
bytes, and the step's median time interleaved with SGD-m's.

Usage::

  python benchmarks/noise_lowering.py --out DIR                 # depth 3
  python benchmarks/noise_lowering.py --depth 1 --deadline 60   # stop before a variant after 60 s

Writes ``noise_lowering.json`` under ``--out`` after every variant: ``meta``,
``config``, ``rows`` (``name``, ``flags``, the harness's compile cost and pair
summary, ``xor_ops``, ``custom_calls``).
"""

import os
import pathlib
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp

import cola_jax as cola

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or loaded by path
import scale
from _common import provenance, write_json
from harness import report
from harness.timing import compile_cost, measure_pair, pair_summary, speed_parser

JAX_RANDOM = {"jax_threefry_partitionable": False}
GPU_KERNEL = {"jax_threefry_partitionable": False, "jax_threefry_gpu_kernel_lowering": True}
VARIANTS = (  # name, family, dynamics, temperature, JAX flags
  ("sgd_m", None, None, 0.0, {}),
  ("od_circle", "circle", "od", 0.0, {}),
  ("od_circle_noisy", "circle", "od", 1e-6, {}),
  ("od_circle_noisy_jaxrandom", "circle", "od", 1e-6, JAX_RANDOM),
  ("od_circle_noisy_gpukernel", "circle", "od", 1e-6, GPU_KERNEL),
  ("ud_unit_norm_noisy", "unit_norm", "ud", 1e-6, {}),
  ("ud_unit_norm_noisy_gpukernel", "unit_norm", "ud", 1e-6, GPU_KERNEL),
  ("ud_unit_norm", "unit_norm", "ud", 0.0, {}),
  ("od_circle_noisy_again", "circle", "od", 1e-6, {}),
  ("od_circle_noisy_kernel", "circle", "od", 1e-6, {"jax_threefry_gpu_kernel_lowering": True}),
)


def parse_args(argv=None):
  p = speed_parser(__doc__, "depth 1: a check that runs in seconds")
  p.add_argument("--depth", type=int, default=3, help="transformer blocks")
  p.add_argument("--deadline", type=float, default=None, help="seconds after which no further variant starts")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  started = time.perf_counter()
  if args.smoke:
    args.depth = 1
  args.out = report.output_dir(args.out or (None if args.smoke else "results/"), "noise_lowering")
  model = scale.transformer(scale.parse_args(["--depth", str(args.depth)]))
  tokens = jax.random.randint(jax.random.key(0), scale.batch_shape("2x64"), 0, model.vocab_size)
  params = jax.jit(lambda k: model.init(k, tokens[:, :-1])["params"])(jax.random.key(1))
  sgd_m = scale.make_method("sgd_m", None, None, 0.0, False)[0]
  baseline, _ = compile_cost(scale.training_step(model, sgd_m), params, sgd_m.init(params), tokens)
  defaults = {name: getattr(jax.config, name) for name in (*JAX_RANDOM, *GPU_KERNEL)}
  fresh = lambda tree: jax.tree.map(jnp.copy, tree)
  rows, path = [], os.path.join(args.out, "noise_lowering.json")
  config = {"depth": args.depth, "batch": "2x64", "temperature": 1e-6, "deadline_s": args.deadline}
  try:
    for name, family, dynamics, temperature, flags in VARIANTS:
      if args.deadline is not None and time.perf_counter() - started > args.deadline:
        print(f"deadline: stopped before {name}")
        break
      for flag, value in {**defaults, **flags}.items():
        jax.config.update(flag, value)
      tx, constraints = scale.make_method(name, family, dynamics, temperature, False)
      start = params if constraints is None else cola.project_params(params, constraints)
      compiled, cost = compile_cost(scale.training_step(model, tx), start, tx.init(start), tokens)
      text = compiled.as_text() or ""
      cost.update(xor_ops=text.count(" xor("), custom_calls=text.count("custom-call("))
      carries = ((fresh(start), fresh(tx.init(start)), tokens), (fresh(params), sgd_m.init(params), tokens))
      cost.update(pair_summary(*measure_pair((compiled, baseline), carries, 1, 30, 3.0)))
      rows.append({"name": name, "flags": flags, **cost})
      print(
        f"{name:30s} compile {cost['compile_s']:6.1f} s, {cost['compile_cpu_s']:6.1f} CPU s; fusions "
        f"{cost['fusions']}, xor {cost['xor_ops']}, custom calls {cost['custom_calls']}; temporaries "
        f"{cost['temp_bytes'] / 1e6:.0f} MB; step {cost['method_ms']:.2f} ms ({cost['ratio']:.2f}x sgd_m)"
      )
      write_json(path, {"meta": provenance(argv, started, packages=("flax",)), "config": config, "rows": rows})
  finally:  # JAX's flags as they were, an interrupted run too
    for flag, value in defaults.items():
      jax.config.update(flag, value)
  print(f"wrote {path}")
  return {"rows": rows}


if __name__ == "__main__":
  main()
