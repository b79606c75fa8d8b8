"""The per-leaf engine of every transform: leaves, their constraints, checks, groups, keys and geometry calls.

A transform builds a :class:`Leaves` from the parameters it is given and is
then its update rule alone: the engine assigns each leaf its constraint
(``free=`` leaves included), checks the gradients and the state against the
parameters (errors name the argument and the leaf's path, as in
``grads['layer0']['w']``, at trace time: nothing is added to the compiled
step), gives each leaf its PRNG key, re-establishes each leaf's point on its
manifold once (after its gradient: :func:`~cola_jax._platform.computed_after`),
draws the leaves' noise from those points and maps a step over the leaves.

Every state a transform makes holds its leaves' constraint states in a field
named :data:`CONSTRAINT_STATES`, which :func:`~cola_jax.constraint_residuals`
finds in any optimizer state (:func:`holds_constraint_states`).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cola_jax import _compiled, _step_noise
from cola_jax._platform import computed_after
from cola_jax._tree import ConstraintSpec, is_function
from cola_jax.constraints.base import Constraint, Euclidean

_EUCLIDEAN = Euclidean()

CONSTRAINT_STATES = "constraint_states"


def holds_constraint_states(node) -> bool:
  """Whether ``node`` is the state of a transform built on the engine (a NamedTuple with its leaves' states)."""
  return isinstance(node, tuple) and CONSTRAINT_STATES in getattr(node, "_fields", ())


def check_state_type(owner: str, state, expected: type) -> None:
  if not isinstance(state, expected):
    raise TypeError(
      f"{owner}: the optimizer state must be the {expected.__name__} returned by "
      f"init(), got {type(state).__name__}. (A checkpoint restored without a "
      "target comes back as dicts: restore it with tx.init(params) as the target.)"
    )


def _is_constraint_leaf(x) -> bool:
  return x is None or isinstance(x, Constraint)


class Leaves:
  """The leaves of a parameter tree, their paths and constraints, and the per-leaf work of a transform.

  ``check(path, constraint)``, if given, raises for a constraint the
  transform does not step.
  """

  def __init__(self, owner: str, spec: ConstraintSpec, params, check: Callable[[str, Constraint], None] | None = None):
    if params is None:
      raise ValueError(
        f"{owner}: update() needs the current parameters: call "
        "tx.update(grads, state, params). The constrained step is computed "
        "from the parameters, not from the gradients alone."
      )
    self.owner = owner
    paths_and_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.paths = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
    self.params = [self._array(leaf, "params", path) for path, (_, leaf) in zip(self.paths, paths_and_leaves)]
    self.constraints = self._assign(spec, params)
    if check is not None:
      for path, c in zip(self.paths, self.constraints):
        check(path, c)
    # The geometry runs in at least float32 (float64 stays float64); updates
    # are returned in each parameter's own dtype.
    self.compute = [p.astype(jnp.promote_types(p.dtype, jnp.float32)) for p in self.params]

  def _assign(self, spec, params) -> list[Constraint]:
    if is_function(spec):
      spec = spec(params)
    try:
      full = jax.tree.broadcast(spec, params, is_leaf=_is_constraint_leaf)
      assigned = self.treedef.flatten_up_to(full)
    except ValueError as error:
      raise ValueError(
        f"{self.owner}: constraints must be a Constraint, None, or a pytree "
        f"prefix of the parameters with Constraint or None leaves.\n{error}"
      ) from None
    constraints = []
    for path, param, constraint in zip(self.paths, self.params, assigned):
      if constraint is None:
        constraint = _EUCLIDEAN
      if not isinstance(constraint, Constraint):
        raise TypeError(
          f"{self.owner}: the constraint for the leaf at {path} is "
          f"{constraint!r}; expected a cola_jax Constraint or None."
        )
      if not jnp.issubdtype(param.dtype, jnp.floating):
        raise TypeError(
          f"{self.owner}: the leaf at {path} has dtype {param.dtype}; parameters must be floating point (params{path})."
        )
      constraint.validate(param, path)
      # A leaf without entries has nothing to move or constrain: it passes
      # as under optax.sgd (and reports no residual).
      constraints.append(_EUCLIDEAN if param.size == 0 else constraint)
    return constraints

  def flatten(self, tree, what: str) -> list:
    """The subtrees of ``tree`` at the parameters' leaves, or a clear error."""
    try:
      return self.treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
      raise ValueError(
        f"{self.owner}: {what} does not have the structure of the parameters "
        f"(was the optimizer state initialised with other parameters?).\n{error}"
      ) from None

  def unflatten(self, leaves: list):
    return self.treedef.unflatten(leaves)

  @property
  def free(self) -> list[bool]:
    """Per leaf: whether it is unconstrained (no constraint, or no entries)."""
    return [isinstance(c, Euclidean) for c in self.constraints]

  def _array(self, leaf, what: str, path: str) -> jax.Array:
    """The leaf as an array (Python and NumPy scalars become arrays, as in optax)."""
    if leaf is None:
      raise TypeError(
        f"{self.owner}: {what}{path} is None, but params{path} is an array. Pass a "
        "zero gradient (jnp.zeros_like) for a parameter without one, or route the "
        "parameter to another transformation with optax.masked or optax.partition."
      )
    try:
      return jnp.asarray(leaf)
    except TypeError:
      raise TypeError(f"{self.owner}: {what}{path} is {leaf!r}; expected an array or a number.") from None

  def gradients(self, grads) -> list:
    """The gradient leaves, checked and in the compute dtype of their parameters."""
    leaves = []
    for path, g, p in zip(self.paths, self.flatten(grads, "grads"), self.compute):
      g = self._array(g, "grads", path)
      if not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"{self.owner}: grads{path} has dtype {g.dtype}; gradients must be floating point.")
      if g.shape != p.shape:
        raise ValueError(
          f"{self.owner}: grads{path} has shape {g.shape}, but params{path} has shape "
          f"{p.shape}; gradients must have the shapes of the parameters (no broadcasting)."
        )
      leaves.append(g.astype(p.dtype))
    return leaves

  def initial_states(self) -> list:
    """Each leaf's constraint state for a new run, compiled as one program."""
    return _compiled.call(initial_auxes, (tuple(self.constraints),), self.compute)

  def constraint_states(self, state) -> list:
    """The leaves' constraint states in ``state``, checked against the parameters and their constraints."""
    auxes = self.flatten(getattr(state, CONSTRAINT_STATES), f"state.{CONSTRAINT_STATES}")
    self._check(auxes, [None] * len(auxes))
    return auxes

  def constraint_states_and_momenta(self, state, skip: list[bool]) -> tuple[list, list]:
    """As :meth:`constraint_states`, and each leaf's stored momentum in ``state.momentum``, checked too.

    A leaf that ``skip`` names has no momentum (None).
    """
    auxes = self.flatten(getattr(state, CONSTRAINT_STATES), f"state.{CONSTRAINT_STATES}")
    momenta = [None if s else m for m, s in zip(self.flatten(state.momentum, "state.momentum"), skip)]
    self._check(auxes, momenta)
    return auxes, momenta

  def _check(self, auxes: list, momenta: list) -> None:
    for path, p, constraint, aux, momentum in zip(self.paths, self.compute, self.constraints, auxes, momenta):
      structure, shapes = _expected(constraint, "init", p.shape, p.dtype)
      if jax.tree.structure(aux) != structure:
        raise ValueError(
          f"{self.owner}: the optimizer state for the leaf at {path} does not "
          f"match its constraint {constraint!r} (state {type(aux).__name__}). "
          "Re-initialise the optimizer when constraints or parameters change."
        )
      stored = list(zip(jax.tree.leaves(aux), shapes))
      if momentum is not None:
        stored += zip(jax.tree.leaves(momentum), _expected(constraint, "zero_momentum", p.shape, p.dtype)[1])
      for got, want in stored:
        if jnp.shape(got) != want:
          raise ValueError(
            f"{self.owner}: the optimizer state for params{path} holds an array of "
            f"shape {jnp.shape(got)} where a parameter of shape {p.shape} needs "
            f"{want}: the state was initialised for parameters of other shapes. "
            "Re-initialise the optimizer when parameters change."
          )

  def keys(self, key, noisy: bool) -> tuple[Any, jax.Array | None]:
    """(the next key, one key per leaf in one array), or (key, None) when no noise is drawn.

    One array: a group's keys are then one gather, not a slice per leaf.
    """
    if not noisy:
      return key, None
    key, step_key = jax.random.split(key)
    return key, jax.random.split(step_key, len(self.params))

  def points(self, auxes: list, grads: list, skip: list[bool]) -> list:
    """Each leaf's point on its manifold (None where ``skip``), computed after its gradient."""

    def point(c, param, aux, grad):
      return c.point(*computed_after(grad, (param, aux)))

    (points,) = self.map(1, lambda *a: (point(*a),), skip, (None,), self.compute, auxes, grads)
    return points

  def noises(self, draw: Callable, keys: jax.Array | None, points: list, grads: list, skip: list[bool]) -> list:
    """Each leaf's numbers ``draw(constraint, key, point)`` from its own key ``keys[i]``; None where none is drawn.

    A leaf that ``skip`` names (one that ``free=`` moves) draws none. The
    points are read for their shapes, dtypes and shardings only.
    """
    noises = [None] * len(self.params)
    drawn = [i for i, s in enumerate(skip) if not s]
    if keys is None or not drawn:
      return noises
    if len(drawn) < len(noises):
      keys = keys[np.asarray(drawn)]
    constraints = [self.constraints[i] for i in drawn]
    for i, noise in zip(
      drawn, _step_noise.draw_leaves(draw, constraints, [points[i] for i in drawn], keys, [grads[i] for i in drawn])
    ):
      noises[i] = noise
    return noises

  def map(self, n_outputs: int, leaf_step: Callable, skip: list[bool], fill: tuple, *columns):
    """``leaf_step(constraint, *column_entries)`` for every leaf not ``skip``-ped, transposed.

    ``leaf_step`` returns ``n_outputs`` values; a skipped leaf gets ``fill``
    (a tuple of as many). With no leaves the result is ``n_outputs`` empty
    lists.
    """
    outputs: list[Any] = [
      fill if s else leaf_step(c, *(column[i] for column in columns))
      for i, (c, s) in enumerate(zip(self.constraints, skip))
    ]
    return tuple([output[k] for output in outputs] for k in range(n_outputs))

  def updates(self, new_params: list, given: list | None = None):
    """``new - old`` for every leaf, in the parameter's own dtype; ``given``'s update as it is where ``new`` is None."""
    given = given or [None] * len(new_params)
    return self.unflatten(
      [
        update if new is None else (new - old).astype(param.dtype)
        for new, update, old, param in zip(new_params, given, self.compute, self.params)
      ]
    )


