"""Parametrisations whose quick suite keeps a few cases and runs the rest under ``slow``."""

import pytest


def quick_or_slow(combinations, quick, ids=None) -> list:
  """A ``pytest.param`` per tuple of ``combinations``, marked slow unless it is in ``quick``.

  ``ids`` gives each case's id from its tuple (default: pytest's own).
  """
  return [
    pytest.param(*c, id=None if ids is None else ids(*c), marks=() if c in quick else pytest.mark.slow)
    for c in combinations
  ]
