"""Results: per-method JSON entries, the printed table, curves as a PNG, progress bars, output folders."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np

from .records import (  # noqa: F401
  finite_list,
  mean_std,
  mean_std_fields,
  nan_array,
  provenance,
  write_json,
)

CURVES = ("test_accuracy", "test_loss", "train_accuracy", "train_loss")


def entry(history: Mapping[str, np.ndarray], finals: Sequence[str] = ()) -> dict:
  """A method's JSON entry from its history (name -> ``(evals, seeds)``): the last evaluation of
  each curve and of ``finals``, the best test accuracy and lowest test loss over the evaluations,
  and the curves themselves under ``"history"``."""
  out = {k: finite_list(history[k][-1]) for k in (*CURVES, *finals)}
  out["best_test_accuracy"] = finite_list(np.nanmax(history["test_accuracy"], axis=0))
  out["min_test_loss"] = finite_list(np.nanmin(history["test_loss"], axis=0))
  out["history"] = {"epoch": list(history["epoch"]), **{k: finite_list(history[k]) for k in CURVES}}
  return out


def summary(
  entry_: dict,
  keys=("test_accuracy", "test_loss", "best_test_accuracy", "min_test_loss", "train_accuracy", "train_loss"),
) -> dict:
  """``{key}_mean``/``{key}_std`` over the seeds of each key of a method's entry."""
  return mean_std_fields(entry_, [k for k in keys if k in entry_])


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
  """A plain-text table, the first column left-aligned and the others right-aligned."""
  widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
  line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
  return "\n".join([line(header), "-" * len(line(header)), *map(line, rows)])


def pm(values, scale: float = 1.0, digits: int = 3) -> str:
  """``"mean ± std"`` of the seeds' values."""
  mean, std = mean_std(values)
  return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def ratio_cells(costs: Mapping[str, dict], name: str, kinds: Sequence[str]) -> list[str]:
  """Method ``name``'s ``ratios`` of ``kinds`` in ``costs`` to two decimals; ``"1"`` for Adam, which has none."""
  ratios = costs.get(name, {}).get("ratios", {})
  return [f"{ratios[k]:.2f}" if k in ratios else "1" for k in kinds]


def ratio_bars(ax, costs: Mapping[str, dict], kinds: Sequence[str]) -> None:
  """On ``ax``, a group of bars per method of ``costs``: its ``ratios`` of ``kinds`` to Adam's, a line at 1."""
  names, width = list(costs), 0.8 / len(kinds)
  for j, kind in enumerate(kinds):
    offset = width * (j - (len(kinds) - 1) / 2)
    ax.bar(np.arange(len(names)) + offset, [costs[n]["ratios"][kind] for n in names], width, label=kind)
  ax.axhline(1, color="black", lw=0.8)
  ax.set(xticks=range(len(names)), xticklabels=names, ylabel="ratio to Adam (same process)")
  ax.legend(fontsize=8)


def plot_curves(
  path: str,
  panels: Sequence[tuple[str, str]],
  results: Mapping[str, dict],
  labels: Mapping[str, str],
  title: str,
  log_y: Sequence[str] = (),
  marks: Sequence[float] = (),
  references: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
  """One panel per ``(history key, y label)``: each method's mean over seeds against the epoch,
  with a band of one standard deviation; a dotted vertical line at each epoch of ``marks``;
  ``references[key][method]``, e.g. a published value, as a dotted horizontal line."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
  for ax, (key, ylabel) in zip(axes[0], panels):
    for i, (method, res) in enumerate(results.items()):
      h = res["history"]
      values = nan_array(h[key]) * (100 if "accuracy" in key else 1)
      mean, std = np.nanmean(values, axis=1), np.nanstd(values, axis=1)
      ax.plot(h["epoch"], mean, color=f"C{i}", label=labels.get(method, method))
      ax.fill_between(h["epoch"], mean - std, mean + std, color=f"C{i}", alpha=0.15)
      if method in (references or {}).get(key, {}):
        ax.axhline(references[key][method], color=f"C{i}", ls=":", lw=1)
    ax.set(
      xlabel="epoch", ylabel=ylabel + (" (%)" if "accuracy" in key else ""), yscale="log" if key in log_y else "linear"
    )
    for epoch in marks:
      ax.axvline(epoch, color="black", ls=":", lw=0.8)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=9)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def progress(total: int, quiet: bool, unit: str = "chunk"):
  """A tqdm bar over ``total`` chunks, or other ``unit``s (silent with ``quiet``)."""
  from tqdm.auto import tqdm

  return tqdm(total=total, unit=unit, disable=quiet, dynamic_ncols=True)


def output_dir(out: str | None, prefix: str) -> str:
  """``out`` (created if missing), or a new temporary folder when ``out`` is None."""
  if out is None:
    return tempfile.mkdtemp(prefix=prefix + "-")
  os.makedirs(out, exist_ok=True)
  return out