def initial_auxes(constraints: tuple, compute: list) -> list:
  """Each leaf's auxiliary state for a new run (compiled as one program by the transforms' ``init``)."""
  return [c.init(p) for c, p in zip(constraints, compute)]


def _expected(constraint: Constraint, method: str, shape: tuple, dtype) -> tuple[Any, list[tuple]]:
  """The tree structure and array shapes of ``constraint.<method>`` of a leaf of this shape and dtype.

  Traced once per constraint, method, shape and dtype (not at every trace of
  every update), unless a hyperparameter of the constraint is traced.
  """
  try:
    return _expected_cached(constraint, method, shape, jnp.dtype(dtype), jax.dtypes.canonicalize_dtype(jnp.float64))
  except TypeError:  # unhashable: a traced hyperparameter (inject_hyperparams)
    return _trace(constraint, method, shape, jnp.dtype(dtype))


@functools.lru_cache(maxsize=4096)
def _expected_cached(constraint, method, shape, dtype, widest) -> tuple[Any, list[tuple]]:
  del widest  # part of the key: init's dtypes follow jax_enable_x64
  return _trace(constraint, method, shape, dtype)


def _trace(constraint, method, shape, dtype) -> tuple[Any, list[tuple]]:
  out = jax.eval_shape(getattr(constraint, method), jax.ShapeDtypeStruct(shape, dtype))
  return jax.tree.structure(out), [x.shape for x in jax.tree.leaves(out)]


