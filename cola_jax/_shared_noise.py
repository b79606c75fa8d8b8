"""The noise of a group of same-shape leaves, drawn in one program for all of them.

Each draw of :mod:`cola_jax._noise` is a hash of some hundred operations that
XLA compiles into the loop of its consumer, once per leaf: a 12-block
transformer, whose 48 kernels each draw their own noise, compiled about ten
times longer with noise than without. Leaves that share a constraint, a shape
and a dtype make the same requests in the same order (traced once, abstractly,
by :func:`requests`); :func:`draw` makes each request once for the whole
group, with the group's member axis in front, and writes it to memory once, so
that the program holds one hash per request and group, whatever the depth.
Each member then receives its slice (:func:`serving`) where it would have
drawn. The numbers are independent standard normal entries as before, from a
different stream: the group's first key, folded with the number of the pass
(:func:`draw`).
"""

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np

from cola_jax._numerics import computed_after, computed_together

_ACTIVE = threading.local()
# A request whose arrays take at most this many bytes in all is drawn in one
# pass however many hashes it needs: each pass is a kernel of its own, some
# tenths of a second to compile, and small intermediates cost nothing wherever
# XLA writes them (the biases and norms of the 12-block transformer: 74 vectors
# in one pass instead of 7).
_ONE_PASS_BYTES = 1 << 22


class Request(NamedTuple):
  """A draw of ``arrays`` standard normal arrays of ``shape`` and ``dtype``."""

  arrays: int
  shape: tuple[int, ...]
  dtype: np.dtype


def intercept(arrays: int, shape, dtype, out_sharding) -> tuple[jax.Array, ...] | None:
  """The arrays of the active recording or serving for this draw, or None (draw as usual)."""
  active = getattr(_ACTIVE, "value", None)
  if active is None or out_sharding is not None:
    return None
  return active(Request(arrays, tuple(shape), np.dtype(dtype)))


@contextlib.contextmanager
def _active(handler: Callable[[Request], tuple[jax.Array, ...]]) -> Iterator[None]:
  previous = getattr(_ACTIVE, "value", None)
  _ACTIVE.value = handler
  try:
    yield
  finally:
    _ACTIVE.value = previous


def requests(fn: Callable, *args) -> list[Request]:
  """The draws ``fn(*args)`` makes, in order, traced abstractly (nothing is computed)."""
  made: list[Request] = []

  def record(request: Request):
    made.append(request)
    return tuple(jax.numpy.zeros(request.shape, request.dtype) for _ in range(request.arrays))

  with _active(record):
    jax.eval_shape(fn, *args)
  return made


def draw(
  key: jax.Array, made: Sequence[Request], members: int, after: Sequence[jax.Array]
) -> list[list[tuple[jax.Array, ...]]]:
  """For each member, for each request, its arrays: every request drawn once for all members.

  A request's ``members * arrays`` arrays come from Box-Muller draws of half
  as many (:func:`~cola_jax._noise.box_muller`, both numbers of a hash
  computed in one pass), written to memory once, so that the consumers of each
  member read its arrays instead of hashing again. Each array is a buffer of
  its own, freed once its member has been updated.

  A request of at most ``_ONE_PASS_BYTES`` is drawn in one pass. A larger one
  takes a pass per hash, which serves one member (two arrays) or two (one
  each) and waits for their entries of ``after`` (one array per member: its
  gradient). XLA's CPU scheduler runs an operation as early as its operands
  allow: noise drawn from the key alone would be drawn before the forward pass
  and the whole group's noise held through the backward pass, where now a
  pass's noise lives from its members' gradients to their updates.

  Each pass draws from its own key (the group's first key folded with the
  pass's number, all folded in one kernel by
  :func:`~cola_jax._noise.fold_in_range`), flat: passes of one size and
  gradient shape compile to the same loop, which XLA's CPU backend emits once
  for all of them; and no intermediate is shared between passes (drawn whole
  and sliced, XLA wrote the Box-Muller radius of every hash of a request to
  memory: with two numbers per weight, as many bytes as the group's weights).
  """
  from cola_jax import _noise  # which imports this module for intercept()

  plan = []  # (request, first hash, hashes, whether it waits for its members' gradients) of each pass
  for r, request in enumerate(made):
    half = math.ceil(members * request.arrays / 2)
    small = members * request.arrays * math.prod(request.shape) * request.dtype.itemsize <= _ONE_PASS_BYTES
    per_pass = half if small else 1
    plan += [(r, start, min(per_pass, half - start), not small) for start in range(0, half, per_pass)]
  pass_keys = _noise.fold_in_range(key, len(plan))

  arrays: list[list] = [[None] * (members * request.arrays) for request in made]
  for pass_key, (r, start, hashes, waits) in zip(pass_keys, plan):
    request, count = made[r], len(arrays[r])
    chunk = list(range(2 * start, min(2 * (start + hashes), count)))
    for m in sorted({i // request.arrays for i in chunk}) if waits else ():
      pass_key = computed_after(after[m], pass_key)
    size = math.prod(request.shape)
    first, second = _noise.box_muller(pass_key, (hashes * size,), request.dtype)
    rows = [z.reshape(hashes, size) for z in (first, second)]
    slices = [rows[i % 2][i // 2 - start] for i in chunk]
    for i, array in zip(chunk, jax.lax.optimization_barrier(computed_together(*slices))):
      arrays[r][i] = array.reshape(request.shape)
  return [
    [tuple(drawn[m * request.arrays : (m + 1) * request.arrays]) for request, drawn in zip(made, arrays)]
    for m in range(members)
  ]


@contextlib.contextmanager
def serving(made: Sequence[Request], drawn: Sequence[tuple[jax.Array, ...]]) -> Iterator[None]:
  """Answers the draws made inside, in order, with ``drawn`` (one member's arrays of :func:`draw`).

  With nothing recorded (noise not shared) the draws inside use their own keys.
  """
  if not made:
    yield
    return
  queue = list(zip(made, drawn))

  def serve(request: Request):
    expected, arrays = queue.pop(0)
    if request != expected:  # the recording's trace and this one differ: a bug, not a user error
      raise AssertionError(f"noise request {request} where {expected} was recorded")
    return arrays

  with _active(serve):
    yield
  if queue:
    raise AssertionError(f"{len(queue)} recorded noise request(s) were not made")
