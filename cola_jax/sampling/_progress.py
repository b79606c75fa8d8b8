"""A tqdm bar advanced from inside a compiled chain by ``jax.debug.callback``: it reads the step counter only."""

import jax

UPDATES = 100  # the bar is told about the chain's progress about this many times per run


class _Bar:
  """The host side: one tqdm bar per run of the compiled chain, made at its first step and closed at its last."""

  def __init__(self, total: int, tqdm):
    self.total, self.tqdm, self.bar = total, tqdm, None

  def __call__(self, done):
    done = int(done)
    if self.bar is None or (done < self.bar.n and self.bar.n == self.total):  # a new run of the same program
      self.bar = self.tqdm(total=self.total, unit="step")
    if done > self.bar.n:  # a repeated report (vmap over a batched counter) moves nothing
      self.bar.update(done - self.bar.n)
    if done == self.total:
      self.bar.close()


def progress(total: int):
  """``report(i)``: tells the bar, every ``total // UPDATES`` steps and at the last, that step ``i`` (0-based, of
  ``total``) is done. Built at trace time; raises ImportError there when tqdm is missing."""
  try:
    from tqdm.auto import tqdm
  except ImportError as error:
    raise ImportError("sample_chain: progress_bar=True needs tqdm (pip install tqdm).") from error
  bar, every = _Bar(total, tqdm), max(1, total // UPDATES)

  def report(i):
    done = i + 1
    jax.lax.cond(
      (done % every == 0) | (done == total),
      lambda: jax.debug.callback(bar, done),
      lambda: None,
    )

  return report


def silent(i):
  """No bar."""
  del i
