"""The paper's GPU-scale claims at 5 seeds, and the GPU cost table, inside a deadline, resumable.

A lent GPU comes for minutes at a time. This script runs the GPU work in priority order, each unit a
child process of its own script writing into ``OUT/<part>/<unit>/`` as it goes:

1. ``transformer``: the transformer LM (:mod:`benchmarks.paper.transformer_lm`), the paper's 200
   epochs on the KJV Bible, c-CoLA-ud and SGD-m (h = 0.1, momentum 0.8), 5 seeds per method trained
   together (``vmap`` over seeds), one process per method, both at once;
2. ``resnet18``: ResNet-18 on the 60,000 Fashion-MNIST training images, 12 epochs
   (:mod:`benchmarks.paper.orthogonal_cnn`), o-CoLA-ud, SGD-m and SGD-m + weight decay, one process
   per seed, ``--resnet-processes`` of them at once;
3. ``scale``: the 12-block cost table (:mod:`benchmarks.cost.scale`), one process per constraint
   family not yet measured;
4. ``retractions``: the Newton-Schulz (matrix-sign) polar against the eigendecomposition polar and QR
   (:mod:`benchmarks.cost.retractions`);
5. ``stiefel_projection``: the Stiefel projection's solvers and same-shape leaves stacked under ``vmap``
   (:mod:`benchmarks.cost.stiefel_projection`): whether stacking pays on the GPU, as the library assumes
   off CPU.

Seed ``s`` fixes the initialisation and the data order (and dropout) for every method, so the
methods are compared seed by seed. Units already in the committed results (``--results``) are not
run again; a unit starts only when its estimated time fits before the deadline, and a unit still
running at the deadline is stopped (its script has written what it had after each evaluation).
``OUT/gpu_claims.json`` records every unit: command, status, wall time, machine. ``--merge OUT``
then joins the complete units with the committed results and writes the claims' paired comparison
(:mod:`benchmarks.paper.gpu_claims_report`). Usage::

    python -m benchmarks.paper.gpu_claims --data-dir data --deadline 530 --out OUT   # on the GPU
    python -m benchmarks.paper.gpu_claims --merge OUT                                # here, then commit
    python -m benchmarks.paper.gpu_claims --smoke --deadline 300                     # a CPU rehearsal

``data/`` holds ``kjv.txt`` (``bible -f "gen1:1-rev22:21"``) and ``fashion-mnist/`` (Debian's
``dataset-fashion-mnist`` IDX files).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.harness import records, report
from benchmarks.paper import gpu_claims_report, orthogonal_cnn

ONE_RUN_PARTS, committed = gpu_claims_report.ONE_RUN_PARTS, gpu_claims_report.committed
PARTS = ("transformer", "resnet18", "scale", *ONE_RUN_PARTS)
SEEDS = 5
LM_EPOCHS, LM_METHODS = 200, ("ccola_ud", "sgdm_h0.1_m0.8")
RESNET = {"epochs": 12, "n_train": 60_000}
SCALE_FAMILIES = ("circle", "box", "sphere", "unit_norm", "orthogonal", "implicit", "non_negative")
SCALE_TIMING = ("--repetitions", "50", "--budget", "5")
# Seconds a unit is expected to take on an H100 (committed runs: ResNet-18 406 s for a seed of three
# methods; the scale table 255 s for three methods): a unit starts only when this much time is left.
ESTIMATES = {"transformer": 0.0, "resnet18": 420.0, "scale": 420.0, "retractions": 150.0, "stiefel_projection": 150.0}
SMOKE_ESTIMATE = 0.0
STOP_GRACE_S = 10.0


@dataclasses.dataclass
class Unit:
  """One child process: ``python -m module *args``, started with the units of the same ``group``."""

  part: str
  name: str
  module: str
  args: list
  group: str
  estimate_s: float
  status: str = "pending"
  wall_s: float | None = None
  returncode: int | None = None


def done_lm_seeds(results_dir: str, epochs: int) -> dict:
  """Method -> the seeds the committed transformer results hold at ``epochs`` epochs."""
  out = committed(os.path.join(results_dir, "paper", "transformer_lm.json"))
  if not out or out["status"] != "complete" or out["config"]["epochs"] != epochs:
    return {}
  return {m: set(out["seeds"]) for m in out["results"]}


def done_resnet_seeds(results_dir: str, protocol: dict) -> set:
  """The committed seeds of ``protocol`` run with today's constraints (a run of older code is redone)."""
  out = committed(os.path.join(results_dir, "paper", "orthogonal_cnn_resnet18.json"))
  protocol = {**protocol, "constraints": repr(orthogonal_cnn.ORTHOGONAL)}
  if not out or out["status"] != "complete" or any(out["config"].get(k) != v for k, v in protocol.items()):
    return set()
  return set(out["seeds"])


