"""Language-model results: a method's JSON entry (minimum validation loss), the table with perplexities, the plot.

The first evaluation of a run is at initialisation; minima are taken over the
later ones, per seed, and the test loss is read at each seed's minimum.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import models, records, report
from .lm import LMRun

MAX_ABS = "max_abs_w_"  # probes named max_abs_w_<group> are reported as max_abs_weight[group]
KEYS = ("min_valid_loss", "final_valid_loss", "test_loss_at_min_valid", "final_train_loss")


def max_abs(groups: Mapping[str, str]):
  """A probe ``params -> {"max_abs_w_<group>": max |w|}`` over the leaves whose path (``"decoder/kernel"``)
  the regular expression ``groups[group]`` finds (the first group that does)."""

  def probe(params) -> dict:
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      name = models.param_path(path)
      if group := next((g for g, pattern in groups.items() if re.search(pattern, name)), None):
        found[MAX_ABS + group] = jnp.maximum(found.get(MAX_ABS + group, 0.0), jnp.max(jnp.abs(leaf)))
    return found

  return probe


def entry(run: LMRun) -> dict:
  """A method's JSON entry: minimum, final and initial losses per seed, the curves, the timing."""
  if len(run.steps) < 2:
    return {}
  stack = {k: np.stack(v) for k, v in run.history.items()}
  valid, test = stack["valid_loss"], stack["test_loss"]
  epochs = np.array(run.steps) / run.steps_per_epoch
  best = 1 + np.argmin(np.where(np.isfinite(valid[1:]), valid[1:], np.inf), axis=0)
  seeds = np.arange(valid.shape[1])
  return {
    "min_valid_loss": report.finite_list(valid[best, seeds]),
    "min_valid_loss_epoch": [round(float(e), 4) for e in epochs[best]],
    "final_valid_loss": report.finite_list(valid[-1]),
    "test_loss_at_min_valid": report.finite_list(test[best, seeds]),
    "final_test_loss": report.finite_list(test[-1]),
    "final_train_loss": report.finite_list(stack["train_loss"][-1]),
    "valid_loss_at_init": report.finite_list(valid[0]),
    "max_abs_weight": {k[len(MAX_ABS) :]: report.finite_list(v[-1]) for k, v in stack.items() if k.startswith(MAX_ABS)},
    "history": {
      "step": list(run.steps),
      "epoch": [round(float(e), 4) for e in epochs],
      **{k: report.finite_list(stack[k]) for k in ("valid_loss", "test_loss", "train_loss")},
    },
    "compile_time_s": run.compile_s,
    "run_time_s": run.run_s,
    "time_per_epoch_s": (run.run_s - run.init_eval_s) * run.steps_per_epoch / max(1, run.steps[-1]),
  }


def summary(entry_: dict) -> dict:
  """``{key}_mean``/``{key}_std`` over the seeds of the minimum, final and test-at-minimum losses."""
  return report.mean_std_fields(entry_, KEYS)


def table(results: Mapping[str, dict], labels: Mapping[str, str], published: Mapping[str, float]) -> str:
  """Per method: minimum validation loss (mean ± std, perplexity, epochs), final, test at minimum, published."""
  rows = [
    [
      labels[m],
      report.pm(r["min_valid_loss"]),
      f"{math.exp(report.mean_std(r['min_valid_loss'])[0]):.1f}",
      "/".join(str(e) for e in r["min_valid_loss_epoch"]),
      report.pm(r["final_valid_loss"]),
      report.pm(r["test_loss_at_min_valid"]),
      f"{published[m]:.2f}" if m in published else "-",
    ]
    for m, r in results.items()
  ]
  header = ["method", "min valid loss", "(ppl)", "at epoch", "final valid loss", "test loss at min", "published min"]
  return report.table(rows, header)


