"""Every choice cola_jax makes for a backend, taken by the platform the program is compiled for.

One policy: XLA's CPU backend gets the mechanisms below, which were measured
to pay there (``docs/development.md``, "XLA workarounds", gives each one's
number and its canary test); every other platform (CUDA, ROCm, TPU) gets plain
``jnp`` and ``jax.random``, since no measurement on an accelerator says
otherwise. The choice is made by :func:`jax.lax.platform_dependent`: both
branches are traced, and the one of the platform the program is lowered for is
compiled, so a step exported for a GPU or a TPU from a CPU host
(``jax.export.export(jax.jit(step), platforms=["cuda"])``) is the plain
program. No other module reads the backend.

A mechanism changes how a value is computed, never which value: both branches
return the same shapes and dtypes, the same numbers where the mechanism is a
schedule (the noise of one seed is the same stream on every backend), and the
same function to rounding where it is arithmetic (``sin`` and ``cos``).

The mechanisms, by name (the names :func:`plain` takes):

* ``"computed_together"``: arrays that several loops read, computed in one
  variadic reduction (:func:`computed_together`);
* ``"computed_after"``: the update scheduled after the gradient
  (:func:`computed_after`);
* ``"one_matrix_at_a_time"``: a vmapped LAPACK call looped member by member,
  which avoids a deadlock of jaxlib's CPU kernels (:func:`one_matrix_at_a_time`);
* ``"grouped_draws"``: the noise of same-shape leaves drawn together
  (:mod:`cola_jax._step_noise`);
* ``"threefry"``: Threefry-2x32 written out round by round, so that it fuses
  (:mod:`cola_jax._noise`);
* ``"sincos"``: sine and cosine in plain arithmetic (:func:`cola_jax._numerics.sin_cos`,
  the ``Circle``'s A step), with an exact range reduction run only when an
  angle needs it (:func:`cola_jax._numerics.with_sincos`, ``MaxNorm``'s
  great-circle step).

``computed_together``, ``computed_after`` and ``grouped_draws`` also need a
single device: with several an array may be sharded, and their reshapes and
regroupings would move data between devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

MECHANISMS = (
  "computed_together",
  "computed_after",
  "one_matrix_at_a_time",
  "grouped_draws",
  "threefry",
  "sincos",
)
_ONE_DEVICE = frozenset({"computed_together", "computed_after", "grouped_draws"})
_plain: set[str] = set()

T = TypeVar("T")


@contextlib.contextmanager
def plain(*mechanisms: str) -> Iterator[None]:
  """Within the block, steps traced take the plain (default) branch of the named mechanisms (all by default).

  For the canaries, which measure what a mechanism buys against the program
  without it, and for the tests that compare a program with the plain one.
  Read at trace time: a function jitted and traced before is not retraced.
  """
  names = set(mechanisms or MECHANISMS)
  unknown = names - set(MECHANISMS)
  if unknown:
    raise ValueError(f"plain: unknown mechanisms {sorted(unknown)}; known: {MECHANISMS}.")
  before = set(_plain)
  _plain.update(names)
  try:
    yield
  finally:
    _plain.clear()
    _plain.update(before)


def on_cpu(mechanism: str, cpu: Callable[..., T], default: Callable[..., T], *args: Any) -> T:
  """``cpu(*args)`` in a program compiled for XLA's CPU backend, ``default(*args)`` in any other.

  ``mechanism`` is one of :data:`MECHANISMS`; both functions must return the
  same shapes and dtypes (both are traced).
  """
  if mechanism not in MECHANISMS:
    raise ValueError(f"on_cpu: unknown mechanism {mechanism!r}; known: {MECHANISMS}.")
  if mechanism in _plain or (mechanism in _ONE_DEVICE and jax.device_count() != 1):
    return default(*args)
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def computed_together(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """The arrays (all of one shape), unchanged, computed in one pass over their entries on XLA:CPU.

  XLA's CPU backend has no multi-output loop fusion: each array that several
  consumers need is recomputed inside each consumer's loop (or written out
  piecewise, where it contains a ``log`` or ``sqrt``). A variadic reduction is
  one loop with several results, so on CPU the arrays are returned as sums
  over a trailing axis of length two whose second entries are negative zeros
  (``x + (-0)`` is ``x`` exactly, and the compiler drops the addition): every
  intermediate they share is computed once and each array is written to memory
  once. The reduction's loop runs over the arrays' shape with the last axis
  innermost and vectorised (a last axis of 10 leaves most of each row to
  scalar code), so the arrays are flattened first (a free reshape on one
  device). Other platforms fuse multi-output loops themselves and get the
  arrays as they are.
  """
  if not arrays:
    return arrays
  return on_cpu("computed_together", computed_together_on_cpu, lambda *xs: xs, *arrays)


@jax.custom_jvp
def computed_together_on_cpu(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """:func:`computed_together`'s XLA:CPU branch, for code already in one (one device)."""
  shape = arrays[0].shape
  flat = tuple(x.reshape(-1) for x in arrays)
  zeros = tuple(np.array(-0.0 if jnp.issubdtype(x.dtype, jnp.inexact) else 0, x.dtype) for x in flat)
  padded = tuple(jnp.stack([x, jnp.full_like(x, zero)], axis=-1) for x, zero in zip(flat, zeros))
  summed = jax.lax.reduce(padded, zeros, lambda a, b: tuple(u + v for u, v in zip(a, b)), (1,))
  return tuple(x.reshape(shape) for x in summed)


