"""The Flax box that carries a constraint beside a parameter (imports flax).

One class serves both Flax APIs: linen keeps an initializer's
``flax.core.meta.AxisMetadata`` box in the variables (and strips it with
``flax.linen.meta.unbox``), nnx reads an initializer's ``VariableMetadata`` into
the metadata of the ``nnx.Variable`` it creates. Only :mod:`cola_jax.declared`
imports this module, and only when Flax is in use.
"""

from typing import Any

import jax
from flax.core import meta
from flax.nnx import variablelib

from cola_jax.constraints.base import Constraint

METADATA_KEY = "constraint"  # the nnx Variable metadata entry: ``variable.constraint``
SHAPE_KEY = "constraint_shape"  # the shape the constraint was declared for (nnx)


class Constrained(variablelib.VariableMetadata, meta.AxisMetadata):
  """A parameter value on the manifold of ``constraint``, boxed with it.

  A pytree node with one child (the value); the constraint is static
  (hashable aux data), so jit, grad, optax and orbax see the value only, and
  trees with the same constraints have equal structures. ``shape``, given when
  the box is made by an initializer, goes into an nnx Variable's metadata, so
  that a parameter whose shape changed later (``nnx.vmap`` stacking layers) is
  caught instead of constrained as one matrix.
  """

  def __init__(self, value, constraint: Constraint, shape=None):
    metadata: dict[str, Any] = {METADATA_KEY: constraint}
    if shape is not None:
      metadata[SHAPE_KEY] = tuple(shape)
    super().__init__(value, metadata=metadata)

  @property
  def constraint(self) -> Constraint:
    return self.metadata[METADATA_KEY]

  @property
  def shape(self):  # where Flax reads a shape (nn.get_partition_spec), the box is its array
    return self.raw_value.shape

  def __repr__(self):
    return f"Constrained({self.raw_value!r}, constraint={self.constraint!r})"

  def unbox(self):
    return self.raw_value

  def replace_boxed(self, val):
    return Constrained(val, self.constraint)

  def add_axis(self, index, params):
    raise ValueError(
      f"A parameter declared with cola.with_constraint(..., {self.constraint!r}) "
      "cannot gain an axis in a lifted transform (nn.scan, nn.vmap): the axis would "
      "change what the constraint means. Give the stacked parameter's constraint "
      "with cola.path_constraints or an explicit constraint pytree instead."
    )

  def remove_axis(self, index, params):
    raise ValueError(
      f"A parameter declared with cola.with_constraint(..., {self.constraint!r}) "
      "cannot lose an axis in a lifted transform (nn.scan, nn.vmap)."
    )


def _unflatten(constraint, children):
  (value,) = children
  return Constrained(value, constraint)


jax.tree_util.register_pytree_with_keys(
  Constrained,
  lambda box: (((jax.tree_util.GetAttrKey("raw_value"), box.raw_value),), box.constraint),
  _unflatten,
  lambda box: ((box.raw_value,), box.constraint),
)

AxisMetadata = meta.AxisMetadata
Variable = variablelib.Variable
VariableMetadata = variablelib.VariableMetadata
