"""The driver of every transform: the prologue and epilogue of an update, around the transform's rule.

A transform (``cola_od``, ``cola_ud``, ``constrained``, ``manifold_muon``, the
samplers) builds one :class:`Driver` and is then its update rule alone. The
driver resolves the constraint spec once per tree structure (at ``init``,
which says each misuse once, at the user's line: :mod:`cola_jax._warn`),
assigns each leaf its constraint (``free=`` leaves included; ``UnitNorm`` and
``MaxNorm`` without ``axis`` read in the leaf's layer,
:mod:`~cola_jax._layers`), checks the gradients and the state against the
parameters (errors name the argument and the leaf's path, as in
``grads['layer0']['w']``, at trace time: nothing is added to the compiled
step), gives each leaf its PRNG key, re-establishes each stepped leaf's point
on its manifold once, after its gradient
(:func:`~cola_jax._platform.computed_after`), draws the leaves' noise from
those points, maps the rule over the leaves and returns the updates and the
leaves' constraint states.

Every state a transform makes holds its leaves' constraint states in a field
named :data:`CONSTRAINT_STATES`, which :func:`~cola_jax.constraint_residuals`
finds in any optimizer state (:func:`holds_constraint_states`); each reports
its residual through its constraint's :meth:`~cola_jax.Constraint.residual`,
whatever the constraint's ``init`` returns.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cola_jax import _compiled, _layers, _step_noise, _warn
from cola_jax._platform import computed_after
from cola_jax._tree import ConstraintSpec, broadcast, equinox_hint, is_function
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["aux"], meta_fields=["constraint"])
@dataclasses.dataclass(frozen=True)
class LeafState:
  """A leaf's constraint state as the transforms keep it when the state cannot name its residual itself.

  A constraint's :meth:`~cola_jax.Constraint.init` may return any pytree of
  arrays (a tuple of slacks, say); the driver keeps such a state beside its
  constraint (static, part of the tree structure), so that
  :func:`~cola_jax.constraint_residuals` reaches ``constraint.residual(param,
  aux)``. States that have a ``residual`` method (:class:`~cola_jax.ConstraintState`,
  the built-ins') are kept as they are.
  """

  aux: Any
  constraint: Constraint

  def residual(self, param: jax.Array) -> jax.Array:
    return self.constraint.residual(param, self.aux)


def _kept(constraint: Constraint, aux):
  """``aux`` as the transforms' states keep it (see :class:`LeafState`)."""
  return aux if aux is None or hasattr(aux, "residual") else LeafState(aux, constraint)


def _given(aux):
  """The constraint's own state of a kept one."""
  return aux.aux if isinstance(aux, LeafState) else aux


class Leaves:
  """The leaves of a parameter tree: their paths, arrays (and compute arrays) and constraints."""

  def __init__(self, owner: str, params):
    if params is None:
      raise ValueError(
        f"{owner}: update() needs the current parameters: call "
        "tx.update(grads, state, params). The constrained step is computed "
        "from the parameters, not from the gradients alone."
      )
    self.owner = owner
    paths_and_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.paths = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
    try:
      self.params = [self._array(leaf, "params", path) for path, (_, leaf) in zip(self.paths, paths_and_leaves)]
    except TypeError as error:
      raise TypeError(f"{error}{equinox_hint(params)}") from None
    self.constraints: list[Constraint] = []
    # The geometry runs in at least float32 (float64 stays float64); updates
    # are returned in each parameter's own dtype.
    self.compute = [p.astype(jnp.promote_types(p.dtype, jnp.float32)) for p in self.params]

  @property
  def signature(self) -> tuple:
    """What the constraints assigned to these leaves depend on: the tree structure, shapes and dtypes."""
    return self.treedef, tuple((p.shape, p.dtype) for p in self.params)

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

  def kept(self, auxes: list):
    """The leaves' constraint states as a transform's state keeps them, as a tree (see :class:`LeafState`)."""
    return self.unflatten([_kept(c, aux) for c, aux in zip(self.constraints, auxes)])

  def constraint_states(self, tree, momentum_tree=None, skip: list[bool] | None = None) -> tuple[list, list | None]:
    """The leaves' own constraint states in ``tree`` and their momenta in ``momentum_tree``, checked.

    A leaf that ``skip`` names has no momentum (None).
    """
    kept = self.flatten(tree, f"state.{CONSTRAINT_STATES}")
    momenta = None
    if momentum_tree is not None:
      skip = skip or [False] * len(kept)
      momenta = [None if s else m for m, s in zip(self.flatten(momentum_tree, "state.momentum"), skip)]
    self._check(kept, momenta or [None] * len(kept))
    return [_given(aux) for aux in kept], momenta

  def _check(self, kept: list, momenta: list) -> None:
    for path, p, constraint, aux, momentum in zip(self.paths, self.compute, self.constraints, kept, momenta):
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

  def updates(self, new_params: list, given: list | None = None) -> list:
    """``new - old`` for every leaf, in the parameter's own dtype; ``given``'s update as it is where ``new`` is None."""
    given = given or [None] * len(new_params)
    return [
      update if new is None else (new - old).astype(param.dtype)
      for new, update, old, param in zip(new_params, given, self.compute, self.params)
    ]


def initial_auxes(constraints: tuple, compute: list) -> list:
  """Each leaf's auxiliary state for a new run (compiled as one program by the transforms' ``init``)."""
  return [c.init(p) for c, p in zip(constraints, compute)]


def _expected(constraint: Constraint, method: str, shape: tuple, dtype) -> tuple[Any, list[tuple]]:
  """The tree structure and array shapes of ``constraint.<method>`` of a leaf of this shape and dtype, as kept.

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
  if method == "init":
    out = _kept(constraint, out)
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


@dataclasses.dataclass
class Update:
  """One update's leaves as the :class:`Driver` hands them to a transform's rule: lists, one entry per leaf.

  ``stepped`` says which leaves the rule steps; the others (``free=``'s, or the
  free leaves of a transform whose inner optimizer moves them) have no point,
  momentum or noise (None).
  """

  leaves: Leaves
  grads: list
  auxes: list
  momenta: list | None
  stepped: list[bool]
  points: list
  noises: list
  next_key: Any
  free_updates: list
  free_state: Any

  def map(self, n_outputs: int, leaf_step: Callable, fill: tuple, *columns):
    """``leaf_step(constraint, *column_entries)`` for every stepped leaf, transposed (``fill`` at the others)."""
    return self.leaves.map(n_outputs, leaf_step, [not s for s in self.stepped], fill, *columns)

  def finish(self, new_params: list, new_auxes: list, given: list | None = None) -> tuple[Any, Any]:
    """The updates and the constraint states to keep, as trees.

    ``new_params`` are the new values (None where ``given``'s update, by
    default ``free=``'s, is taken as it is); ``new_auxes`` the stepped leaves'
    new constraint states (the others keep theirs).
    """
    updates = self.leaves.updates(new_params, self.free_updates if given is None else given)
    return self.leaves.unflatten(updates), self.kept(self._reconciled(new_auxes, updates))

  def _reconciled(self, new_auxes: list, updates: list) -> list:
    """Each stepped leaf's state for the parameter ``optax.apply_updates`` makes of its update (see
    :meth:`~cola_jax.Constraint.reconcile`); only constraints that override it compute that parameter."""
    leaves = self.leaves
    return [
      c.reconcile(jnp.asarray(optax.apply_updates(p, u)).astype(compute.dtype), aux)
      if s and type(c).reconcile is not Constraint.reconcile
      else aux
      for c, aux, p, u, compute, s in zip(
        leaves.constraints, new_auxes, leaves.params, updates, leaves.compute, self.stepped
      )
    ]

  def kept(self, new_auxes: list):
    """The constraint states to keep, as a tree: the stepped leaves' new ones, the others' as they were."""
    return self.leaves.kept([new if s else old for new, old, s in zip(new_auxes, self.auxes, self.stepped)])

  def values(self, new_params: list):
    """The new values as a tree, each in its parameter's dtype (a leaf not stepped stays as it was)."""
    return self.leaves.unflatten(
      [p if new is None else new.astype(p.dtype) for new, p in zip(new_params, self.leaves.params)]
    )


class Driver:
  """The per-leaf machinery of one transform, which its rule runs inside.

  Args:
    owner: the name errors and warnings give (``caller``'s).
    constraints: the constraint spec (a ``Constraint``, None, a pytree prefix,
      or a callable of the parameters), resolved once per tree structure,
      shapes and dtypes.
    free: ``free=``, the optax transformation of the unconstrained leaves, or None.
    steps_free_leaves: whether the rule steps the unconstrained leaves that
      ``free`` does not take (the CoLA methods' SGD steps), or leaves them to
      the rule's ``given`` updates (an inner optimizer's).
    check: ``check(path, constraint)`` raises for a constraint the transform does not step.
  """

  def __init__(
    self,
    owner: str,
    constraints: ConstraintSpec,
    *,
    free: optax.GradientTransformation | None = None,
    steps_free_leaves: bool = True,
    check: Callable[[str, Constraint], None] | None = None,
  ):
    self.owner = owner
    self.spec = constraints
    self.free = Free(owner, free)
    self.steps_free_leaves = steps_free_leaves
    self.check = check
    self._resolved: dict = {}
    self._said: set[str] = set()

  def leaves(self, params, say: bool = True) -> Leaves:
    """The leaves of ``params`` with their constraints, resolved the first time this structure is seen.

    ``say``: the resolution's warnings are said (each once per driver), as at
    ``init``; an update's resolution (a structure that could not be kept, a
    transform rebuilt by ``optax.inject_hyperparams``) says nothing: the
    ``init`` of its state said it.
    """
    leaves = Leaves(self.owner, params)
    try:
      constraints = self._resolved.get(leaves.signature)
    except TypeError:  # an unhashable tree structure
      constraints = None
    if constraints is None:
      constraints = _warn.gather(lambda: self._assign(leaves, params), self._said if say else None)
      try:
        hash(tuple(constraints))  # a traced hyperparameter is not kept beyond this trace
        self._resolved[leaves.signature] = constraints
      except TypeError:
        pass
    leaves.constraints = list(constraints)
    return leaves

  def _assign(self, leaves: Leaves, params) -> list[Constraint]:
    spec, what = (self.spec(params), "constraints(params)") if is_function(self.spec) else (self.spec, "constraints")
    fix = (
      "Give one Constraint or None for every leaf, a tree built from the parameters (jax.tree.map over them has "
      "their structure) with Constraint or None leaves, or a callable of them, such as "
      "cola.path_constraints([(regex, constraint), ...]), which fits any."
    )
    full = broadcast(self.owner, what, spec, params, _is_constraint_leaf, fix)
    assigned = leaves.treedef.flatten_up_to(full)
    constraints = []
    layers = _layers.of_leaves(params)
    for path, param, constraint, layer in zip(leaves.paths, leaves.params, assigned, layers):
      if constraint is None:
        constraint = _EUCLIDEAN
      if not isinstance(constraint, Constraint):
        raise TypeError(
          f"{self.owner}: the constraint for the leaf at {path} is "
          f"{constraint!r}; expected a cola_jax Constraint or None."
        )
      if not jnp.issubdtype(param.dtype, jnp.floating):
        raise TypeError(
          f"{self.owner}: the leaf at {path} has dtype {param.dtype}; parameters must be floating point "
          f"(params{path}).{equinox_hint(params)}"
        )
      constraint = _layers.read_in(constraint, layer, param.shape, path)
      constraint.validate(param, path)
      # A leaf without entries has nothing to move or constrain: it passes
      # as under optax.sgd (and reports no residual).
      constraint = _EUCLIDEAN if param.size == 0 else constraint
      if self.check is not None:
        self.check(path, constraint)
      constraints.append(constraint)
    return constraints

  def stepped(self, leaves: Leaves) -> list[bool]:
    """Per leaf: whether the rule steps it."""
    return [
      not taken and (self.steps_free_leaves or not free) for taken, free in zip(self.free.taken(leaves), leaves.free)
    ]

  def initial_states(self, leaves: Leaves):
    """The leaves' constraint states for a new run, as kept (a tree), compiled as one program."""
    return leaves.kept(_compiled.call(initial_auxes, (tuple(leaves.constraints),), leaves.compute))

  def begin(
    self,
    grads,
    params,
    constraint_states,
    *,
    momentum=None,
    free_state=None,
    key=None,
    draw: Callable | None = None,
    extra_args: dict | None = None,
  ) -> Update:
    """Everything an update's rule starts from: the checked leaves, their points and noise, ``free``'s update.

    ``momentum``: the state's momenta (checked at the stepped leaves).
    ``key`` and ``draw``: the step's key and each leaf's draw,
    ``draw(constraint, key, point)``; without either no noise is drawn and
    the key passes on unchanged.
    """
    leaves = self.leaves(params, say=False)
    grad_leaves = leaves.gradients(grads)
    stepped = self.stepped(leaves)
    skip = [not s for s in stepped]
    auxes, momenta = leaves.constraint_states(constraint_states, momentum, skip)
    free_updates, free_state = self.free.update(leaves, grads, free_state, params, extra_args or {})

    def point(c, param, aux, grad):
      return (c.point(*computed_after(grad, (param, aux))),)

    (points,) = leaves.map(1, point, skip, (None,), leaves.compute, auxes, grad_leaves)
    noises: list = [None] * len(points)
    next_key = key
    if key is not None and draw is not None:
      next_key, step_key = jax.random.split(key)
      drawn = [i for i, s in enumerate(stepped) if s]
      if drawn:
        keys = jax.random.split(step_key, len(points))  # one key per leaf, one array: a group's keys are one gather
        if len(drawn) < len(points):
          keys = keys[np.asarray(drawn)]
        draws = _step_noise.draw_leaves(
          draw,
          [leaves.constraints[i] for i in drawn],
          [points[i] for i in drawn],
          keys,
          [grad_leaves[i] for i in drawn],
        )
        for i, noise in zip(drawn, draws):
          noises[i] = noise
    return Update(leaves, grad_leaves, auxes, momenta, stepped, points, noises, next_key, free_updates, free_state)
