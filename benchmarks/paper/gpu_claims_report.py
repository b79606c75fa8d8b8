"""The GPU run's units joined with the committed results, and the claims compared seed by seed.

Part of :mod:`benchmarks.paper.gpu_claims`. A claim compares two methods on one number per seed
(the same seed: the same initialisation, data order and dropout). For the differences ``d_s``
(claimed-better minus other, signed so that a positive ``d`` favours the claim) it reports their
mean, sample standard deviation, the 95 % Student-t interval of the mean and how many seeds favour
the claim. The claim *holds beyond the seed spread* when that interval lies above zero, is
*reversed* when it lies below, and is *within the seed spread* otherwise.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
from scipy import stats

from benchmarks.harness import records

# (name, results file, number per seed, better, claimed-better method, other method, what the paper says)
CLAIMS = (
  (
    "transformer_lm",
    "paper/transformer_lm.json",
    "min_valid_loss",
    "lower",
    "ccola_ud",
    "sgdm_h0.1_m0.8",
    "c-CoLA-ud reaches a lower minimum validation loss than SGD-m (Table 1)",
  ),
  (
    "resnet18_vs_sgdm",
    "paper/orthogonal_cnn_resnet18.json",
    "test_accuracy",
    "higher",
    "ocola_ud",
    "sgdm",
    "o-CoLA-ud without weight decay ends above SGD-m without (Sec. 4, the ResNet figure)",
  ),
  (
    "resnet18_vs_sgdm_wd",
    "paper/orthogonal_cnn_resnet18.json",
    "test_accuracy",
    "higher",
    "ocola_ud",
    "sgdm_wd",
    "o-CoLA-ud against SGD-m with weight decay (the paper shows them close)",
  ),
)


def paired(claimed: list, other: list, better: str) -> dict:
  """The seed-by-seed comparison of two methods' numbers (one per seed, the same seeds)."""
  a, b = np.asarray(claimed, float), np.asarray(other, float)
  d = (a - b) if better == "higher" else (b - a)
  n = len(d)
  out = {
    "n_seeds": n,
    "claimed_mean": float(a.mean()),
    "claimed_std": float(a.std(ddof=1)) if n > 1 else None,
    "other_mean": float(b.mean()),
    "other_std": float(b.std(ddof=1)) if n > 1 else None,
    "differences": d.tolist(),
    "difference_mean": float(d.mean()),
    "seeds_favouring_claim": int(np.sum(d > 0)),
  }
  if n < 2:
    return {**out, "verdict": "one seed: cannot be told from the seed spread"}
  sd = float(d.std(ddof=1))
  half = float(stats.t.ppf(0.975, n - 1)) * sd / np.sqrt(n)
  low, high = out["difference_mean"] - half, out["difference_mean"] + half
  verdict = "holds beyond the seed spread" if low > 0 else "reversed" if high < 0 else "within the seed spread"
  return {**out, "difference_std": sd, "difference_ci95": [low, high], "verdict": verdict}


def compare(results_dir: str) -> dict:
  """Every claim whose results file holds both methods."""
  out = {}
  for name, path, key, better, claimed, other, says in CLAIMS:
    report = (
      records.load_json(os.path.join(results_dir, path)) if os.path.exists(os.path.join(results_dir, path)) else None
    )
    if not report or not {claimed, other} <= set(report["results"]):
      continue
    res = report["results"]
    out[name] = {
      "paper": says,
      "file": path,
      "number": key,
      "better": better,
      "methods": [claimed, other],
      "seeds": report["seeds"],
      "status": report["status"],
      "values": {m: res[m][key] for m in (claimed, other)},
      **paired(res[claimed][key], res[other][key], better),
    }
  return out


def plot(claims: dict, png_path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(claims), figsize=(4.5 * len(claims), 4), squeeze=False)
  for ax, (name, c) in zip(axes[0], claims.items()):
    values = np.array([c["values"][m] for m in c["methods"]], float)
    for s, seed in enumerate(c["seeds"]):
      ax.plot([0, 1], values[:, s], "o-", color="grey", alpha=0.6)
      ax.annotate(str(seed), (1.03, values[1, s]), fontsize=7)
    ax.plot([0, 1], values.mean(1), "s-", color="C3", lw=2, label="mean")
    ax.set_xticks([0, 1], c["methods"])
    ax.set_xlim(-0.3, 1.3)
    ax.set(title=f"{name}\n{c['verdict']}", ylabel=c["number"].replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("each seed's pair (same init, data order and dropout), lines join a seed's two methods", fontsize=9)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)