def done_scale_families(results_dir: str) -> set:
  out = committed(os.path.join(results_dir, "cost", "scale.json"))
  rows = {(r["family"], r["dynamics"], r["temperature"] > 0) for r in (out or {}).get("results", [])}
  return {f for f in SCALE_FAMILIES if all((f, d, noisy) in rows for d in ("od", "ud") for noisy in (True, False))}


def plan(args) -> list[Unit]:
  """The units still to run, in priority order."""
  units: list[Unit] = []
  estimate = (lambda part: SMOKE_ESTIMATE) if args.smoke else ESTIMATES.__getitem__
  if "transformer" in args.parts:
    size = ["--smoke"] if args.smoke else ["--epochs", str(LM_EPOCHS)]
    done = done_lm_seeds(args.results, 3 if args.smoke else LM_EPOCHS)
    for m in LM_METHODS:
      missing = sorted(set(range(args.seeds)) - done.get(m, set()))
      for group in args.seed_groups or consecutive(missing):
        if not set(group) <= done.get(m, set()):
          seeds = ["--seeds", str(len(group)), "--first-seed", str(group[0])]
          lm_args = [*size, *seeds, "--methods", m, "--data-dir", args.data_dir, "--quiet"]
          name = f"{m}_seeds{group[0]}-{group[-1]}"
          units.append(
            Unit(
              "transformer", name, "benchmarks.paper.transformer_lm", lm_args, "transformer", estimate("transformer")
            )
          )
  if "resnet18" in args.parts:
    protocol = {"epochs": 2, "n_train": 256} if args.smoke else RESNET
    size = ["--synthetic", "--n-test", "256", "--batch-size", "64", "--width", "4"] if args.smoke else []
    fashion = os.path.join(args.data_dir, "fashion-mnist")
    missing = sorted(set(range(args.seeds)) - done_resnet_seeds(args.results, protocol))
    for i, seed in enumerate(missing):
      cnn_args = ["--model", "resnet18", "--dataset", "fashion_mnist", "--data-dir", fashion, "--quiet"]
      cnn_args += [*size, *(f"--{k.replace('_', '-')}={v}" for k, v in protocol.items())]
      cnn_args += ["--seeds", "1", "--first-seed", str(seed)]
      units.append(
        Unit(
          "resnet18",
          f"seed{seed}",
          "benchmarks.paper.orthogonal_cnn",
          cnn_args,
          f"resnet18_{i // args.resnet_processes}",
          estimate("resnet18"),
        )
      )
  if "scale" in args.parts:
    timing = ["--smoke"] if args.smoke else ["--quiet", *SCALE_TIMING]
    measured = done_scale_families(args.results)
    for family in (f for f in SCALE_FAMILIES if f not in measured):
      units.append(
        Unit("scale", family, "benchmarks.cost.scale", [*timing, "--families", family], family, estimate("scale"))
      )
  for part in ONE_RUN_PARTS:
    if part in args.parts and not committed(os.path.join(args.results, "cost", f"{part}.json")):
      smoke = ["--smoke"] if args.smoke else []
      units.append(Unit(part, "all", f"benchmarks.cost.{part}", smoke, part, estimate(part)))
  return units


def unit_dir(out: str, unit: Unit) -> str:
  return os.path.join(out, unit.part, unit.name)


def command(unit: Unit, out: str) -> list[str]:
  return [sys.executable, "-m", unit.module, *unit.args, "--out", unit_dir(out, unit)]


def stop(process: subprocess.Popen) -> None:
  """SIGTERM to the child's process group, SIGKILL after a grace period."""
  try:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(STOP_GRACE_S)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
  except ProcessLookupError:
    pass


def run_group(units: Sequence[Unit], out: str, deadline: float, env: dict) -> None:
  """Starts ``units`` at once and waits for them; stops those still running at ``deadline``."""
  with contextlib.ExitStack() as logs:
    running = []
    for unit in units:
      os.makedirs(unit_dir(out, unit), exist_ok=True)
      log = logs.enter_context(open(os.path.join(unit_dir(out, unit), "log"), "w"))
      log.write("# " + " ".join(command(unit, out)) + "\n")
      log.flush()
      process = subprocess.Popen(
        command(unit, out),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=records.REPOSITORY,
        start_new_session=True,
      )
      unit.status = "running"
      running.append((unit, process, time.monotonic()))
    for unit, process, started in running:
      try:
        unit.returncode = process.wait(max(0.0, deadline - time.monotonic()))
        unit.status = "complete" if unit.returncode == 0 else "failed"
      except subprocess.TimeoutExpired:
        stop(process)
        unit.status = "stopped at the deadline"
      unit.wall_s = round(time.monotonic() - started, 1)