@computed_together_on_cpu.defjvp
def _computed_together_jvp(primals, tangents):
  return computed_together_on_cpu(*primals), tuple(tangents)


def computed_after(grad: jax.Array, tree: T) -> T:
  """``tree`` unchanged, but on XLA:CPU computed from ``grad``: nothing of it is scheduled before ``grad`` exists.

  XLA's CPU scheduler runs each operation as early as its operands allow, so
  what an update computes from the parameters and the optimizer state alone (a
  normalised slack, a projection, noise drawn from the key) would run before
  the forward pass and stay in memory through the backward pass (an
  ``optimization_barrier`` with ``grad`` left the schedule as it was: a data
  dependence is needed). Each array of ``tree`` gains a zero made from the
  sign bit of ``grad``'s first entry, which the compiler cannot fold: floats
  ``-0.0`` (``x + -0.0`` is ``x`` for every float, signed zeros and NaN
  included), integers and PRNG keys' data ``0`` by exclusive or. Other
  platforms get ``tree`` as it is.
  """
  return on_cpu("computed_after", computed_after_on_cpu, lambda grad, tree: tree, grad, tree)


def computed_after_on_cpu(grad: jax.Array, tree: T) -> T:
  """:func:`computed_after`'s XLA:CPU branch, for code already in one (one device)."""
  if grad.size == 0:
    return tree
  first = grad[(0,) * grad.ndim]  # not grad.reshape(-1)[0]: a reshape of an explicitly sharded array needs its sharding
  sign = jax.lax.bitcast_convert_type(first.astype(jnp.float32), jnp.uint32) & np.uint32(2**31)
  high_bit = sign | np.uint32(2**31)
  negative_zero = jax.lax.bitcast_convert_type(high_bit, jnp.float32)
  zero_bits = high_bit ^ np.uint32(2**31)

  def after(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(after(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return x + negative_zero.astype(x.dtype)
    if jnp.issubdtype(x.dtype, jnp.integer):
      return x ^ zero_bits.astype(x.dtype)
    return x

  return jax.tree.map(after, tree)


def one_matrix_at_a_time(fn: Callable) -> Callable:
  """``fn`` (a LAPACK factorisation of one matrix) made to loop over a ``vmap`` batch on XLA:CPU.

  For a constraint of your own whose methods factorise matrices (``eigh``,
  ``svd``, ``qr``, Cholesky, LU, a solve): wrap the factorisation, as the
  library's constraints do. jaxlib's CPU LAPACK kernels (as of 0.10.2) split a batch
  of large matrices into tasks on XLA:CPU's intra-op thread pool and block
  the pool thread that runs them until the tasks are done; with every pool
  thread blocked so, no thread is left to run the tasks, and the program
  deadlocks (a step of :func:`~cola_jax.manifold_muon` over two seeds did).
  Given one matrix, LAPACK runs on the calling thread. Under ``jax.vmap``
  (seeds, or the stack of a leaf's matrices) the result calls ``fn`` on one
  member at a time (``jax.custom_batching.sequential_vmap``); unbatched it
  computes what ``fn`` does, bit for bit. Other platforms' batched solvers
  are fine and get ``fn``.

  Args:
    fn: a function of arrays, taken positionally; its keyword defaults
      (``jnp.linalg.eigh``'s ``UPLO``) stay Python values.

  Returns:
    A function of the same arrays computing ``fn``.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> eigh = cola.one_matrix_at_a_time(jnp.linalg.eigh)
    >>> values, _ = jax.vmap(eigh)(jnp.stack([jnp.eye(2), 2 * jnp.eye(2)]))  # one matrix at a time on CPU
    >>> values.tolist()
    [[1.0, 1.0], [2.0, 2.0]]
  """
  looped = jax.custom_batching.sequential_vmap(lambda *arrays: fn(*arrays))
  return lambda *arrays: on_cpu("one_matrix_at_a_time", looped, fn, *arrays)
