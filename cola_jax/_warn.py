"""Warnings about a setup: one per misuse, said once, at the user's line.

The checks that warn (the default rule's choice of leaves, a constraint's
default view of a 3-D leaf) run while a driver resolves a tree, leaf by leaf.
The driver gathers what they report (:func:`gather`) and says each misuse
once: the leaves with the same misuse in one warning, which names the first
few and counts the rest. Outside a driver a warning is said at once.

Every warning points at the first frame outside cola_jax and the libraries
that call into it (jax's tracing, optax's combinators, Flax's and Equinox's
wrappers): the line of the user's that called ``init``.
"""

import contextvars
import os
import sys
import warnings
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")

_SHOWN = 3  # the leaves a warning names before it counts the rest
_CALLERS = ("cola_jax", "jax", "jaxlib", "optax", "flax", "equinox", "chex", "blackjax")

Compose = Callable[[str, int], str]  # (the leaves named, how many there are) -> the message


def named(leaves: list[str]) -> str:
  """The first few of ``leaves`` and a count of the rest: ``a, b, c and 94 more``."""
  rest = len(leaves) - _SHOWN
  return ", ".join(leaves[:_SHOWN]) + (f" and {rest} more" if rest > 0 else "")


def _internal() -> tuple[str, ...]:
  """The directories of cola_jax and of the imported libraries that call into it."""
  files = [getattr(sys.modules.get(name), "__file__", None) for name in _CALLERS]
  return tuple(os.path.dirname(file) + os.sep for file in files if file)


def _say(message: str) -> None:
  internal = _internal()
  frame, level = sys._getframe(), 1  # stacklevel 1 is this frame
  while frame.f_back is not None and frame.f_code.co_filename.startswith(internal):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, UserWarning, stacklevel=level)


class _Gathered:
  """The misuses reported while a driver resolves a tree: per misuse, its message and its leaves in order."""

  def __init__(self):
    self.misuses: dict[Hashable, tuple[Compose, list[str]]] = {}

  def add(self, key: Hashable, leaf: str, compose: Compose) -> None:
    self.misuses.setdefault(key, (compose, []))[1].append(leaf)

  def messages(self) -> list[str]:
    return [compose(named(leaves), len(leaves)) for compose, leaves in self.misuses.values()]


_GATHERING: contextvars.ContextVar[_Gathered | None] = contextvars.ContextVar("cola_jax_gathering", default=None)


def warn_about(key: Hashable, leaf: str, compose: Compose) -> None:
  """Warns that ``leaf`` meets the misuse ``key``, in ``compose``'s words.

  While a driver gathers, the leaves with the same ``key`` make one message,
  ``compose(named(leaves), len(leaves))``.
  """
  gathering = _GATHERING.get()
  if gathering is None:
    _say(compose(leaf, 1))
  else:
    gathering.add(key, leaf, compose)


def warn(message: str) -> None:
  """Warns ``message``: a misuse of the whole tree, said once per driver."""
  warn_about(message, "", lambda *_: message)


def gather(resolve: Callable[[], T], said: set[str] | None) -> T:
  """``resolve()``, whose warnings are said when it returns, each misuse once.

  ``said``: the messages this driver said before, which are not said again
  (the new ones are added); None drops them all (a tree resolved at an
  update, whose misuses init said).
  """
  gathering = _Gathered()
  token = _GATHERING.set(gathering)
  try:
    resolved = resolve()
  finally:
    _GATHERING.reset(token)
  if said is not None:
    for message in gathering.messages():
      if message not in said:
        said.add(message)
        _say(message)
  return resolved
