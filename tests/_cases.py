"""Parametrisations whose quick suite keeps a few cases and runs the rest under ``slow`` or ``extended``."""

import pytest


def quick_or_slow(combinations, quick, ids=None) -> list:
  """A ``pytest.param`` per tuple of ``combinations``, marked slow unless it is in ``quick``.

  ``ids`` gives each case's id from its tuple (default: pytest's own).
  """
  return [
    pytest.param(*c, id=None if ids is None else ids(*c), marks=() if c in quick else pytest.mark.slow)
    for c in combinations
  ]


def quick_or_extended(combinations, quick, ids=None, extended=None) -> list:
  """As :func:`quick_or_slow`, the other cases marked ``extended`` (CI's step after the quick suite); with
  ``extended``, a collection of them, only those, the rest slow."""

  def marks(c):
    if c in quick:
      return ()
    return pytest.mark.extended if extended is None or c in extended else pytest.mark.slow

  return [pytest.param(*c, id=None if ids is None else ids(*c), marks=marks(c)) for c in combinations]
