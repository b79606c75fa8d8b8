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

ONE_RUN_PARTS = ("retractions", "stiefel_projection")  # one run of a cost script each, its JSON kept as it is
# (name, results file, number per seed, better, claimed-better method, other method, what the paper says)
CLAIMS = (
  (
    "transformer_lm_5_seeds_stopped",
    "paper/transformer_lm_stopped.json",
    "min_valid_loss",
    "lower",
    "ccola_ud",
    "sgdm_h0.1_m0.8",
    "the same, from the 5-seed run stopped at the deadline, over the epochs both methods reached",
  ),
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


CURVES = {"min_valid_loss": ("valid_loss", np.min), "test_accuracy": ("test_accuracy", lambda rows, axis: rows[-1])}


def per_seed(entry: dict, number: str, upto: float) -> list:
  """Each seed's ``number`` over the evaluations up to epoch ``upto``: the lowest validation loss, or
  the test accuracy at the last of them (for a complete run, the entry's own ``number``)."""
  curve, reduce = CURVES[number]
  epochs = np.asarray(entry["history"]["epoch"], float)
  rows = records.nan_array(entry["history"][curve])[epochs <= upto]
  return reduce(rows, axis=0).tolist()


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
  low, high = float(out["difference_mean"] - half), float(out["difference_mean"] + half)
  verdict = "holds beyond the seed spread" if low > 0 else "reversed" if high < 0 else "within the seed spread"
  return {**out, "difference_std": sd, "difference_ci95": [low, high], "verdict": verdict}


def committed(path: str) -> dict | None:
  """The results JSON at ``path``, or None where there is none."""
  return records.load_json(path) if os.path.exists(path) else None


def compare(results_dir: str) -> dict:
  """Every claim whose results file holds both methods."""
  out = {}
  for name, path, key, better, claimed, other, says in CLAIMS:
    report = committed(os.path.join(results_dir, path))
    if not report or not {claimed, other} <= set(report["results"]):
      continue
    res, upto = report["results"], report["config"]["epochs_completed"]
    values = {m: per_seed(res[m], key, upto) for m in (claimed, other)}
    out[name] = {
      "paper": says,
      "file": path,
      "number": key,
      "better": better,
      "methods": [claimed, other],
      "seeds": report["seeds"],
      "status": report["status"],
      "epochs": upto,
      "values": values,
      **paired(values[claimed], values[other], better),
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


def new_parts(run_dir: str, done: list[dict], part: str, name: str, committed_path: str) -> tuple[list, list]:
  """The complete units ``done`` of ``part`` and their results files ``name``, less the seeds of each
  method that ``committed_path`` already holds (so that merging a run twice changes nothing)."""
  old = committed(committed_path) or {"seeds": [], "results": {}}
  units, paths = [], []
  for u in (u for u in done if u["part"] == part):
    report = records.load_json(unit_file(run_dir, u, name))
    if not (set(report["results"]) <= set(old["results"]) and set(report["seeds"]) <= set(old["seeds"])):
      units.append(u)
      paths.append(unit_file(run_dir, u, name))
  return units, paths


def unit_file(run_dir: str, unit: dict, name: str) -> str:
  return os.path.join(run_dir, unit["part"], unit["name"], name)


def append_logs(run_dir: str, units: list[dict], log_path: str) -> None:
  with open(log_path, "a") as log:
    for u in units:
      with open(unit_file(run_dir, u, "log")) as f:
        log.write(f.read())


def join_with_committed(join, committed: str, parts: list[str]) -> None:
  """``join(paths)`` of the committed results and ``parts``; the committed results alone replaced when
  they ran another protocol or older code (they stay in git history)."""
  try:
    join([committed, *parts] if os.path.exists(committed) else parts)
  except ValueError as error:
    print(f"the committed {committed} is replaced, not joined: {error}")
    join(parts)


def merge(run_dir: str, results_dir: str) -> dict:
  """Joins ``run_dir``'s complete units into ``results_dir`` and writes ``paper/claims.{json,png}``."""
  from benchmarks.cost import scale
  from benchmarks.paper import gpu_claims, orthogonal_cnn, transformer_lm

  paper, cost = os.path.join(results_dir, "paper"), os.path.join(results_dir, "cost")
  os.makedirs(paper, exist_ok=True)
  os.makedirs(cost, exist_ok=True)
  done = [u for u in records.load_json(os.path.join(run_dir, "gpu_claims.json"))["units"] if u["status"] == "complete"]
  lm_path = os.path.join(paper, "transformer_lm.json")
  units, parts = new_parts(run_dir, done, "transformer", "transformer_lm.json", lm_path)
  if units:
    join_with_committed(lambda paths: transformer_lm.main(["--merge", *paths, "--out", paper]), lm_path, parts)
    append_logs(run_dir, units, os.path.join(paper, "transformer_lm.log"))
  cnn_path = os.path.join(paper, "orthogonal_cnn_resnet18.json")
  units, parts = new_parts(run_dir, done, "resnet18", "orthogonal_cnn.json", cnn_path)
  if units:
    joined = os.path.join(run_dir, "resnet18", "joined")
    join_with_committed(lambda paths: orthogonal_cnn.merge(paths, joined), cnn_path, parts)
    for ext in ("json", "png"):
      shutil.copy(os.path.join(joined, f"orthogonal_cnn.{ext}"), os.path.join(paper, f"orthogonal_cnn_resnet18.{ext}"))
    append_logs(run_dir, units, os.path.join(paper, "orthogonal_cnn_resnet18.log"))
  measured = gpu_claims.done_scale_families(results_dir)
  scale_parts = [
    unit_file(run_dir, u, "scale.json") for u in done if u["part"] == "scale" and u["name"] not in measured
  ]
  if scale_parts:
    scale_path = os.path.join(cost, "scale.json")
    scale.main(["--merge", *([scale_path] if os.path.exists(scale_path) else []), *scale_parts, "--out", cost])
  for u in (u for u in done if u["part"] in ONE_RUN_PARTS):
    for path in glob.glob(unit_file(run_dir, u, "*.json")):
      shutil.copy(path, cost)
  shutil.copy(os.path.join(run_dir, "gpu_claims.json"), os.path.join(results_dir, "gpu_claims.json"))
  return write_claims(results_dir)


def write_claims(results_dir: str) -> dict:
  """``paper/claims.{json,png}`` from the results in ``results_dir``; prints each claim's verdict."""
  paper = os.path.join(results_dir, "paper")
  claims = compare(results_dir)
  records.write_json(os.path.join(paper, "claims.json"), {"claims": claims, "method": __doc__.split("\n\n")[1]})
  if claims:
    plot(claims, os.path.join(paper, "claims.png"))
  for name, c in claims.items():
    print(f"{name}: {c['claimed_mean']:.4f} vs {c['other_mean']:.4f} over seeds {c['seeds']}: {c['verdict']}")
  print(json.dumps({n: c["verdict"] for n, c in claims.items()}))
  return claims
