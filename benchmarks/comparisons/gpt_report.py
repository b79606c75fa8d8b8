"""The report of ``gpt.py``: the loss curves and cost ratios as a plot, and the printed table."""

from __future__ import annotations

from benchmarks.harness import records, report


def plot(out: dict, path: str) -> None:
  """Validation and training loss against the step (mean ± sd over seeds), and the cost ratios to Adam."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
  for i, (name, r) in enumerate(out["results"].items()):
    history = r["history"]
    for ax, key in zip(axes, ("valid_loss", "train_loss")):
      values = records.nan_array(history[key])[1:]  # the first evaluation, at initialisation, trained nothing
      mean, sd = values.mean(axis=1), values.std(axis=1)
      ax.plot(history["step"][1:], mean, color=f"C{i}", label=out["methods"][name])
      ax.fill_between(history["step"][1:], mean - sd, mean + sd, color=f"C{i}", alpha=0.2)
  for ax, what in zip(axes, ("validation", "training (mean over each chunk)")):
    ax.set(xlabel="step", ylabel=f"{what} loss (nats/character)")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  report.ratio_bars(axes[2], out["costs"], ("step", "compile_cpu", "memory"))
  c = out["config"]
  fig.suptitle(
    f"GPT {c['model']['blocks']}x{c['model']['width']}, {c['model']['heads']} heads, on {out['data']['source']}: "
    f"batch {c['batch']} x {c['length']} characters, {c['steps']} steps, {len(out['seeds'])} seeds"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def table(out: dict) -> str:
  rows = []
  for name, r in out["results"].items():
    worst = r["residual"] and max(r["residual"])
    rows.append(
      [
        name,
        report.pm(r["final_valid_loss"]),
        report.pm(r["final_train_loss"]),
        *report.ratio_cells(out["costs"], name, ("step", "compile_cpu", "memory")),
        "-" if worst is None else f"{worst:.1e}",
      ]
    )
  header = ["method", "final valid loss", "final train loss", "step", "compile", "memory", "residual"]
  return report.table(rows, header)
