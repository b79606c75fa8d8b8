"""Sweeps over depth: the plot of a depth sweep and the join of runs that each did part of one."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Mapping, Sequence

import numpy as np

from . import report


def plot(results: dict, config: dict, labels: Mapping[str, str], path: str, suptitle: str) -> None:
  """Final test accuracy and training loss (mean +- std over seeds) against the depth, and the test
  accuracy during training at the largest depth, one colour per method of ``config["methods"]``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods, depths = config["methods"], config["depths"]
  fig, axes = plt.subplots(1, 3, figsize=(17, 5))
  for i, m in enumerate(methods):
    for ax, key, scale in ((axes[0], "test_accuracy", 100), (axes[1], "train_loss", 1)):
      stats = np.array([report.mean_std(results[m][str(d)][key]) for d in depths]) * scale
      ax.errorbar(
        np.array(depths) + 0.08 * (i - 1.5),
        stats[:, 0],
        yerr=stats[:, 1],
        marker="o",
        ms=4,
        capsize=3,
        color=f"C{i}",
        label=labels[m],
      )
    h = results[m][str(max(depths))]["history"]
    acc = report.nan_array(h["test_accuracy"]) * 100
    axes[2].plot(h["epoch"], np.nanmean(acc, 1), color=f"C{i}", label=labels[m])
    axes[2].fill_between(
      h["epoch"], *(np.nanmean(acc, 1) + s * np.nanstd(acc, 1) for s in (-1, 1)), color=f"C{i}", alpha=0.15
    )
  axes[0].set(
    xlabel="hidden layers p",
    ylabel="test accuracy (%)",
    title=f"after {config['epochs']} epochs (mean ± std, {config['seeds']} seeds)",
  )
  axes[1].set(xlabel="hidden layers p", ylabel="train loss (BCE)", title="final training loss")
  axes[1].axhline(np.log(2), color="k", lw=0.8, ls=":")
  axes[2].set(xlabel="epoch", ylabel="test accuracy (%)", title=f"during training, p = {max(depths)}")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=9)
  fig.suptitle(suptitle)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def merge(paths: Sequence[str], argv: list, labels: Mapping[str, str]) -> dict:
  """One sweep's JSON from runs of the same protocol that each did some of the methods (ordered as
  ``labels``) and depths; the machine and versions are the first run's, the command and date the merge's."""
  parts = [json.loads(pathlib.Path(path).read_text()) for path in paths]
  split = ("depths", "methods")
  fixed = {k: v for k, v in parts[0]["config"].items() if k not in split}
  results = {}
  for path, part in zip(paths, parts):
    if {k: v for k, v in part["config"].items() if k not in split} != fixed:
      raise SystemExit(f"--merge: {path} ran another protocol than {paths[0]}: {part['config']}")
    for m, by_depth in part["results"].items():
      if set(by_depth) & set(results.get(m, {})):
        raise SystemExit(f"--merge: {path} repeats a depth of {m} that another run did")
      results.setdefault(m, {}).update(by_depth)
  methods = [m for m in labels if m in results]
  depths = sorted({int(d) for m in methods for d in results[m]})
  missing = [f"{m} p={d}" for m in methods for d in depths if str(d) not in results[m]]
  if missing:
    raise SystemExit(f"--merge: no run did {', '.join(missing)}")
  runs = [{k: part[k] for k in ("command", "date", "machine", "wall_time_s", "methods", "depths")} for part in parts]
  return {
    **parts[0],
    "config": {**fixed, "depths": depths, "methods": methods},
    "methods": {m: labels[m] for m in methods},
    "depths": depths,
    "results": results,
    "merged_from": runs,
    **{k: v for k, v in report.provenance(argv, time.perf_counter()).items() if k in ("command", "argv", "date")},
    "wall_time_s": sum(run["wall_time_s"] for run in runs),
  }