def write_plan(out: str, units: Sequence[Unit], argv: list, start: float, args) -> None:
  records.write_json(
    os.path.join(out, "gpu_claims.json"),
    {
      "deadline_s": args.deadline,
      "units": [{**dataclasses.asdict(u), "command": " ".join(command(u, out))} for u in units],
      **records.provenance(argv, start),
    },
  )


def run(args, argv: list) -> list[Unit]:
  start, started = time.monotonic(), time.perf_counter()
  deadline = start + args.deadline
  units = plan(args)
  os.makedirs(args.out, exist_ok=True)
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
  write_plan(args.out, units, argv, started, args)
  groups = list(dict.fromkeys(u.group for u in units))
  for group in groups:
    members = [u for u in units if u.group == group]
    left = deadline - time.monotonic()
    if left < max(u.estimate_s for u in members) or left <= 0:
      for u in members:
        u.status = f"not started: {left:.0f} s left, estimated {u.estimate_s:.0f} s"
    else:
      print(f"{time.monotonic() - start:6.0f} s  starting {group}: {', '.join(u.name for u in members)}", flush=True)
      run_group(members, args.out, deadline, env)
      for u in members:
        print(f"{time.monotonic() - start:6.0f} s  {u.part} {u.name}: {u.status} ({u.wall_s} s)", flush=True)
    write_plan(args.out, units, argv, started, args)
  return units


def consecutive(seeds: Sequence[int]) -> list[list[int]]:
  """Sorted ``seeds`` as runs of consecutive seeds: ``[0, 1, 3]`` -> ``[[0, 1], [3]]``."""
  groups: list[list[int]] = []
  for s in seeds:
    if groups and s == groups[-1][-1] + 1:
      groups[-1].append(s)
    else:
      groups.append([s])
  return groups


def seed_groups(p: argparse.ArgumentParser, text: str | None) -> list[list[int]] | None:
  """``"0-3,4"`` -> ``[[0, 1, 2, 3], [4]]``; None stays None (the seeds missing from the committed results)."""
  if text is None:
    return None
  groups = []
  for part in filter(None, (t.strip() for t in text.split(","))):
    lo, _, hi = part.partition("-")
    try:
      groups.append(list(range(int(lo), int(hi or lo) + 1)))
    except ValueError:
      p.error(f"--seed-groups: expected groups such as 0-3,4; got {text!r}")
  if not groups or any(not g or g[0] < 0 for g in groups):
    p.error(f"--seed-groups: expected non-empty groups of non-negative seeds such as 0-3,4; got {text!r}")
  return groups


def parse_args(argv):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--deadline", type=float, default=530.0, help="seconds from the start; units still running then stop")
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}, in priority order")
  p.add_argument("--seeds", type=int, default=SEEDS, help="seeds per method, 0..seeds-1")
  p.add_argument(
    "--seed-groups",
    help="the transformer's seeds as groups of consecutive seeds, one process per method and group, all at once "
    "(e.g. 0-3,4); a group is run unless the committed results hold it (default: the seeds they lack, "
    "each run of consecutive seeds a group)",
  )
  p.add_argument(
    "--resnet-processes",
    type=int,
    default=5,
    help="ResNet-18 seeds run at once, one process each (o-CoLA-ud's step waits on the host for its projection's "
    "loop: processes side by side fill the GPU's idle time)",
  )
  p.add_argument("--data-dir", default="data", help="folder holding kjv.txt and fashion-mnist/")
  p.add_argument("--results", default="results/gpu", help="committed GPU results: what is there is not run again")
  p.add_argument("--out", help="the run's folder (default: a new temporary folder)")
  p.add_argument("--smoke", action="store_true", help="tiny units on synthetic data: a rehearsal of the whole run")
  p.add_argument("--merge", metavar="OUT", help="join OUT's complete units with --results, write the comparison")
  args = p.parse_args(argv)
  args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
  unknown = sorted(set(args.parts) - set(PARTS))
  if unknown:
    p.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
  if min(args.seeds, args.resnet_processes) < 1 or not args.deadline > 0:
    p.error("--seeds, --resnet-processes and --deadline must be positive")
  args.seed_groups = seed_groups(p, args.seed_groups)
  return args


def main(argv: Sequence[str] | None = None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.merge:
    return gpu_claims_report.merge(args.merge, args.results)
  args.out = args.out or report.output_dir(None, "gpu_claims")
  units = run(args, argv)
  print(f"wrote {os.path.join(args.out, 'gpu_claims.json')}")
  return units


if __name__ == "__main__":
  main()
