"""The flags every reproduction script shares."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def parser(
  description: str,
  *,
  seeds: int,
  epochs: int,
  out: str,
  smoke: str,
  eval_every: float | None = None,
  eval_every_type=int,
  eval_every_help: str | None = None,
) -> argparse.ArgumentParser:
  """A parser with ``--seeds``, ``--epochs``, ``--eval-every`` (default ``eval_every``; None: about
  epochs/20; ``eval_every_type``/``eval_every_help`` for another meaning), ``--out``, ``--smoke``,
  ``--quiet``; every default shown by ``--help``."""
  default_text = "; default about epochs/20" if eval_every is None else ""
  p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--seeds", type=int, default=seeds, help="number of seeds, 0..seeds-1")
  p.add_argument("--epochs", type=int, default=epochs, help="training epochs")
  p.add_argument(
    "--eval-every",
    type=eval_every_type,
    default=eval_every,
    help=eval_every_help or f"epochs between evaluations (must divide --epochs){default_text}",
  )
  p.add_argument(
    "--out",
    default=None,
    help=f"output folder for the JSON and PNG; default {out} (a --smoke run: a new temporary folder)",
  )
  p.add_argument("--smoke", action="store_true", help=f"a tiny run for tests: {smoke}")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  return p


def merge_flag(p: argparse.ArgumentParser, help_text: str) -> None:
  """``--merge JSON [JSON ...]``: join the reports of runs that each did part of one protocol."""
  p.add_argument("--merge", nargs="+", metavar="JSON", help=help_text)


def first_seed_flag(p: argparse.ArgumentParser) -> None:
  """``--first-seed S``: the run's seeds are S .. S + seeds - 1, so that runs can split the seeds."""
  p.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1")


def seed_list(p: argparse.ArgumentParser, args) -> list[int]:
  """The seeds ``--first-seed`` and ``--seeds`` name."""
  if args.first_seed < 0:
    p.error("--first-seed must be non-negative")
  return list(range(args.first_seed, args.first_seed + args.seeds))


def eval_every(p: argparse.ArgumentParser, epochs: int, requested) -> int:
  """``requested`` if it divides ``epochs``, else the largest divisor of ``epochs`` up to epochs/20."""
  if epochs < 1:
    p.error("--epochs must be positive")
  if requested is None:
    requested = max(1, epochs // 20)
    while epochs % requested:
      requested -= 1
  elif requested < 1 or epochs % requested:
    p.error("--eval-every must be a positive divisor of --epochs")
  return requested


def int_list(text: str) -> list[int]:
  """``"1-10"``, ``"1,3,5"`` or a mix such as ``"1-3,8"``, as a sorted list of positive integers."""
  values = []
  for part in filter(None, (s.strip() for s in text.split(","))):
    lo, _, hi = part.partition("-")
    try:
      values.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected integers such as 1-10 or 1,3,5; got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers such as 1-10 or 1,3,5; got {text!r}")
  return sorted(set(values))


def choices(allowed):
  """A parser of a comma list of names from ``allowed``, kept in ``allowed``'s order."""

  def parse(text: str) -> tuple:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
      raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(allowed)}")
    return tuple(n for n in allowed if n in names)

  return parse


def method_list(p: argparse.ArgumentParser, names: str, extra: Sequence[str] = (), check: Callable = str) -> tuple:
  """The comma list ``names``, then ``extra``, without repeats; ``check(name)`` raising ValueError on a
  name is a usage error with its message."""
  methods = tuple(dict.fromkeys([m.strip() for m in names.split(",") if m.strip()] + list(extra)))
  for m in methods:
    try:
      check(m)
    except ValueError as error:
      p.error(str(error))
  return methods