class Free:
  """``free=``: the optax transformation of the unconstrained leaves, or None (the transform's step moves them too).

  It gets its leaves as ``optax.partition`` would give them: the gradients and
  parameters as they are, ``optax.MaskedNode`` at every other leaf, and the
  extra arguments of ``update``.
  """

  def __init__(self, owner: str, free: optax.GradientTransformation | None):
    if free is not None and not isinstance(free, optax.GradientTransformation):
      raise TypeError(
        f"{owner}: free must be an optax.GradientTransformation for the unconstrained leaves, such as "
        f"free=optax.adam(1e-3), or None (the method's own dynamics); got {type(free).__name__}."
      )
    self.tx = None if free is None else optax.with_extra_args_support(free)

  def taken(self, leaves: Leaves) -> list[bool]:
    """Per leaf: whether ``free`` moves it (every unconstrained leaf when given, none otherwise)."""
    return [self.tx is not None and f for f in leaves.free]

  def _masked(self, leaves: Leaves, tree, what: str):
    taken = self.taken(leaves)
    return leaves.unflatten([x if t else optax.MaskedNode() for x, t in zip(leaves.flatten(tree, what), taken)])

  def init(self, params, leaves: Leaves | None):
    """``free``'s state for these parameters (None without ``free``).

    ``leaves`` is None for ``optax.tree.map_params``'s stand-in, which
    ``free`` gets unmasked, as ``optax.masked`` passes it on.
    """
    if self.tx is None:
      return None
    return self.tx.init(params if leaves is None else self._masked(leaves, params, "params"))

  def update(self, leaves: Leaves, grads, state, params, extra_args: dict) -> tuple[list, Any]:
    """``free``'s update of each leaf it takes (None at the others) and its next state."""
    if self.tx is None:
      return [None] * len(leaves.params), state
    updates, state = self.tx.update(
      self._masked(leaves, grads, "grads"), state, self._masked(leaves, params, "params"), **extra_args
    )
    taken = self.taken(leaves)
    return [u if t else None for u, t in zip(leaves.flatten(updates, "free's updates"), taken)], state
