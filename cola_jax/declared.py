"""Constraints declared on the model: initializers that carry them, and reading them back.

``with_constraint(initializer, constraint)`` is a parameter initializer for
Flax linen and nnx layers; the parameter it makes starts on the constraint's
manifold and keeps the constraint as metadata. ``constraints_from`` reads that
metadata back as the constraint pytree that ``constraints=`` takes. Flax is
imported only when one of them meets a Flax object.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cola_jax.constraints.base import Constraint


def _flax_metadata(owner: str):
  try:
    from cola_jax import _flax_metadata
  except ImportError as error:
    raise ImportError(
      f"{owner} declares constraints in Flax metadata and needs Flax: pip install 'cola-jax[flax]'."
    ) from error
  return _flax_metadata


def is_box(x) -> bool:
  """Whether ``x`` wraps a parameter: a linen ``AxisMetadata`` box or an nnx ``Variable``."""
  if "flax" not in sys.modules:  # no Flax objects exist unless Flax is imported
    return False
  from cola_jax import _flax_metadata

  return isinstance(x, (_flax_metadata.AxisMetadata, _flax_metadata.Variable))


def _on_manifold(value, constraint: Constraint):
  """``constraint.nearest`` of an initial value, computed as ``project_params`` does."""
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
      f"with_constraint(..., {constraint!r}): the initializer returned dtype "
      f"{value.dtype}; constrained parameters must be floating point."
    )
  constraint.validate(value, "<with_constraint initializer>")
  compute = value.astype(jnp.promote_types(value.dtype, jnp.float32))
  return constraint.nearest(compute).astype(value.dtype)


def _declare(value, constraint: Constraint, flax_metadata):
  """``value`` (an initializer's output) on the manifold, carrying ``constraint``."""
  if isinstance(value, flax_metadata.Constrained) or (
    isinstance(value, flax_metadata.VariableMetadata) and flax_metadata.METADATA_KEY in value.metadata
  ):
    raise ValueError(
      f"with_constraint(..., {constraint!r}): the initializer already declares the "
      f"constraint {value.metadata[flax_metadata.METADATA_KEY]!r}; a parameter "
      "carries one constraint."
    )
  if isinstance(value, flax_metadata.VariableMetadata):  # nnx, e.g. nnx.with_partitioning
    declared = {flax_metadata.METADATA_KEY: constraint, flax_metadata.SHAPE_KEY: tuple(jnp.shape(value.raw_value))}
    return dataclasses.replace(
      value, raw_value=_on_manifold(value.raw_value, constraint), metadata={**value.metadata, **declared}
    )
  if isinstance(value, flax_metadata.AxisMetadata):  # linen, e.g. nn.with_partitioning
    # The constraint goes inside, so that the outer box (and its partition
    # spec) stays where Flax looks for it.
    return value.replace_boxed(_declare(value.unbox(), constraint, flax_metadata))
  return flax_metadata.Constrained(_on_manifold(value, constraint), constraint, jnp.shape(value))


def with_constraint(initializer: Callable[..., Any], constraint: Constraint) -> Callable[..., Any]:
  """A parameter initializer whose value lies on ``constraint``'s manifold and carries it.

  The value is ``constraint.nearest(initializer(key, shape, dtype))``, computed
  in at least float32 and cast back, as :func:`cola_jax.project_params` does.
  The constraint travels with the parameter:

  * in Flax linen (``nn.Dense(..., kernel_init=...)``) as a
    ``flax.core.meta.AxisMetadata`` box around the value: ``module.apply``
    takes the boxed variables, ``flax.linen.meta.unbox`` gives plain arrays,
    and it composes with ``nn.with_partitioning`` in either order;
  * in Flax nnx (``nnx.Linear(..., kernel_init=..., rngs=...)``) as the
    ``constraint`` entry of the ``nnx.Param``'s metadata
    (``model.linear.kernel.constraint``). With ``nnx.with_partitioning``,
    write ``with_constraint(nnx.with_partitioning(init, names), constraint)``:
    nnx does not unwrap initializer metadata nested the other way.

  :func:`constraints_from` reads the constraints back as the pytree that
  ``constraints=`` takes. A declared parameter whose shape changes after its
  initializer ran (layers stacked by linen's ``nn.scan``/``nn.vmap`` or by
  ``nnx.vmap``, a kernel reshaped by ``nnx.LinearGeneral``) is an error, since
  the new axes would change what the constraint means; give those constraints
  with :func:`cola_jax.path_constraints`.

  Args:
    initializer: any Flax/JAX initializer ``(key, shape, dtype) -> array``,
      also one that returns Flax metadata (``nn.with_partitioning``,
      ``nnx.with_partitioning``, ``nnx.with_metadata``).
    constraint: the :class:`cola_jax.Constraint` of the parameter.

  Returns:
    An initializer with the signature of ``initializer``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, cola_jax as cola
    >>> layer = nn.Dense(2, kernel_init=cola.with_constraint(
    ...     nn.initializers.lecun_normal(), cola.Orthogonal()))
    >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> variables['params']['kernel'].constraint
    Orthogonal(tolerance=1e-06, ...)
    >>> w = nn.meta.unbox(variables)['params']['kernel']  # it starts orthonormal
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-5))
    True
  """
  if not callable(initializer):
    raise TypeError(f"with_constraint: initializer must be callable, got {initializer!r}.")
  if not isinstance(constraint, Constraint):
    raise TypeError(
      f"with_constraint: constraint must be a cola_jax Constraint (Circle, "
      f"Orthogonal, MaxNorm, ...), got {constraint!r}."
    )
  flax_metadata = _flax_metadata("with_constraint")

  @functools.wraps(initializer)
  def init(*args, **kwargs):
    return _declare(initializer(*args, **kwargs), constraint, flax_metadata)

  return init


def _declared_constraint(leaf, flax_metadata):
  """The constraint a parameter (a box, a Variable, or an array) declares, or None."""
  if isinstance(leaf, flax_metadata.Variable):
    metadata = leaf.get_metadata()
    declared = metadata.get(flax_metadata.METADATA_KEY)
    inner = leaf.get_raw_value()
    shape = metadata.get(flax_metadata.SHAPE_KEY)
    if declared is not None and shape is not None and tuple(jnp.shape(inner)) != shape:
      raise ValueError(
        f"constraints_from: an nnx {type(leaf).__name__} of shape {tuple(jnp.shape(inner))} "
        f"declares {declared!r} for the shape {shape} it was initialised with (nnx.vmap or "
        "nnx.scan stacked it, or the layer reshaped its kernel), which changes what the "
        "constraint means. Give the constraint of the stacked parameter with "
        "cola.path_constraints or an explicit constraint pytree instead."
      )
  else:
    declared, inner = None, leaf
  boxes = [
    box
    for box in jax.tree.leaves(inner, is_leaf=lambda x: isinstance(x, flax_metadata.Constrained))
    if isinstance(box, flax_metadata.Constrained)
  ]
  if isinstance(leaf, flax_metadata.Variable) and boxes:
    raise ValueError(
      f"constraints_from: an nnx {type(leaf).__name__} holds a with_constraint box as "
      "its value, so nnx never saw the constraint. Write "
      "cola.with_constraint(nnx.with_partitioning(init, names), constraint), not "
      "nnx.with_partitioning(cola.with_constraint(init, constraint), names)."
    )
  if len(boxes) > 1:
    raise ValueError(
      f"constraints_from: one parameter declares {len(boxes)} constraints "
      f"{[box.constraint for box in boxes]}; a parameter carries one constraint."
    )
  return boxes[0].constraint if boxes else declared


def constraints_from(tree: Any) -> Any:
  """The constraints declared with :func:`with_constraint`, as a constraint pytree.

  Args:
    tree: linen parameters or variables as ``Module.init`` returns them (still
      boxed), or an nnx ``State`` of Variables such as
      ``nnx.state(model, nnx.Param)``. Other boxes (``nn.Partitioned``) and
      Variables are looked through.

  Returns:
    A pytree with the structure of the unboxed ``tree`` (of
    ``nnx.as_pure(tree)`` for nnx) whose leaves are the declared constraints,
    and None for free parameters: what ``constraints=`` of
    :func:`cola_jax.cola_od` and :func:`cola_jax.cola_ud` takes, for the boxed
    or the unboxed parameters alike (so in ``TrainState`` and
    ``nnx.Optimizer`` unchanged).

  Raises:
    ValueError: no parameter of ``tree`` declares a constraint (it was unboxed
      first, or comes from ``nnx.as_pure``), one declares two, or an nnx
      parameter's shape is no longer the one its constraint was declared for.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, cola_jax as cola
    >>> layer = nn.Dense(2, kernel_init=cola.with_constraint(nn.initializers.zeros, cola.Circle(0.1)))
    >>> x = jnp.ones((1, 3))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> constraints = cola.constraints_from(variables['params'])
    >>> constraints
    {'bias': None, 'kernel': Circle(radius=0.1)}
    >>> params = nn.meta.unbox(variables['params'])
    >>> tx = cola.cola_od(0.1, constraints=constraints)
    >>> state = tx.init(params)
    >>> loss = lambda params: -jnp.sum(layer.apply({'params': params}, x))
    >>> updates, state = tx.update(jax.grad(loss)(params), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(jnp.abs(params['kernel']).max() <= 0.1)
    True
  """
  if "flax" in sys.modules:
    flax_metadata = _flax_metadata("constraints_from")
    constraints = jax.tree.map(lambda leaf: _declared_constraint(leaf, flax_metadata), tree, is_leaf=is_box)
    if jax.tree.leaves(constraints):
      return constraints
  raise ValueError(
    "constraints_from: no parameter in the tree declares a constraint. Pass the "
    "parameters as Flax made them: linen variables before flax.linen.meta.unbox, or "
    "an nnx State of Variables (nnx.state(model, nnx.Param), not nnx.as_pure), of a "
    "model whose initializers are wrapped in cola.with_constraint."
  )
