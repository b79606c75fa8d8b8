"""Assigning constraints to parameter leaves, with errors that name the leaf."""

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

from cola_jax.constraints.base import Constraint, Euclidean

ConstraintTree = Any  # a prefix of params with Constraint or None leaves
ConstraintSpec = Union[None, Constraint, ConstraintTree, Callable[[Any], ConstraintTree]]

_EUCLIDEAN = Euclidean()


def _is_constraint_leaf(x) -> bool:
  return x is None or isinstance(x, Constraint)


class LeafLayout:
  """The leaves of a parameter tree, their paths and their constraints."""

  def __init__(self, owner: str, spec: ConstraintSpec, params):
    if params is None:
      raise ValueError(
          f"{owner}: update() needs the current parameters: call "
          "tx.update(grads, state, params). The constrained step is computed "
          "from the parameters, not from the gradients alone.")
    self.owner = owner
    paths_and_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.paths = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
    self.params = [leaf for _, leaf in paths_and_leaves]
    self.constraints = self._assign(spec, params)
    # The geometry runs in at least float32 (float64 stays float64); updates
    # are returned in each parameter's own dtype.
    self.compute = [p.astype(jnp.promote_types(p.dtype, jnp.float32)) for p in self.params]

  def _assign(self, spec, params) -> list[Constraint]:
    if callable(spec) and not isinstance(spec, Constraint):
      spec = spec(params)
    try:
      full = jax.tree.broadcast(spec, params, is_leaf=_is_constraint_leaf)
      assigned = self.treedef.flatten_up_to(full)
    except ValueError as error:
      raise ValueError(
          f"{self.owner}: constraints must be a Constraint, None, or a pytree "
          f"prefix of the parameters with Constraint or None leaves.\n{error}") from None
    constraints = []
    for path, param, constraint in zip(self.paths, self.params, assigned):
      if constraint is None:
        constraint = _EUCLIDEAN
      if not isinstance(constraint, Constraint):
        raise TypeError(
            f"{self.owner}: the constraint for the leaf at {path} is "
            f"{constraint!r}; expected a cola_jax Constraint or None.")
      if not jnp.issubdtype(jnp.result_type(param), jnp.floating):
        raise TypeError(
            f"{self.owner}: the leaf at {path} has dtype {jnp.result_type(param)}; "
            "parameters must be floating point.")
      constraint.validate(param, path)
      constraints.append(constraint)
    return constraints

  def flatten(self, tree, what: str) -> list:
    """The subtrees of ``tree`` at the parameters' leaves, or a clear error."""
    try:
      return self.treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
      raise ValueError(
          f"{self.owner}: {what} does not have the structure of the parameters "
          f"(was the optimizer state initialised with other parameters?).\n{error}") from None

  def unflatten(self, leaves: list):
    return self.treedef.unflatten(leaves)

  def gradients(self, grads) -> list:
    """The gradient leaves, in the compute dtype of their parameters."""
    return [g.astype(p.dtype) for g, p in zip(self.flatten(grads, "grads"), self.compute)]

  def updates(self, new_params: list):
    """``new - old`` for every leaf, in the parameter's own dtype."""
    return self.unflatten([
        (new - old).astype(param.dtype)
        for new, old, param in zip(new_params, self.compute, self.params)])

  def check_aux(self, auxes: list) -> None:
    """Raises if a leaf's stored auxiliary state does not fit its constraint."""
    for path, param, constraint, aux in zip(self.paths, self.params, self.constraints, auxes):
      expected = jax.tree.structure(
          jax.eval_shape(constraint.init, jax.ShapeDtypeStruct(param.shape, param.dtype)))
      if jax.tree.structure(aux) != expected:
        raise ValueError(
            f"{self.owner}: the optimizer state for the leaf at {path} does not "
            f"match its constraint {constraint!r} (state {type(aux).__name__}). "
            "Re-initialise the optimizer when constraints or parameters change.")
