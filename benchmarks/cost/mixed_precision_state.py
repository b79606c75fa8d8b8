#!/usr/bin/env python
"""Optimizer state bytes of every CoLA method on a bfloat16 (and a float32) transformer.

The model is the 12-layer, width-512 transformer language model of
:mod:`harness.transformer` (8 heads, feed-forward 2048, vocabulary 1024:
38.9M parameters, the layers stacked by ``nn.scan``), every layer kernel
(``layers/.../kernel``, shapes ``(12, in, out)``) under one constraint family,
the embedding, decoder, biases and LayerNorms free. Per parameter dtype and
method, the state's bytes are summed from the shapes and dtypes of
``jax.eval_shape(tx.init, params)`` (nothing is allocated or compiled; a PRNG
key counts as its key data), split into float32 bytes and the rest, and given
as a multiple of the parameters' bytes, beside ``optax.sgd(momentum=0.9)`` and
``optax.adam`` on the same parameters (whose states take the parameters' dtype).
The per-unit families treat each layer's column as a unit (``axis=-2``).

Usage::

    python -m benchmarks.cost.mixed_precision_state             # writes results/cost/mixed_precision_state.json
    python -m benchmarks.cost.mixed_precision_state --out /tmp  # elsewhere
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import optax

import cola_jax as cola
from benchmarks.harness import transformer
from benchmarks.harness.records import provenance, write_json

MODEL = {"vocab_size": 1024, "d_model": 512, "n_heads": 8, "d_ff": 2048, "n_layers": 12, "dropout": 0.0}
KERNELS = r"^layers/.*/kernel$"


def unit_ball(w):
  return jnp.sum(w * w) - 1.0


FAMILIES = {
  "Circle(0.2)": cola.Circle(0.2),
  "Box(-0.2, 0.2)": cola.Box(-0.2, 0.2),
  "NonNegative()": cola.NonNegative(),
  "Sphere(1, axis=-2)": cola.MaxNorm(1.0, axis=-2),  # the key of the committed results, from before the rename
  "UnitNorm(1, axis=-2)": cola.UnitNorm(1.0, axis=-2),
  "Implicit(sum(w_j^2) <= 1, axis=-2)": cola.Implicit(inequality=unit_ball, axis=-2),
  "Orthogonal(rows 1, columns 2)": cola.Orthogonal(row_axes=1, column_axes=2),
}


def transforms(param_dtype) -> dict:
  """Name -> transformation: the optax baselines, then cola_od and cola_ud for every family."""
  key = jax.random.key(0)
  out = {"optax.sgd(0.01, momentum=0.9)": optax.sgd(0.01, momentum=0.9), "optax.adam(1e-3)": optax.adam(1e-3)}
  for name, family in FAMILIES.items():
    constraints = cola.path_constraints([(KERNELS, family)])
    out[f"cola_od, {name}"] = cola.cola_od(0.1, constraints=constraints, temperature=1e-6, key=key)
    out[f"cola_ud, {name}"] = cola.cola_ud(0.1, friction=1.0, constraints=constraints, temperature=1e-6, key=key)
    if param_dtype == jnp.bfloat16:
      out[f"cola_ud, {name}, accumulator_dtype=bfloat16"] = cola.cola_ud(
        0.1, friction=1.0, constraints=constraints, temperature=1e-6, key=key, accumulator_dtype=jnp.bfloat16
      )
  return out


def leaf_bytes(leaf) -> int:
  if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.eval_shape(jax.random.key_data, leaf)
  return math.prod(leaf.shape) * leaf.dtype.itemsize


def measure(param_dtype) -> dict:
  model = transformer.TransformerLM(**MODEL)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, param_dtype), params)
  param_bytes = sum(leaf_bytes(p) for p in jax.tree.leaves(params))
  rows = []
  for name, tx in transforms(param_dtype).items():
    leaves = jax.tree.leaves(jax.eval_shape(tx.init, params))
    total = sum(leaf_bytes(leaf) for leaf in leaves)
    float32 = sum(leaf_bytes(leaf) for leaf in leaves if leaf.dtype == jnp.float32)
    rows.append({"method": name, "state_bytes": total, "float32_bytes": float32, "x_params": total / param_bytes})
    print(f"  {name:58s} {total / 2**20:8.1f} MiB  {total / param_bytes:5.2f} x params", flush=True)
  return {"param_dtype": jnp.dtype(param_dtype).name, "param_bytes": param_bytes, "rows": rows}


def table(report: dict) -> str:
  """The Markdown table of the guide: MiB and multiples of each model's parameter bytes."""
  by_dtype = {entry["param_dtype"]: entry for entry in report["results"]}
  bf16, f32 = by_dtype["bfloat16"], by_dtype["float32"]
  f32_rows = {row["method"]: row for row in f32["rows"]}
  lines = [
    f"| method | bfloat16 parameters ({bf16['param_bytes'] / 2**20:.1f} MiB): state | of which float32 | "
    f"float32 parameters ({f32['param_bytes'] / 2**20:.1f} MiB): state |",
    "| --- | --- | --- | --- |",
  ]
  for row in bf16["rows"]:
    other = f32_rows.get(row["method"])
    f32_cell = f"{other['state_bytes'] / 2**20:.1f} MiB ({other['x_params']:.2f}x)" if other else "-"
    lines.append(
      f"| {row['method']} | {row['state_bytes'] / 2**20:.1f} MiB ({row['x_params']:.2f}x) | "
      f"{row['float32_bytes'] / 2**20:.1f} MiB | {f32_cell} |"
    )
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="results/cost", help="folder of mixed_precision_state.json")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  results = []
  for dtype in (jnp.bfloat16, jnp.float32):
    print(f"{jnp.dtype(dtype).name} parameters:", flush=True)
    results.append(measure(dtype))
  report = {"model": MODEL, "constrained": KERNELS, "results": results}
  report["meta"] = provenance(sys.argv[1:] if argv is None else list(argv), start, packages=("flax",))
  print(table(report))
  os.makedirs(args.out, exist_ok=True)
  write_json(os.path.join(args.out, "mixed_precision_state.json"), report)
  return report


if __name__ == "__main__":
  main()
