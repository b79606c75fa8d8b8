"""The results of :mod:`benchmarks.cost.scale`: its rows, targets, tables, figure, and the merge of runs."""

from __future__ import annotations

import json
import time

import numpy as np

from benchmarks.harness import report
from benchmarks.harness.records import provenance

FAMILIES = ("circle", "box", "sphere", "unit_norm", "orthogonal", "implicit", "non_negative")
DYNAMICS = ("od", "ud")
BASELINES = ("sgd_m", "adam")
TOP_KEYS = ("meta", "config", "params_bytes", "results", "targets")
RESULT_KEYS = ("name", "family", "dynamics", "temperature", "state_bytes", "small", "large")
BATCH_KEYS = ("compile_s", "compile_cpu_s", "temp_bytes", "method_ms", "baseline_ms", "ratio")
STEP_LIMITS = {"orthogonal": 1.5}  # the others: 1.25


def compile_ratio(record: dict, sgd_m: dict) -> float:
  """A method's compile CPU time at the small batch over SGD-m's in the same process (a merged
  record carries its own run's as ``sgd_m_compile_cpu_s``)."""
  small = record["small"]
  return small["compile_cpu_s"] / small.get("sgd_m_compile_cpu_s", sgd_m["small"]["compile_cpu_s"])


def targets_from(results, params_bytes: int) -> list[dict]:
  by_name = {r["name"]: r for r in results}
  if not set(BASELINES) <= set(by_name):
    return []
  adam = by_name["adam"]
  adam_memory = adam["state_bytes"] + adam["small"]["temp_bytes"]
  out = []
  for r in results:
    if r["family"] is None:
      continue
    memory = r["state_bytes"] + r["small"]["temp_bytes"]
    limit = STEP_LIMITS.get(r["family"], 1.25)
    if r["temperature"] > 0:
      ratio = compile_ratio(r, by_name["sgd_m"])
      out.append({"name": f"{r['name']} compile CPU time / sgd_m's", "value": ratio, "limit": 2.0, "met": ratio <= 2.0})
    memory_limit = (adam_memory + params_bytes) / 1e6
    out.append(
      {
        "name": f"{r['name']} state + temporaries (MB) / Adam's + parameters'",
        "value": memory / 1e6,
        "limit": round(memory_limit, 1),
        "met": memory / 1e6 <= memory_limit,
      }
    )
    ratio = r["large"]["ratio"]
    out.append(
      {"name": f"{r['name']} large-batch step / sgd_m's", "value": ratio, "limit": limit, "met": ratio <= limit}
    )
  return out


def table(results, params_bytes: int) -> str:
  sgd = next(r for r in results if r["name"] == "sgd_m")
  header = (
    "method",
    "tau",
    "compile CPU s",
    "x sgd_m",
    "state MB",
    "temp MB",
    "small ms",
    "x sgd_m",
    "large ms",
    "x sgd_m",
  )
  lines = []
  for r in results:
    s, big = r["small"], r["large"]
    lines.append(
      (
        r["name"],
        f"{r['temperature']:g}",
        f"{s['compile_cpu_s']:.1f}",
        f"{compile_ratio(r, sgd):.2f}",
        f"{r['state_bytes'] / 1e6:.0f}",
        f"{s['temp_bytes'] / 1e6:.0f}",
        f"{s['method_ms']:.0f}",
        f"{s['ratio']:.2f}",
        f"{big['method_ms']:.0f}",
        f"{big['ratio']:.2f}",
      )
    )
  return f"parameters: {params_bytes / 1e6:.1f} MB\n" + report.table(lines, header)