def complete_units(run_dir: str, part: str) -> list[dict]:
  """The plan's units of ``part`` that completed."""
  plan = records.load_json(os.path.join(run_dir, "gpu_claims.json"))
  return [u for u in plan["units"] if u["part"] == part and u["status"] == "complete"]


def unit_file(run_dir: str, unit: dict, name: str) -> str:
  return os.path.join(run_dir, unit["part"], unit["name"], name)


def append_logs(run_dir: str, units: list[dict], log_path: str) -> None:
  with open(log_path, "a") as log:
    for u in units:
      with open(unit_file(run_dir, u, "log")) as f:
        log.write(f.read())


def merge(run_dir: str, results_dir: str) -> dict:
  """Joins ``run_dir``'s complete units into ``results_dir`` and writes ``paper/claims.{json,png}``."""
  from benchmarks.cost import scale
  from benchmarks.paper import orthogonal_cnn, transformer_lm

  paper, cost = os.path.join(results_dir, "paper"), os.path.join(results_dir, "cost")
  os.makedirs(paper, exist_ok=True)
  os.makedirs(cost, exist_ok=True)
  lm_units = complete_units(run_dir, "transformer")
  if lm_units:
    parts = [unit_file(run_dir, u, "transformer_lm.json") for u in lm_units]
    committed = os.path.join(paper, "transformer_lm.json")
    try:
      transformer_lm.main(["--merge", *([committed] if os.path.exists(committed) else []), *parts, "--out", paper])
    except ValueError as error:  # the committed seeds ran another protocol: replaced
      print(f"the committed {committed} is replaced, not joined: {error}")
      transformer_lm.main(["--merge", *parts, "--out", paper])
    append_logs(run_dir, lm_units, os.path.join(paper, "transformer_lm.log"))
  cnn_units = complete_units(run_dir, "resnet18")
  if cnn_units:
    committed = os.path.join(paper, "orthogonal_cnn_resnet18.json")
    parts = [unit_file(run_dir, u, "orthogonal_cnn.json") for u in cnn_units]
    joined = os.path.join(run_dir, "resnet18", "joined")
    try:
      orthogonal_cnn.merge([committed, *parts] if os.path.exists(committed) else parts, joined)
    except ValueError as error:  # the committed seeds ran another protocol or older code: replaced
      print(f"the committed {committed} is replaced, not joined: {error}")
      orthogonal_cnn.merge(parts, joined)
    for ext in ("json", "png"):
      shutil.copy(os.path.join(joined, f"orthogonal_cnn.{ext}"), os.path.join(paper, f"orthogonal_cnn_resnet18.{ext}"))
    append_logs(run_dir, cnn_units, os.path.join(paper, "orthogonal_cnn_resnet18.log"))
  scale_units = complete_units(run_dir, "scale")
  if scale_units:
    committed = os.path.join(cost, "scale.json")
    parts = ([committed] if os.path.exists(committed) else []) + [
      unit_file(run_dir, u, "scale.json") for u in scale_units
    ]
    scale.main(["--merge", *parts, "--out", cost])
  for u in complete_units(run_dir, "retractions"):
    for path in glob.glob(unit_file(run_dir, u, "*.json")):
      shutil.copy(path, cost)
  shutil.copy(os.path.join(run_dir, "gpu_claims.json"), os.path.join(results_dir, "gpu_claims.json"))
  claims = compare(results_dir)
  records.write_json(os.path.join(paper, "claims.json"), {"claims": claims, "method": __doc__.split("\n\n")[1]})
  if claims:
    plot(claims, os.path.join(paper, "claims.png"))
  for name, c in claims.items():
    print(f"{name}: {c['claimed_mean']:.4f} vs {c['other_mean']:.4f} over seeds {c['seeds']}: {c['verdict']}")
  print(json.dumps({n: c["verdict"] for n, c in claims.items()}))
  return claims
