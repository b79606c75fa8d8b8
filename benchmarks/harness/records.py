"""What a results file records and how it is written: the run's provenance (command, date, machine,
versions), JSON written whole, seeds' means, and the reports of child processes."""

import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time

import jax
import numpy as np
import optax

import cola_jax

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


def machine_info() -> dict:
  """Where a result was measured: platform, CPU, versions, thread settings, load."""
  info = {
    "platform": platform.platform(),
    "processor": platform.processor(),
    "machine": platform.machine(),
    "python": sys.version.split()[0],
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "cola_jax": cola_jax.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "device_kind": jax.devices()[0].device_kind,
    "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
  }
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    info["cpu_model"] = names[0] if names else None
  except OSError:
    pass
  try:
    info["loadavg_at_start"] = os.getloadavg()
  except OSError:
    pass
  return info


def finite_list(a):
  """A JSON-safe nested list: non-finite numbers become ``None``."""
  a = np.asarray(a, dtype=float)
  if a.ndim == 0:
    return None if not np.isfinite(a) else float(a)
  return [finite_list(v) for v in a]


def mean_std(values) -> tuple[float, float]:
  """Mean and standard deviation ignoring ``None``/NaN; NaNs when nothing is finite."""
  a = np.array([np.nan if v is None else v for v in values], dtype=float)
  if not np.any(np.isfinite(a)):
    return float("nan"), float("nan")
  return float(np.nanmean(a)), float(np.nanstd(a))


def mean_std_fields(entry: dict, keys) -> dict:
  """``{key}_mean`` and ``{key}_std`` over the seeds in ``entry[key]`` for each key,
  ``None`` where nothing is finite (JSON has no NaN)."""
  out = {}
  for key in keys:
    for suffix, value in zip(("_mean", "_std"), mean_std(entry[key])):
      out[key + suffix] = None if math.isnan(value) else value
  return out


def _launcher() -> list[str]:
  """How this process was started: ``-m module`` for a module run as a script, else ``sys.argv[0]``."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  return ["-m", spec.name] if spec is not None else sys.argv[:1]


def provenance(argv: list, start: float, packages: tuple = ()) -> dict:
  """What a results JSON records about its run: command line, date, machine,
  versions (jax, jaxlib, optax, numpy, cola_jax and ``packages``) and the wall
  time since ``start`` (a ``time.perf_counter()`` reading)."""
  names = ("jax", "jaxlib", *packages, "optax", "numpy", "cola_jax")
  return {
    "command": " ".join(shlex.quote(a) for a in [sys.executable, *_launcher(), *argv]),
    "argv": argv,
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine_info(),
    "versions": {name: __import__(name).__version__ for name in names},
    "wall_time_s": time.perf_counter() - start,
  }


def write_json(path: str, report: dict) -> None:
  """Writes ``report`` through a temporary file, so a reader (or a run that is
  interrupted) never finds half a file; NaN is refused, not written."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1, allow_nan=False)
  os.replace(tmp, path)


def nan_array(rows) -> np.ndarray:
  """Nested lists from a results JSON as floats, ``None`` read as NaN."""
  return np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=float)


def child_report(module: str, args: list[str], what: str, timeout_s: float = 900) -> dict:
  """Runs ``python -m module *args`` from the repository's root in a process of its own (a compile
  measured from a clean start) and returns its report, the last line of its stdout as JSON; a failed
  child is a RuntimeError naming ``what``, with the end of its stderr."""
  done = subprocess.run(
    [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPOSITORY
  )
  if done.returncode != 0:
    raise RuntimeError(f"{what}: the child process failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def write_report(out_dir: str, name: str, argv: list, started: float, config: dict, **body) -> dict:
  """``{"meta": provenance (with flax), "config": config, **body}`` written to ``out_dir/name`` and returned."""
  report = {"meta": provenance(argv, started, packages=("flax",)), "config": config, **body}
  path = os.path.join(out_dir, name)
  write_json(path, report)
  print(f"\nwrote {path}")
  return report


def load_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


AXES = ("epoch", "step")  # the evaluations' positions, the same in every run joined


def _join_values(values: list, counts: list[int], where: str):
  """Per-seed values of runs that split the seeds, joined: lists of one entry per seed concatenated,
  curves (one list of seed values per evaluation) joined row by row, the evaluations' epochs and
  steps and other values the runs share kept, numbers that differ (means over a run's seeds)
  averaged with the runs' seed counts as weights."""
  first, key = values[0], where.rsplit("/", 1)[-1]
  if isinstance(first, dict):
    return {k: _join_values([v[k] for v in values], counts, f"{where}/{k}") for k in first}
  if key in AXES:
    if any(v != first for v in values):
      raise ValueError(f"join_seeds: {where}: the runs were evaluated at different {key}s")
    return first
  if isinstance(first, list) and first and isinstance(first[0], list):
    return [[x for row in rows for x in row] for rows in zip(*values, strict=True)]
  if isinstance(first, list) and all(len(v) == c for v, c in zip(values, counts)):
    return [x for v in values for x in v]
  if all(v == first for v in values):
    return first
  if isinstance(first, (int, float)) and not isinstance(first, bool):
    return sum(v * c for v, c in zip(values, counts)) / sum(counts)
  raise ValueError(f"join_seeds: {where}: cannot tell how to join {type(first).__name__} values")


def join_seeds(parts: list[dict]) -> dict:
  """One results JSON from runs of one protocol that each ran some of the seeds (each method's
  ``results`` holding one value per seed), in seed order. The runs must agree on the data, the
  methods and the config but for the seeds and the epochs completed; their commands, dates and
  machines are kept in ``joined_from``."""
  parts = sorted(parts, key=lambda r: r["seeds"][0])
  seeds = [s for r in parts for s in r["seeds"]]
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"join_seeds: a seed is in more than one run: {seeds}")
  config_of = lambda r: {k: v for k, v in r["config"].items() if k not in ("seeds", "epochs_completed")}
  for r in parts[1:]:
    differs = sorted(
      k for k in {**config_of(parts[0]), **config_of(r)} if config_of(parts[0]).get(k) != config_of(r).get(k)
    )
    if differs or r["data"] != parts[0]["data"] or list(r["results"]) != list(parts[0]["results"]):
      raise ValueError(
        f"join_seeds: the runs differ in more than their seeds: {', '.join(differs) or 'data or methods'}"
      )
  counts = [len(r["seeds"]) for r in parts]
  return {
    **parts[0],
    "status": "complete" if all(r["status"] == "complete" for r in parts) else "running",
    "config": {
      **parts[0]["config"],
      "seeds": len(seeds),
      "epochs_completed": min(r["config"]["epochs_completed"] for r in parts),
    },
    "seeds": seeds,
    "results": {m: _join_values([r["results"][m] for r in parts], counts, m) for m in parts[0]["results"]},
    "command": " ; ".join(r["command"] for r in parts) + f"  ({len(parts)} runs, seeds joined)",
    "argv": [r["argv"] for r in parts],
    "date": max(r["date"] for r in parts),
    "wall_time_s": sum(r["wall_time_s"] for r in parts),
    "joined_from": [
      {k: r[k] for k in ("seeds", "command", "date", "machine", "versions", "wall_time_s")} for r in parts
    ],
  }
