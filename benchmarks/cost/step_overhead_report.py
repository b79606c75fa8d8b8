"""The results of :mod:`benchmarks.cost.step_overhead`: records, targets, table and figure."""

from __future__ import annotations

import numpy as np

from benchmarks.cost.step_overhead_models import METHODS
from benchmarks.harness.timing import pair_summary, target_lines


def summarize(model, method, baseline, temperature, kind, t_method, t_base):
  return {
    "model": model,
    "method": method,
    "baseline": baseline,
    "temperature": temperature,
    "kind": kind,
    **pair_summary(t_method, t_base),
  }


def targets_from(results) -> list[dict]:
  def find(model, method, temperature_positive, kind):
    for r in results:
      if (
        r["model"] == model
        and r["method"] == method
        and r["kind"] == kind
        and (r["temperature"] > 0) == temperature_positive
      ):
        return r["ratio"]
    return None

  # The full-step limits are the speed issue's; the update's is an earlier one's.
  spec = [
    ("c_cola_ud update / SGD-m update, tau=0, mlp784", ("mlp784", "c_cola_ud", False, "update"), 2.0),
    ("c_cola_ud step / SGD-m step, tau=0, mlp784", ("mlp784", "c_cola_ud", False, "step"), 1.2),
    ("c_cola_ud step / SGD-m step, tau>0, mlp784", ("mlp784", "c_cola_ud", True, "step"), 1.6),
    ("o_cola_od step / SGD step, tau=0, spiral8x100", ("spiral8x100", "o_cola_od", False, "step"), 3.0),
  ]
  out = []
  for name, where, limit in spec:
    value = find(*where)
    out.append({"name": name, "value": value, "limit": limit, "met": None if value is None else bool(value <= limit)})
  return out


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  model_names = sorted({r["model"] for r in results}, key=[r["model"] for r in results].index)
  fig, axes = plt.subplots(1, len(model_names), figsize=(6.5 * len(model_names), 4.2), squeeze=False)
  series = [("update", False), ("update", True), ("step", False), ("step", True)]
  width = 0.2
  for ax, model in zip(axes[0], model_names):
    methods = [m for m in METHODS if any(r["model"] == model and r["method"] == m for r in results)]
    for j, (kind, noisy) in enumerate(series):
      values = []
      for m in methods:
        match = [
          r["ratio"]
          for r in results
          if r["model"] == model and r["method"] == m and r["kind"] == kind and (r["temperature"] > 0) == noisy
        ]
        values.append(match[0] if match else np.nan)
      xs = np.arange(len(methods)) + (j - 1.5) * width
      ax.bar(xs, values, width, label=f"{kind}, tau{'>0' if noisy else '=0'}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(methods)), methods)
    ax.set_yscale("log")
    ax.set_ylabel("time / baseline time (median)")
    ax.set_title(model)
    ax.legend(fontsize=8)
  fig.suptitle("CoLA step overhead vs SGD (od) / SGD-momentum (ud); i_cola_*: vs MaxNorm")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(results, state_bytes, targets) -> str:
  lines = [
    f"{'model':12s} {'method':10s} {'tau':>7s} {'kind':6s} {'method ms':>10s} "
    f"{'base ms':>9s} {'ratio':>7s} {'paired':>7s} {'n':>4s}"
  ]
  for r in results:
    lines.append(
      f"{r['model']:12s} {r['method']:10s} {r['temperature']:7.0e} {r['kind']:6s} "
      f"{r['method_ms']:10.3f} {r['baseline_ms']:9.3f} {r['ratio']:7.2f} "
      f"{r['ratio_of_paired']:7.2f} {r['repetitions']:4d}"
    )
  passes = [r for r in results if r.get("array_passes") and r["array_passes"]["method"]]
  if passes:
    lines.append("")
    lines.append(f"{'model':12s} {'method':10s} {'tau':>7s} arrays read+written by the update (method vs baseline)")
    for r in passes:
      m, b = r["array_passes"]["method"], r["array_passes"]["baseline"]
      lines.append(
        f"{r['model']:12s} {r['method']:10s} {r['temperature']:7.0e} "
        f"{m['reads']}+{m['writes']} vs {b['reads']}+{b['writes']}"
      )
  lines.append("")
  lines.append(f"{'model':12s} {'method':10s} {'state bytes':>12s} {'baseline':>10s} {'ratio':>6s}")
  for model, per in state_bytes.items():
    for m, b in per.items():
      ratio = f"{b['method'] / b['baseline']:6.2f}" if b["baseline"] else "   n/a"
      lines.append(f"{model:12s} {m:10s} {b['method']:12d} {b['baseline']:10d} {ratio}")
  lines.append("")
  lines.extend(target_lines(targets))
  return "\n".join(lines)