def show(out: Mapping, png_path: str, labels: Mapping[str, str], published: Mapping[str, float]) -> None:
  """Draws the validation and training loss of a results JSON ``out`` against the epoch (mean ± std over
  seeds; published minima dotted) and prints its table."""
  config, info = out["config"], out["data"]
  results = {m: r for m, r in out["results"].items() if r}
  title = (
    f"Transformer LM on {config['corpus_used']} ({info['tokens']['train']:,} train tokens, vocab "
    f"{info['vocab_size']:,}), batch {config['batch_size']} x bptt {config['bptt']}, {config['seeds']} seed(s), "
    f"{config['epochs_completed']} of {config['epochs']} epochs" + (" — SYNTHETIC DATA" if info["synthetic"] else "")
  )
  with warnings.catch_warnings():  # the training loss is NaN at initialisation (nothing trained yet)
    warnings.simplefilter("ignore", RuntimeWarning)
    report.plot_curves(
      png_path,
      [("valid_loss", "validation loss (nats/token)"), ("train_loss", "training loss (dropout on)")],
      results,
      labels,
      title,
      references={"valid_loss": {m: published[m] for m in results if m in published}},
    )
  print(table(results, labels, published))


def merge(reports: Sequence[dict]) -> dict:
  """One results JSON from runs of the same protocol that split the methods (e.g. one process per
  method on a GPU), the seeds (``--first-seed``), or both: the runs of the same seeds joined by
  :func:`merge_methods`, then the seeds joined (:func:`harness.records.join_seeds`)."""
  by_seeds: dict[tuple, list] = {}
  for r in reports:
    by_seeds.setdefault(tuple(r["seeds"]), []).append(r)
  joined = [merge_methods(sorted(group, key=lambda r: r["config"]["methods"])) for group in by_seeds.values()]
  if len(joined) == 1:
    return joined[0]
  out = records.join_seeds(joined)
  out["summary"] = {m: summary(r) for m, r in out["results"].items() if r}
  return out


def merge_methods(reports: Sequence[dict]) -> dict:
  """One results JSON from runs of the same protocol and seeds with different methods: results,
  summaries and method names joined, commands and argv listed."""
  if len(reports) == 1:
    return reports[0]
  first = reports[0]
  config_of = lambda r: {k: v for k, v in r["config"].items() if k not in ("methods", "epochs_completed")}
  for r in reports[1:]:
    differs = sorted(k for k in {**config_of(first), **config_of(r)} if config_of(first).get(k) != config_of(r).get(k))
    if differs or r["data"] != first["data"] or r["seeds"] != first["seeds"]:
      raise ValueError(f"merge: the runs differ in more than their methods: {', '.join(differs) or 'data or seeds'}")
  methods = [m for r in reports for m in r["config"]["methods"]]
  if len(set(methods)) != len(methods):
    raise ValueError(f"merge: a method is in more than one run: {methods}")
  return {
    **first,
    "status": "complete" if all(r["status"] == "complete" for r in reports) else "running",
    "config": {
      **first["config"],
      "methods": methods,
      "epochs_completed": min(r["config"]["epochs_completed"] for r in reports),
    },
    **{key: {k: v for r in reports for k, v in r[key].items()} for key in ("methods", "results", "summary")},
    "command": " ; ".join(r["command"] for r in reports) + f"  ({len(reports)} processes, merged)",
    "argv": [r["argv"] for r in reports],
    "wall_time_s": max(r["wall_time_s"] for r in reports),
  }


def load(paths: Sequence[str], merged_dir: str | None, name: str) -> tuple[dict, str]:
  """A results JSON to redraw: ``paths[0]`` (returned with its folder), or the runs of ``paths`` merged
  and written as ``merged_dir/name``."""
  reports = [records.load_json(path) for path in paths]
  if merged_dir is None:
    return reports[0], os.path.dirname(os.path.abspath(paths[0]))
  out = merge(reports)
  report.write_json(os.path.join(report.output_dir(merged_dir, ""), name), out)
  return out, merged_dir
