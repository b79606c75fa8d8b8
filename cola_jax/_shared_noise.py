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

from cola_jax._numerics import computed_together

_ACTIVE = threading.local()
# Box-Muller hashes per pass of a draw: XLA:CPU splits a pass of 12 (24 arrays)
# into pieces and writes their intermediates to memory (measured on the
# 12-block transformer of benchmarks/update_memory.py: circle-od's temporaries
# 764 MB instead of 386 MB).
_HASHES_PER_PASS = 6
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


def draw(key: jax.Array, made: Sequence[Request], members: int) -> list[list[tuple[jax.Array, ...]]]:
  """For each member, for each request, its arrays: every request drawn once for all members.

  A request's ``members * arrays`` arrays come from Box-Muller draws of half
  as many (:func:`~cola_jax._noise.box_muller`, both numbers of a hash
  computed in one pass), written to memory once, so that the consumers of each
  member read its arrays instead of hashing again. Each array is a buffer of
  its own, freed once its member has been updated: the group's noise does not
  stay in memory until its last member's gradient exists.

  Each pass draws from its own key (the group's first key folded with the
  pass's number), flat: passes of the same size, whatever their shapes,
  compile to the same loop, which XLA's CPU backend emits once for all of
  them; and no intermediate is shared between passes (drawn whole and sliced,
  XLA wrote the Box-Muller radius of every hash of a request to memory: with
  two numbers per weight, as many bytes as the group's weights).
  """
  from cola_jax import _noise  # which imports this module for intercept()

  per_request = []
  passes = 0
  for request in made:
    count = members * request.arrays
    half = math.ceil(count / 2)
    size = math.prod(request.shape)
    arrays = [None] * count
    small = count * size * request.dtype.itemsize <= _ONE_PASS_BYTES
    per_pass = half if small else _HASHES_PER_PASS
    for start in range(0, half, per_pass):
      hashes = min(per_pass, half - start)
      first, second = _noise.box_muller(_noise.fold_in(key, passes), (hashes * size,), request.dtype)
      passes += 1
      chunk = [i for j in range(start, start + hashes) for i in (j, j + half) if i < count]
      rows = [z.reshape(hashes, size) for z in (first, second)]
      slices = [rows[i // half][i % half - start] for i in chunk]
      for i, array in zip(chunk, jax.lax.optimization_barrier(computed_together(*slices))):
        arrays[i] = array.reshape(request.shape)
    per_request.append([tuple(arrays[m * request.arrays : (m + 1) * request.arrays]) for m in range(members)])
  return [[drawn[m] for drawn in per_request] for m in range(members)]


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
