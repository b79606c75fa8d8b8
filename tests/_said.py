"""The UserWarnings that cola_jax says, told apart from others' by the stack they are said from.

cola_jax's warnings point at the user's line, so their filename does not tell
them apart; the frames that said them do.
"""

import contextlib
import os
import pathlib
import sys
import warnings

import cola_jax

PACKAGE = str(pathlib.Path(cola_jax.__file__).parent) + os.sep


def _from_cola() -> bool:
  frame = sys._getframe()
  while frame is not None:
    if frame.f_code.co_filename.startswith(PACKAGE):
      return True
    frame = frame.f_back
  return False


@contextlib.contextmanager
def cola_warnings():
  """Within: a list of the UserWarnings (``warnings.WarningMessage``) that cola_jax says, each as often as said.

  Other warnings are shown as usual.
  """
  said = []
  with warnings.catch_warnings():
    warnings.simplefilter("always", UserWarning)
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
      if issubclass(category, UserWarning) and _from_cola():
        said.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
      else:
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    yield said
