"""The summary, table and figure of ``muon.py``'s results JSON."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Mapping

import numpy as np

from benchmarks.harness.records import mean_std, write_json


def merge(path: str, labels: Mapping[str, str], update: Callable[[dict], object]) -> dict:
  """Reads the results JSON ``path`` (or starts one), applies ``update``, summarises and writes it back,
  under a lock: runs in other processes (the reference's) merge into the same file."""
  with open(path + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    results = {"schema_version": 1, "runs": [], "grid": {}}
    if os.path.exists(path):
      with open(path) as f:
        results = json.load(f)
    update(results)
    summarise(results, labels)
    write_json(path, results)
  return results


def replace_runs(results: dict, method: str, rows: list[dict], **fields) -> None:
  """The runs of ``method`` replaced by ``rows``; ``results[key][method] = value`` for each field."""
  results["runs"] = [r for r in results["runs"] if r["method"] != method] + rows
  for key, value in fields.items():
    results.setdefault(key, {})[method] = value


def summarise(results: dict, labels: Mapping[str, str]) -> None:
  """``results["summary"][method]``: learning rate, seeds, test accuracy (%) mean and std, ms/step, largest residual."""
  summary = {}
  for method in labels:
    rows = [r for r in results.get("runs", []) if r["method"] == method]
    if not rows:
      continue
    mean, std = mean_std([r["test_accuracy"] for r in rows])
    residuals = [r["residual"] for r in rows if r.get("residual") is not None]
    summary[method] = {
      "label": labels[method],
      "lr": rows[0]["lr"],
      "seeds": len(rows),
      "test_accuracy_mean": 100 * mean,
      "test_accuracy_std": 100 * std,
      "ms_per_step": float(np.median([r["ms_per_step"] for r in rows])),
      "max_residual": max(residuals) if residuals else None,
    }
  results["summary"] = summary


def table(results: dict, labels: Mapping[str, str]) -> str:
  """The summary as a Markdown table, in ``labels``' order."""
  lines = [
    "| method | lr | seeds | test accuracy | ms/step | max residual |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for method in labels:
    s = results.get("summary", {}).get(method)
    if s is None:
      continue
    res = "-" if s["max_residual"] is None else f"{s['max_residual']:.1e}"
    lines.append(
      f"| {s['label']} | {s['lr']:g} | {s['seeds']} | {s['test_accuracy_mean']:.2f} +- {s['test_accuracy_std']:.2f} % "
      f"| {s['ms_per_step']:.3g} | {res} |"
    )
  return "\n".join(lines)


def plot(path: str, results: dict, labels: Mapping[str, str]) -> None:
  """Test accuracy per method (each seed a dot, the mean a bar) and ms/step (log scale)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods = [m for m in labels if m in results.get("summary", {})]
  if not methods:
    return
  fig, (acc, cost) = plt.subplots(1, 2, figsize=(14, 0.5 * len(methods) + 2), sharey=True)
  means = [results["summary"][m]["test_accuracy_mean"] for m in methods]
  lo = min([v for v in means if v > 70] or means) - 2  # far lower means are written at the left edge
  for i, method in enumerate(methods):
    s = results["summary"][method]
    values = [100 * r["test_accuracy"] for r in results["runs"] if r["method"] == method]
    color = "C1" if method.startswith("reference") else "C0"
    if s["test_accuracy_mean"] < lo:
      acc.text(lo, i, f" {s['test_accuracy_mean']:.2f} +- {s['test_accuracy_std']:.2f} % (off scale)", va="center")
    else:
      acc.errorbar(s["test_accuracy_mean"], i, xerr=s["test_accuracy_std"], fmt="o", color=color, capsize=4)
      acc.plot(values, [i] * len(values), "k.", ms=4, alpha=0.6)
    cost.barh(i, s["ms_per_step"], color=color, alpha=0.6)
    ms = s["ms_per_step"]
    cost.text(ms, i, f" {ms:.0f}" if ms >= 100 else f" {ms:.3g}", va="center", fontsize=8)
  ticks = [f"{labels[m]} (lr {results['summary'][m]['lr']:g})" for m in methods]
  acc.set_yticks(range(len(methods)), ticks, fontsize=8)
  acc.invert_yaxis()
  acc.set(xlabel="test accuracy (%): mean +- std over seeds, dots: the seeds", xlim=(lo, max(means) + 1))
  cost.set(xlabel="ms/step (median, log scale)", xscale="log")
  for ax in (acc, cost):
    ax.grid(alpha=0.3, axis="x")
  fig.suptitle("Fashion-MNIST, bias-free MLP 784-128-64-10, batch 1024, 5 epochs (orange: the reference, torch)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
