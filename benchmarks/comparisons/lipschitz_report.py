"""The report of ``lipschitz.py``: a method's JSON entry from its seeds, the plot and the printed table."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.harness import records, report

KEYS = (
  "test_accuracy",
  "lipschitz_bound",
  "empirical_lipschitz_jacobian",
  "empirical_lipschitz_pairs",
  "max_layer_norm",
)


def entry(measured: list[dict], histories: list[dict], radii) -> dict:
  """A method's JSON entry from its seeds' measurements and histories: per-seed lists and their means."""
  out: dict[str, Any] = {k: [m[k] for m in measured] for k in KEYS}
  out["layer_norms"] = [m["layer_norms"] for m in measured]
  out["certified_accuracy"] = {f"{r:g}": [m["certified_accuracy"][i] for m in measured] for i, r in enumerate(radii)}
  out["summary"] = {
    **records.mean_std_fields(out, KEYS),
    "certified_accuracy": {
      r: dict(zip(("mean", "std"), records.mean_std(v))) for r, v in out["certified_accuracy"].items()
    },
  }
  out["history"] = {
    "epoch": histories[0]["epoch"],
    **{k: [list(values) for values in zip(*(h[k] for h in histories))] for k in ("train_loss", "test_accuracy")},
  }
  return out


def plot(out: dict, path: str) -> None:
  """Accuracy against the certified radius, the Lipschitz bound and the empirical constant, the cost ratios."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
  radii = out["config"]["radii"]
  names = list(out["results"])
  for i, (name, r) in enumerate(out["results"].items()):
    values = np.array([r["test_accuracy"], *(r["certified_accuracy"][f"{e:g}"] for e in radii)]) * 100
    axes[0].errorbar([0, *radii], values.mean(1), values.std(1), color=f"C{i}", marker="o", capsize=3, label=name)
  axes[0].set(xlabel="L2 radius (pixels in [0, 1]); 0: clean", ylabel="test accuracy (%)", ylim=(0, 100))
  axes[0].legend(fontsize=8)
  for j, (key, label) in enumerate(
    (("lipschitz_bound", "L: product of exact layer norms"), ("empirical_lipschitz_jacobian", "max Jacobian norm"))
  ):
    values = np.array([out["results"][n][key] for n in names])
    axes[1].bar(np.arange(len(names)) + 0.4 * (j - 0.5), values.mean(1), 0.4, yerr=values.std(1), label=label)
  axes[1].axhline(1, color="black", lw=0.8)
  axes[1].set(xticks=range(len(names)), xticklabels=names, yscale="log", ylabel="Lipschitz constant")
  axes[1].legend(fontsize=8)
  report.ratio_bars(axes[2], out["costs"], ("step", "compile_cpu"))
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)
  c = out["config"]
  fig.suptitle(
    f"MLP 784-{'-'.join(map(str, c['widths']))}, ReLU, on {out['data']['source']}: {c['epochs']} epochs, "
    f"batch {c['batch']}, {len(out['seeds'])} seeds"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def table(out: dict) -> str:
  radii = out["config"]["radii"]
  rows = []
  for name, r in out["results"].items():
    rows.append(
      [
        name,
        report.pm(r["test_accuracy"], 100, 1),
        *(report.pm(r["certified_accuracy"][f"{e:g}"], 100, 1) for e in radii),
        report.pm(r["lipschitz_bound"], digits=3),
        report.pm(r["empirical_lipschitz_jacobian"], digits=3),
        *report.ratio_cells(out["costs"], name, ("step", "compile_cpu")),
      ]
    )
  header = ["method", "clean %", *(f"cert {e:g} %" for e in radii), "L", "max |J|", "step", "compile"]
  return report.table(rows, header)