def markdown(report_: dict) -> str:
  """The results of a report as a Markdown table, ratios to SGD-m's (compile CPU time, step times)."""
  results = report_["results"]
  sgd = next(r for r in results if r["name"] == "sgd_m")
  lines = [
    "| method | tau | compile CPU s | x sgd_m | state MB | temporaries MB | step 2x64 x sgd_m | step 8x128 x sgd_m |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in results:
    s, big = r["small"], r["large"]
    lines.append(
      f"| {r['name']} | {r['temperature']:g} | {s['compile_cpu_s']:.1f} | "
      f"{compile_ratio(r, sgd):.2f} | {r['state_bytes'] / 1e6:.0f} | "
      f"{s['temp_bytes'] / 1e6:.0f} | {s['ratio']:.2f} | {big['ratio']:.2f} |"
    )
  return "\n".join(lines)


def plot(results, params_bytes: int, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [r["name"] for r in results]
  sgd = results[[r["name"] for r in results].index("sgd_m")]
  adam = results[[r["name"] for r in results].index("adam")]
  panels = [
    ("compile CPU time / SGD-m's", [compile_ratio(r, sgd) for r in results], 2.0),
    (
      "state + temporaries (MB)",
      [(r["state_bytes"] + r["small"]["temp_bytes"]) / 1e6 for r in results],
      (adam["state_bytes"] + adam["small"]["temp_bytes"] + params_bytes) / 1e6,
    ),
    ("large-batch step / SGD-m's", [r["large"]["ratio"] for r in results], 1.25),
  ]
  fig, axes = plt.subplots(1, 3, figsize=(18, 0.28 * len(names) + 1.5))
  colours = ["C2" if r["family"] is None else "C1" if r["temperature"] > 0 else "C0" for r in results]
  for ax, (title, values, limit) in zip(axes, panels):
    ax.barh(np.arange(len(names)), values, color=colours)
    ax.axvline(limit, color="k", ls=":", lw=1)
    ax.set_yticks(np.arange(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title)
  fig.suptitle("Blue: temperature 0; orange: temperature > 0; green: optax. Dotted: the issue's limit")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def merged(paths: list[str], argv: list) -> dict:
  """One report from runs of one protocol that each measured some families or dynamics: each run's
  methods, with its SGD-m's compile CPU time for their ratios; the optax rows, machine and versions
  of the first run; the command and date of the merge."""
  parts = []
  for path in paths:
    with open(path) as f:
      parts.append(json.load(f))
  split = ("families", "dynamics", "complete")
  fixed = {k: v for k, v in parts[0]["config"].items() if k not in split}
  results, names = [], set()
  for index, (path, part) in enumerate(zip(paths, parts)):
    if {k: v for k, v in part["config"].items() if k not in split} != fixed:
      raise SystemExit(f"--merge: {path} ran another protocol than {paths[0]}")
    sgd_m = next((r for r in part["results"] if r["name"] == "sgd_m"), None)
    if sgd_m is None:
      raise SystemExit(f"--merge: {path} has no sgd_m row (stopped before its first method?)")
    for r in part["results"]:
      if r["family"] is None and index > 0:
        continue
      if r["name"] in names:
        raise SystemExit(f"--merge: {path} repeats {r['name']}, which another run measured")
      names.add(r["name"])
      small = {**r["small"], "sgd_m_compile_cpu_s": sgd_m["small"]["compile_cpu_s"]}
      results.append({**r, "small": small})
  order = {(None, None): 0, **{(f, d): 1 + i for i, (f, d) in enumerate((f, d) for f in FAMILIES for d in DYNAMICS)}}
  results.sort(key=lambda r: (r["family"] is not None, r["temperature"] == 0, order[r["family"], r["dynamics"]]))
  merged_from = [{k: part["meta"][k] for k in ("command", "date", "machine", "wall_time_s")} for part in parts]
  now = provenance(argv, time.perf_counter())
  return {
    "meta": {
      **parts[0]["meta"],
      **{k: now[k] for k in ("command", "argv", "date")},
      "wall_time_s": sum(run["wall_time_s"] for run in merged_from),
    },
    "config": {
      **fixed,
      "families": [f for f in FAMILIES if any(r["family"] == f for r in results)],
      "dynamics": [d for d in DYNAMICS if any(r["dynamics"] == d for r in results)],
      "complete": all(part["config"]["complete"] for part in parts),
    },
    "params_bytes": parts[0]["params_bytes"],
    "results": results,
    "targets": targets_from(results, parts[0]["params_bytes"]),
    "merged_from": merged_from,
  }
