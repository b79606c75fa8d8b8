"""The noise of one step: each leaf's numbers, drawn from its own key and handed to its Langevin map.

The transforms split the step's key into one key per leaf, and a leaf's
numbers are ``langevin.draw_noise(constraint, key, point, dynamics)`` of its
own key, whatever the backend, the device count or the grouping below: one
seed gives the same stream everywhere (up to JAX's own fallbacks, see
:mod:`cola_jax._noise`). How the draws are compiled is all that differs.

On XLA's CPU backend with one device (:mod:`cola_jax._platform`), a draw's hash (some hundred operations)
is compiled into every loop that consumes it, once per leaf: a 12-block
transformer, whose 48 kernels each draw their own noise, compiled about ten
times longer with noise than without. There the leaves that share a
constraint, a shape and a dtype are drawn together:

* the arrays of a group's draws that take at most ``_ONE_PASS_BYTES`` in all
  (per array of the draw) are drawn in one program, vectorised over the
  members' keys (the biases and norms of the 12-block transformer: 74 vectors
  in one loop; the slacks' noise of a ``MaxNorm`` group), and written to memory;
* larger arrays (or a leaf alone) member by member, each draw after that
  member's gradient (:func:`~cola_jax._platform.computed_after`): XLA's CPU
  scheduler runs an operation as early as its operands allow, and noise drawn
  from the key alone would be drawn before the forward pass and held through
  the backward pass. Each member's key is a buffer of its own, so that the
  members' draws and the loops that fuse them are one computation with
  different operands, which XLA's CPU backend emits once for all of them. A
  constraint whose noise several loops read writes its draw to memory itself
  (``Circle``'s pair, ``Orthogonal``'s matrix).

Elsewhere (accelerators fuse multi-output loops; several devices, where a
leaf keeps its draw beside its shards) each draw is an expression that its
map's loops fuse. Both programs are traced (``jax.lax.platform_dependent``)
and give the same numbers.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax import _platform
from cola_jax._numerics import explicit_sharding
from cola_jax._platform import computed_after_on_cpu, computed_together_on_cpu
from cola_jax._tree import hashable

# A group whose draws take at most this many bytes in all is drawn in one
# program: each program is a loop of its own, some tenths of a second to
# compile, and small arrays cost nothing wherever XLA writes them.
_ONE_PASS_BYTES = 1 << 22

Draw = Callable[[Any, jax.Array, Any], Any]  # (constraint, key, point) -> the leaf's numbers


def draw_leaves(draw: Draw, constraints: Sequence, points: Sequence, keys: jax.Array, grads: Sequence) -> list:
  """Each leaf's numbers, ``draw(constraint, key, point)``, leaf ``i`` from ``keys[i]``.

  ``points`` give the shapes, dtypes and shardings of the leaves' points
  (``jax.ShapeDtypeStruct`` trees will do); ``grads`` are the leaves'
  gradients, which the draws wait for on XLA's CPU backend. ``keys`` are one
  array (``jax.random.split``'s), so that a group's keys are one gather:
  stacked from the leaves' slices, each slice would be a loop of its own (108
  on the 12-block transformer).
  """
  one_by_one = lambda keys, grads: [draw(c, keys[i], point) for i, (c, point) in enumerate(zip(constraints, points))]
  grouped = lambda keys, grads: _grouped(draw, constraints, points, keys, grads)
  return _platform.on_cpu("grouped_draws", grouped, one_by_one, keys, grads)


def _grouped(draw: Draw, constraints: Sequence, points: Sequence, keys: jax.Array, grads: Sequence) -> list:
  """:func:`draw_leaves` with same-shape leaves drawn together, for XLA:CPU on one device."""
  noises: list[Any] = [None] * len(points)
  groups: dict[Any, list[int]] = {}
  for i, (c, point) in enumerate(zip(constraints, points)):
    leaves = jax.tree.leaves(point)
    alone = any(explicit_sharding(x) is not None for x in leaves)
    group = (None, i) if alone else (hashable(c), tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves))
    groups.setdefault(group, []).append(i)
  for group, members in groups.items():
    first = members[0]
    one = lambda key: draw(constraints[first], key, points[first])
    if group[0] is None:  # drawn where it is read
      noises[first] = one(keys[first])
      continue
    # Per array of the draw: the small ones of every member in one program, the large ones member by member
    # (each draw computed twice, XLA drops the arrays each program does not return).
    shapes, treedef = jax.tree.flatten(jax.eval_shape(one, keys[first]))
    small = [len(members) * x.size * jnp.dtype(x.dtype).itemsize <= _ONE_PASS_BYTES for x in shapes]
    arrays: list[list] = [[None] * len(shapes) for _ in members]
    if any(small):
      stacked = jax.tree.leaves(jax.vmap(one)(keys[np.asarray(members)]))
      # Each written to memory once.
      written = [_rows(computed_together_on_cpu(x)[0]) for x, s in zip(stacked, small) if s]
      for position in range(len(members)):
        drawn = iter(written)
        arrays[position] = [next(drawn)[position] if s else None for s in small]
    if not all(small):
      member_keys = _own_buffers([keys[i] for i in members]) if len(members) > 1 else [keys[first]]
      for position, (i, key) in enumerate(zip(members, member_keys)):
        own = jax.tree.leaves(one(computed_after_on_cpu(grads[i], key)))
        arrays[position] = [a if s else x for a, x, s in zip(arrays[position], own, small)]
    for position, i in enumerate(members):
      noises[i] = jax.tree.unflatten(treedef, arrays[position])
  return noises


def _rows(stacked: jax.Array) -> tuple[jax.Array, ...]:
  """The rows of a group's written draw, each read at an index that is a buffer of its own.

  A loop that slices its member's row out of the group's draw at a constant
  offset differs from the other members' loops by that offset: each member's
  update is then loops of its own to compile (the 12-block transformer's 48
  ``MaxNorm`` kernels read their slacks' noise so: the CoLA-od step compiled
  in 16.1 CPU s, 10.9 with the index an operand,
  ``results/cost/update_memory_rows_{before,after}.json``).
  With the index an operand (computed after the draw, all in one loop of
  :func:`~cola_jax._platform.computed_together`, so that XLA cannot fold it
  into a constant), the members' loops are one computation with different
  operands, which XLA's CPU backend emits once; and no row is copied.
  """
  if stacked.shape[0] == 1:
    return (stacked[0],)
  indices = computed_together_on_cpu(*(computed_after_on_cpu(stacked, np.int32(p)) for p in range(stacked.shape[0])))
  return tuple(jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False) for i in indices)


def _own_buffers(keys: list) -> list:
  """The keys, each a buffer of its own (:func:`~cola_jax._platform.computed_together`).

  A loop that slices its key out of the step's keys differs from its
  neighbours' by the slice: each pass would be a loop of its own to compile.
  """
  typed = jnp.issubdtype(keys[0].dtype, jax.dtypes.prng_key)
  data = computed_together_on_cpu(*(jax.random.key_data(k) if typed else k for k in keys))
  if not typed:
    return list(data)
  return [jax.random.wrap_key_data(d, impl=jax.random.key_impl(keys[0])) for d in data]
