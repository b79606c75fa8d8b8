"""Assigning constraints to parameter leaves, and checking the trees a transform gets.

Every check here runs where shapes and dtypes are static (at ``init``, or when
``update`` is traced): an error names the argument and the leaf's path, as in
``grads['layer0']['w']``, and nothing is added to the compiled step.
"""

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import optax

from cola_jax.constraints.base import Constraint, Euclidean

ConstraintTree = Any  # a prefix of params with Constraint or None leaves
ConstraintSpec = Constraint | ConstraintTree | Callable[[Any], ConstraintTree] | None

_EUCLIDEAN = Euclidean()


class NotParams:
  """A field of the state that holds no copy of the parameters, as ``optax.tree.map_params`` sees it.

  ``map_params`` calls ``init`` with a stand-in for the parameters and maps
  its function over the fields that come back as that stand-in. A transform
  puts this object, a leaf, where its state holds per-leaf auxiliaries that
  are not shaped like the parameters (``constraint_states``), so that
  ``map_params`` hands that whole field to ``transform_non_params``.
  """

  def __repr__(self):
    return "NotParams()"


NOT_PARAMS = NotParams()


@functools.cache
def _placeholder_type() -> type:
  """The type of the stand-in that ``optax.tree.map_params`` passes to ``init``, found through that function."""
  seen = []
  optax.tree_utils.tree_map_params(lambda placeholder: seen.append(type(placeholder)) or (), lambda x: x, ())
  return seen[0]


def is_params_placeholder(params) -> bool:
  """Whether ``init`` was called by ``optax.tree.map_params`` (with its stand-in, not with parameters)."""
  return isinstance(params, _placeholder_type())


def is_function(spec) -> TypeGuard[Callable[[Any], Any]]:
  """Whether ``spec`` (constraints, a mask, radii) is a function of the parameters rather than a tree of them.

  A pytree that is also callable (an Equinox module built with ``jax.tree.map``
  over the model) is a tree: its leaves are the spec, it is not called.
  """
  return callable(spec) and not isinstance(spec, Constraint) and jax.tree_util.treedef_is_leaf(jax.tree.structure(spec))


def _is_constraint_leaf(x) -> bool:
  return x is None or isinstance(x, Constraint)


class LeafLayout:
  """The leaves of a parameter tree, their paths and their constraints."""

  def __init__(self, owner: str, spec: ConstraintSpec, params):
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

  def updates(self, new_params: list, given: list | None = None):
    """``new - old`` for every leaf, in the parameter's own dtype; ``given``'s update as it is where ``new`` is None."""
    given = given or [None] * len(new_params)
    return self.unflatten(
      [
        update if new is None else (new - old).astype(param.dtype)
        for new, update, old, param in zip(new_params, given, self.compute, self.params)
      ]
    )

  def check_state(self, auxes: list, momenta: list | None = None) -> None:
    """Raises if the optimizer state does not fit the parameters and their constraints.

    ``momenta``: each leaf's stored momentum, None for a leaf that has none (one that ``free=`` moves).
    """
    for i, (path, p, constraint, aux) in enumerate(zip(self.paths, self.compute, self.constraints, auxes)):
      leaf = jax.ShapeDtypeStruct(p.shape, p.dtype)
      expected = jax.eval_shape(constraint.init, leaf)
      if jax.tree.structure(aux) != jax.tree.structure(expected):
        raise ValueError(
          f"{self.owner}: the optimizer state for the leaf at {path} does not "
          f"match its constraint {constraint!r} (state {type(aux).__name__}). "
          "Re-initialise the optimizer when constraints or parameters change."
        )
      stored = list(zip(jax.tree.leaves(aux), jax.tree.leaves(expected)))
      if momenta is not None and momenta[i] is not None:
        stored.append((momenta[i], jax.eval_shape(constraint.zero_momentum, leaf)))
      for got, want in stored:
        if jnp.shape(got) != want.shape:
          raise ValueError(
            f"{self.owner}: the optimizer state for params{path} holds an array of "
            f"shape {jnp.shape(got)} where a parameter of shape {p.shape} needs "
            f"{want.shape}: the state was initialised for parameters of other shapes. "
            "Re-initialise the optimizer when parameters change."
          )


def initial_auxes(constraints: tuple, compute: list) -> list:
  """Each leaf's auxiliary state for a new run (compiled as one program by the transforms' ``init``)."""
  return [c.init(p) for c, p in zip(constraints, compute)]


def without_variables(params):
  """``params`` with flax.nnx Variables replaced by their arrays.

  ``nnx.Optimizer`` initialises the transform on ``Param`` variables but updates
  it with plain arrays; a per-leaf constraint state built inside a Variable
  would come back from nnx as an ``nnx.State`` and no longer match.
  """
  nnx = sys.modules.get("flax.nnx")  # no Variables exist unless nnx is imported
  return params if nnx is None else nnx.as_pure(params)


def check_state(owner: str, state, expected: type) -> None:
  if not isinstance(state, expected):
    raise TypeError(
      f"{owner}: the optimizer state must be the {expected.__name__} returned by "
      f"init(), got {type(state).__name__}. (A checkpoint restored without a "
      "target comes back as dicts: restore it with tx.init(params) as the target.)"
    )


def hashable(constraint):
  """The constraint, or its identity when a hyperparameter is traced (inject_hyperparams): a key for grouping leaves."""
  try:
    hash(constraint)
  except TypeError:
    return id(constraint)
  return constraint
