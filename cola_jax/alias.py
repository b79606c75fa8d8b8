"""The paper's four methods by name, and the SGD-momentum hyperparameter map.

``c_cola_od``, ``c_cola_ud`` constrain weights to ``|theta| <= radius`` (circle
constraints); ``o_cola_od``, ``o_cola_ud`` keep weight matrices and kernels
orthonormal. By default the weight matrices are constrained (every leaf with
``ndim >= 2`` but biases, scales and embedding tables, named in a warning: the
rule of every entry, in docs/choosing.md); ``mask`` chooses otherwise, as in
``optax.masked``. The free leaves take the method's SGD (with momentum for
``_ud``) step, or the optax transformation given as ``free=``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cola_jax._default_leaves import weight_matrices
from cola_jax._hyperparameters import called_as, caller, check_nonnegative, check_positive
from cola_jax._tree import ConstraintSpec, broadcast, is_function
from cola_jax.constraints.circle import Circle
from cola_jax.constraints.orthogonal import Orthogonal
from cola_jax.langevin import Splitting
from cola_jax.transforms import cola_od, cola_ud

MaskOrFn = Any | Callable[[Any], Any] | None
RadiusSpec = float | Any | Callable[[Any], Any]


def _is_boolean(leaf) -> bool:
  return isinstance(leaf, (bool, np.bool_)) or (getattr(leaf, "dtype", None) == jnp.bool_ and jnp.ndim(leaf) == 0)


def _check_mask(owner: str, mask, where: str = "mask") -> None:
  """Raises TypeError unless every leaf of ``mask`` is a boolean (None leaves are free), as in ``optax.masked``."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(mask)[0]:
    if not _is_boolean(leaf):
      raise TypeError(
        f"{owner}: mask must be booleans, a pytree of them or a callable returning one (as in optax.masked), but "
        f"{where}{jax.tree_util.keystr(path)} is {leaf!r}. To choose constraints per leaf, pass them as "
        "constraints= (every CoLA method and cola.constrained take it; cola.path_constraints builds them by path)."
      )


def _as_written(number) -> str:
  """A number as a user writes it, also when it came as an array or a NumPy scalar (``optax.inject_hyperparams``)."""
  if type(number) in (int, float):
    return repr(number)
  try:
    return f"{float(number):g}"
  except TypeError:  # traced
    return repr(number)


def _per_leaf(spec, params, what: str, owner: str, fix: str):
  """A prefix pytree (or a callable giving one) broadcast to the parameters."""
  if is_function(spec):
    spec, what = spec(params), f"{what}(params)"
  return broadcast(owner, what, spec, params, lambda x: x is None, fix)


_BUILT = "a tree built from the parameters (jax.tree.map over them has their structure)"
_MASK_FIX = f"Give {_BUILT} with bool or None leaves, or a callable params -> mask, as for optax.masked."
_RADIUS_FIX = f"Give one number for every leaf, {_BUILT} with number or None leaves, or a callable params -> radii."


def _constraints_per_leaf(
  owner: str, mask: MaskOrFn, make: Callable[[Any, str], Any], constraint: str | None, spec: Any = True
):
  """A callable ``params -> tree of constraints``.

  A leaf gets ``make(leaf_spec, path)`` where ``mask`` is true and the leaf's
  entry of ``spec`` (a prefix pytree or a callable) is not None; else None.
  Without ``mask``, the weight matrices (the default rule, which names them;
  ``constraint`` spells the constraint for its message, None where ``spec``
  names the leaves).
  """

  if mask is not None and not is_function(mask):
    _check_mask(owner, mask)

  def constraints(params):
    if mask is None:
      chosen = weight_matrices(owner, params, constraint, "mask= or constraints=")
    else:
      chosen = mask(params) if is_function(mask) else mask
    if is_function(mask):
      _check_mask(owner, chosen, "mask(params)")
    masks = _per_leaf(chosen, params, "mask(params)" if is_function(mask) else "mask", owner, _MASK_FIX)
    specs = _per_leaf(spec, params, "radius", owner, _RADIUS_FIX)

    def assign(path, masked_in, leaf_spec, _):
      if masked_in is None or not masked_in or leaf_spec is None:
        return None
      return make(leaf_spec, jax.tree_util.keystr(path))

    return jax.tree_util.tree_map_with_path(assign, masks, specs, params, is_leaf=lambda x: x is None)

  return constraints


def _chosen(owner: str, constraints, preset: Callable[[], Any], **alternatives) -> Any:
  """``constraints`` if given (then none of the ``alternatives``, the preset's radius or mask), else ``preset()``."""
  if constraints is None:
    return preset()
  given = [f"{name}=" for name, value in alternatives.items() if value is not None]
  if given:
    raise ValueError(
      f"{owner}: constraints= chooses every leaf's constraint; {' and '.join(given)} would choose again. "
      "Give one or the other."
    )
  return constraints


def _circle_chosen(owner: str, constraints, radius, mask) -> Any:
  """The constraints of a c-CoLA preset: ``constraints``, or Circles of ``radius`` on the ``mask``'s leaves."""
  if radius is None and constraints is None:
    raise TypeError(
      f"{owner}: give radius= (every masked-in weight in [-radius, radius]) or constraints= (any "
      "constraint per leaf, e.g. cola.path_constraints([(r'Dense_1/kernel', cola.Circle(0.05))]))."
    )
  return _chosen(owner, constraints, lambda: circle_constraints(radius, mask=mask), mask=mask, radius=radius)


def circle_constraints(radius: RadiusSpec, *, mask: MaskOrFn = None):
  """The constraints of :func:`c_cola_od` and :func:`c_cola_ud`, as a callable.

  Returns a function ``params -> pytree`` with a :class:`~cola_jax.Circle` on
  each masked-in leaf whose radius is not None, for
  ``cola_od``/``cola_ud(constraints=...)`` or :func:`~cola_jax.project_params`.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> params = {'w': jnp.array([[0.3, -0.02], [0.0, 0.01]]), 'b': jnp.zeros(2)}
    >>> constraints = cola.circle_constraints(0.1)  # as c_cola_od(..., radius=0.1)
    >>> constraints(params)  # b (ndim 1) is free
    {'b': None, 'w': Circle(radius=0.1)}
    >>> cola.project_params(params, constraints)['w']
    Array([[ 0.099, -0.02 ], [ 0.   ,  0.01 ]], dtype=float32)
  """

  owner = caller("circle_constraints")
  if not is_function(radius):  # numbers known now are checked now
    for path, r in jax.tree_util.tree_flatten_with_path(radius)[0]:
      check_positive(owner, f"radius{jax.tree_util.keystr(path)}", r)

  def make(r, path):
    try:
      return Circle(r)
    except ValueError as error:
      raise ValueError(f"{owner}: the radius for the leaf at {path}: {error}") from None

  # A radius per leaf (a pytree or a callable) names the leaves: the default mask then frees the rest quietly.
  per_leaf = is_function(radius) or not jax.tree_util.treedef_is_leaf(jax.tree.structure(radius))
  spelled = None if per_leaf else f"cola.Circle({_as_written(radius)})"
  return _constraints_per_leaf(owner, mask, make, spelled, spec=radius)


def orthogonal_constraints(
  *,
  mask: MaskOrFn = None,
  tolerance: float = 1e-6,
  max_iterations: int = 20,
  projection: str = "quasi_newton",
  loop: str = "while",
):
  """The constraints of :func:`o_cola_od` and :func:`o_cola_ud`, as a callable.

  Returns a function ``params -> pytree`` with an :class:`~cola_jax.Orthogonal`
  on each masked-in leaf (default: the weight matrices, as for
  :func:`o_cola_od`).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> params = {'w': jnp.array([[2.0, 0.0], [0.0, 0.5], [0.0, 0.0]]), 'b': jnp.zeros(2)}
    >>> constraints = cola.orthogonal_constraints()  # as o_cola_od's
    >>> constraints(params)  # b (ndim 1) is free
    {'b': None, 'w': Orthogonal(tolerance=1e-06, ...)}
    >>> cola.project_params(params, constraints)['w']  # the nearest orthonormal columns
    Array([[1., 0.], [0., 1.], [0., 0.]], dtype=float32)
  """
  orthogonal = Orthogonal(tolerance=tolerance, max_iterations=max_iterations, projection=projection, loop=loop)
  return _constraints_per_leaf(caller("orthogonal_constraints"), mask, lambda *_: orthogonal, "cola.Orthogonal()")


def c_cola_od(
  learning_rate: optax.ScalarOrSchedule,
  *,
  radius: RadiusSpec | None = None,
  mask: MaskOrFn = None,
  constraints: ConstraintSpec = None,
  temperature: optax.ScalarOrSchedule = 0.0,
  key: jax.Array | None = None,
  free: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """c-CoLA-od: overdamped Langevin with ``|theta| <= radius`` per weight.

  In optax's terms: at temperature 0, on free leaves, this is
  ``optax.sgd(learning_rate)``; ``learning_rate`` is SGD's learning rate.
  ``free=optax.adam(1e-3)`` (any optax transformation) moves the free leaves
  instead. Parameters off their manifold are put on it by the first update
  (call :func:`~cola_jax.project_params` to start there).

  Args:
    learning_rate: the step size ``h > 0`` (SGD's learning rate), a number or
      an optax schedule.
    radius: ``r > 0``: a number, a pytree prefix of the parameters with number
      or ``None`` leaves (``None``: that leaf is free), or a callable mapping
      the parameters to such a pytree. Required unless ``constraints`` is given.
    mask: which leaves are constrained, as in ``optax.masked`` (a pytree of
      bools or a callable); default: the weight matrices, every leaf with
      ``ndim >= 2`` but biases, scales and embedding tables, named in a
      ``UserWarning`` when there are more than one (the rule of every entry,
      in docs/choosing.md, "Which leaves are constrained").
    constraints: instead of ``radius`` and ``mask``, every leaf's constraint, as for
      :func:`cola_jax.cola_od` (a ``Constraint``, a pytree prefix, or a
      callable such as :func:`cola_jax.path_constraints`); the method's
      dynamics stay those of its name.
    temperature: ``tau >= 0``, a number or an optax schedule.
    key: a JAX PRNG key, required unless ``temperature`` is exactly 0.
    free: an optax ``GradientTransformation`` for the unconstrained leaves
      (``optax.adam(1e-3)``), or ``None`` (default): SGD, as above. They then
      move exactly as ``optax.partition`` would move them with it, without
      noise, and the constrained leaves as without it; see
      :func:`cola_jax.cola_od`.

  Returns:
    An ``optax.GradientTransformation``, :func:`cola_jax.cola_od` with :class:`cola_jax.Circle` constraints.
    It is the last link of a chain (a transform after it would move the
    parameters off the manifold), and its ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.full((3, 2), 0.05), 'b': jnp.zeros(2)}
    >>> tx = cola.c_cola_od(0.1, radius=0.1)  # every entry of w in [-0.1, 0.1]; b is free
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.full((3, 2), -2.0), 'b': jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(jnp.abs(params['w']).max() <= 0.1), params['b']  # w would be 0.25 unconstrained
    (True, Array([-0.1, -0.1], dtype=float32))
  """
  with called_as("c_cola_od"):
    constraints = _circle_chosen("c_cola_od", constraints, radius, mask)
    return cola_od(learning_rate, constraints=constraints, temperature=temperature, key=key, free=free)


def c_cola_ud(
  learning_rate: optax.ScalarOrSchedule,
  *,
  friction: float | None = None,
  momentum: float | None = None,
  radius: RadiusSpec | None = None,
  mask: MaskOrFn = None,
  constraints: ConstraintSpec = None,
  temperature: optax.ScalarOrSchedule = 0.0,
  key: jax.Array | None = None,
  splitting: str | Splitting = "OBA",
  accumulator_dtype: Any = None,
  free: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """c-CoLA-ud: underdamped Langevin (OBA) with ``|theta| <= radius`` per weight.

  In optax's terms: ``c_cola_ud(1e-3, momentum=0.9)`` is, at temperature 0 on
  free leaves, ``optax.sgd(1e-3, momentum=0.9)``. With ``friction=``
  instead the arguments are the Langevin ones (the paper's): ``learning_rate``
  is the step ``h`` (SGD's learning rate is ``h**2``) and ``friction`` the rate
  ``gamma`` (SGD's momentum is ``exp(-gamma h)``), so ``c_cola_ud(1e-3,
  friction=0.9)`` is *not* SGD-m with momentum 0.9. ``free=optax.adam(1e-3)``
  (any optax transformation) moves the free leaves instead. Parameters off
  their manifold are put on it by the first update (call
  :func:`~cola_jax.project_params` to start there).

  The paper's Fashion-MNIST setting is ``c_cola_ud(0.3, friction=1.0,
  radius={'Dense_0': 0.05, 'Dense_1': 0.1})`` at temperature 0.

  Args:
    learning_rate: with ``friction``, the step size ``h > 0`` (SGD-m's learning
      rate is ``h**2``); with ``momentum``, optax.sgd's learning rate. A number
      or an optax schedule.
    friction: the friction rate ``gamma >= 0`` (SGD-m's momentum is
      ``exp(-gamma h)``; ``gamma = 0`` keeps all momentum). Give it or ``momentum``.
    momentum: instead of ``friction``, optax.sgd's momentum coefficient in
      ``[0, 1]``; ``learning_rate`` is then optax.sgd's learning rate ``h**2``
      (see :func:`cola_jax.cola_ud`).
    radius: ``r > 0``: a number, a pytree prefix of the parameters with number
      or ``None`` leaves (``None``: that leaf is free), or a callable mapping
      the parameters to such a pytree. Required unless ``constraints`` is given.
    mask: which leaves are constrained, as in ``optax.masked`` (a pytree of
      bools or a callable); default: the weight matrices, every leaf with
      ``ndim >= 2`` but biases, scales and embedding tables, named in a
      ``UserWarning`` when there are more than one (the rule of every entry,
      in docs/choosing.md, "Which leaves are constrained").
    constraints: instead of ``radius`` and ``mask``, every leaf's constraint, as for
      :func:`cola_jax.cola_od` (a ``Constraint``, a pytree prefix, or a
      callable such as :func:`cola_jax.path_constraints`); the method's
      dynamics stay those of its name.
    temperature: ``tau >= 0``, a number or an optax schedule.
    key: a JAX PRNG key, required unless ``temperature`` is exactly 0.
    splitting: ``"OBA"`` (the paper's), ``"BAOAB"`` or a :class:`~cola_jax.Splitting`; see
      :func:`cola_jax.cola_ud`.
    accumulator_dtype: the momenta's stored dtype; see :func:`cola_jax.cola_ud`.
    free: an optax ``GradientTransformation`` for the unconstrained leaves
      (``optax.adam(1e-3)``), or ``None`` (default): SGD with momentum, as
      above. They then move exactly as ``optax.partition`` would move them
      with it, without noise, and the constrained leaves as without it; see
      :func:`cola_jax.cola_ud`.

  Returns:
    An ``optax.GradientTransformation``, :func:`cola_jax.cola_ud` with :class:`cola_jax.Circle` constraints.
    It is the last link of a chain (a transform after it would move the
    parameters off the manifold), and its ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.full((3, 2), 0.05), 'b': jnp.zeros(2)}
    >>> tx = cola.c_cola_ud(0.3, friction=1.0, radius={'w': 0.1, 'b': None})
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.full((3, 2), -2.0), 'b': jnp.ones(2)}
    >>> for _ in range(3):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> bool(jnp.abs(params['w']).max() <= 0.1), int(state.count)
    (True, 3)

    With Adam on the free leaves (``b`` here):

    >>> tx = cola.c_cola_ud(0.3, friction=1.0, radius=0.1, free=optax.adam(1e-3))
    >>> params = {'w': jnp.full((3, 2), 0.05), 'b': jnp.zeros(2)}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> optax.apply_updates(params, updates)['b'].round(5)  # Adam's first step: -1e-3 sign(g)
    Array([-0.001, -0.001], dtype=float32)
  """
  with called_as("c_cola_ud"):
    constraints = _circle_chosen("c_cola_ud", constraints, radius, mask)
    return cola_ud(
      learning_rate,
      friction=friction,
      momentum=momentum,
      constraints=constraints,
      temperature=temperature,
      key=key,
      splitting=splitting,
      accumulator_dtype=accumulator_dtype,
      free=free,
    )


def o_cola_od(
  learning_rate: optax.ScalarOrSchedule,
  *,
  mask: MaskOrFn = None,
  constraints: ConstraintSpec = None,
  temperature: optax.ScalarOrSchedule = 0.0,
  key: jax.Array | None = None,
  tolerance: float = 1e-6,
  max_iterations: int = 20,
  projection: str = "quasi_newton",
  loop: str = "while",
  free: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """o-CoLA-od: overdamped Langevin with orthonormal weight matrices and kernels.

  In optax's terms: at temperature 0, on free leaves, this is
  ``optax.sgd(learning_rate)``; ``learning_rate`` is SGD's learning rate.
  ``free=optax.adam(1e-3)`` (any optax transformation) moves the free leaves
  instead. Parameters off their manifold are put on it by the first update
  (call :func:`~cola_jax.project_params` to start there).

  Args:
    learning_rate: the step size ``h > 0`` (SGD's learning rate), a number or
      an optax schedule.
    mask: which leaves are constrained (pytree of bools or callable);
      default: the weight matrices, every leaf with ``ndim >= 2`` but biases,
      scales and embedding tables, named in a ``UserWarning`` when there are
      more than one (the rule of every entry, in docs/choosing.md, "Which
      leaves are constrained"). The first and last layers are among them; the
      paper keeps them free. A masked-in leaf with ``ndim < 2`` is an error
      naming its path.
    constraints: instead of ``mask``, every leaf's constraint, as for
      :func:`cola_jax.cola_od` (a ``Constraint``, a pytree prefix, or a
      callable such as :func:`cola_jax.path_constraints`); the method's
      dynamics stay those of its name.
    temperature: ``tau >= 0``, a number or an optax schedule.
    key: a JAX PRNG key, required unless ``temperature`` is exactly 0.
    tolerance: projection tolerance on ``max |Q^T Q - I|``.
    max_iterations: bound on quasi-Newton iterations per projection.
    projection: the solver of the projection, as for :class:`cola_jax.Orthogonal`.
    loop: ``"while"`` or ``"fixed"`` (no host round trips), as for
      :class:`cola_jax.Orthogonal`.
    free: an optax ``GradientTransformation`` for the unconstrained leaves
      (``optax.adam(1e-3)``), or ``None`` (default): SGD, as above. They then
      move exactly as ``optax.partition`` would move them with it, without
      noise, and the constrained leaves as without it; see
      :func:`cola_jax.cola_od`.

  Returns:
    An ``optax.GradientTransformation``, :func:`cola_jax.cola_od` with :class:`cola_jax.Orthogonal` constraints.
    It is the last link of a chain (a transform after it would move the
    parameters off the manifold), and its ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.o_cola_od(0.1)  # w keeps orthonormal columns; b is free
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> w = params['w']
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-5))
    True
  """
  with called_as("o_cola_od"):
    orthogonal = lambda: orthogonal_constraints(
      mask=mask, tolerance=tolerance, max_iterations=max_iterations, projection=projection, loop=loop
    )
    constraints = _chosen("o_cola_od", constraints, orthogonal, mask=mask)
    return cola_od(learning_rate, constraints=constraints, temperature=temperature, key=key, free=free)


def o_cola_ud(
  learning_rate: optax.ScalarOrSchedule,
  *,
  friction: float | None = None,
  momentum: float | None = None,
  mask: MaskOrFn = None,
  constraints: ConstraintSpec = None,
  temperature: optax.ScalarOrSchedule = 0.0,
  key: jax.Array | None = None,
  tolerance: float = 1e-6,
  max_iterations: int = 20,
  splitting: str | Splitting = "OBA",
  projection: str = "quasi_newton",
  loop: str = "while",
  accumulator_dtype: Any = None,
  free: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
  """o-CoLA-ud: underdamped Langevin (OBA, RATTLE A step) with orthonormal weights.

  In optax's terms: ``o_cola_ud(1e-3, momentum=0.9)`` is, at temperature 0 on
  free leaves, ``optax.sgd(1e-3, momentum=0.9)``. With ``friction=``
  instead the arguments are the Langevin ones (the paper's): ``learning_rate``
  is the step ``h`` (SGD's learning rate is ``h**2``) and ``friction`` the rate
  ``gamma`` (SGD's momentum is ``exp(-gamma h)``), so ``o_cola_ud(1e-3,
  friction=0.9)`` is *not* SGD-m with momentum 0.9. ``free=optax.adam(1e-3)``
  (any optax transformation) moves the free leaves instead. Parameters off
  their manifold are put on it by the first update (call
  :func:`~cola_jax.project_params` to start there).

  Args:
    learning_rate: with ``friction``, the step size ``h > 0`` (SGD-m's learning
      rate is ``h**2``); with ``momentum``, optax.sgd's learning rate. A number
      or an optax schedule.
    friction: the friction rate ``gamma >= 0`` (SGD-m's momentum is
      ``exp(-gamma h)``; ``gamma = 0`` keeps all momentum). Give it or ``momentum``.
    momentum: instead of ``friction``, optax.sgd's momentum coefficient in
      ``[0, 1]``; ``learning_rate`` is then optax.sgd's learning rate ``h**2``
      (see :func:`cola_jax.cola_ud`).
    mask: which leaves are constrained (pytree of bools or callable);
      default: the weight matrices, every leaf with ``ndim >= 2`` but biases,
      scales and embedding tables, named in a ``UserWarning`` when there are
      more than one (the rule of every entry, in docs/choosing.md, "Which
      leaves are constrained"). The first and last layers are among them; the
      paper keeps them free. A masked-in leaf with ``ndim < 2`` is an error
      naming its path.
    constraints: instead of ``mask``, every leaf's constraint, as for
      :func:`cola_jax.cola_od` (a ``Constraint``, a pytree prefix, or a
      callable such as :func:`cola_jax.path_constraints`); the method's
      dynamics stay those of its name.
    temperature: ``tau >= 0``, a number or an optax schedule.
    key: a JAX PRNG key, required unless ``temperature`` is exactly 0.
    splitting: ``"OBA"`` (the paper's), ``"BAOAB"`` or a :class:`~cola_jax.Splitting`; see
      :func:`cola_jax.cola_ud`.
    tolerance: projection tolerance on ``max |Q^T Q - I|``.
    max_iterations: bound on quasi-Newton iterations per projection.
    projection: the solver of the projection, as for :class:`cola_jax.Orthogonal`.
    loop: ``"while"`` or ``"fixed"`` (no host round trips), as for
      :class:`cola_jax.Orthogonal`.
    accumulator_dtype: the momenta's stored dtype; see :func:`cola_jax.cola_ud`.
    free: an optax ``GradientTransformation`` for the unconstrained leaves
      (``optax.adam(1e-3)``), or ``None`` (default): SGD with momentum, as
      above. They then move exactly as ``optax.partition`` would move them
      with it, without noise, and the constrained leaves as without it; see
      :func:`cola_jax.cola_ud`.

  Returns:
    An ``optax.GradientTransformation``, :func:`cola_jax.cola_ud` with :class:`cola_jax.Orthogonal` constraints.
    It is the last link of a chain (a transform after it would move the
    parameters off the manifold), and its ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.o_cola_ud(0.1, friction=1.0)  # w keeps orthonormal columns; b is free
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> for _ in range(3):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> w = params['w']
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-5))
    True
  """
  with called_as("o_cola_ud"):
    orthogonal = lambda: orthogonal_constraints(
      mask=mask, tolerance=tolerance, max_iterations=max_iterations, projection=projection, loop=loop
    )
    constraints = _chosen("o_cola_ud", constraints, orthogonal, mask=mask)
    return cola_ud(
      learning_rate,
      friction=friction,
      momentum=momentum,
      constraints=constraints,
      temperature=temperature,
      key=key,
      splitting=splitting,
      accumulator_dtype=accumulator_dtype,
      free=free,
    )


def sgd_momentum_to_langevin(learning_rate: float, momentum: float) -> tuple[float, float]:
  r"""The ``(h, gamma)`` of :func:`cola_ud` that reproduce SGD with momentum.

  With ``tau = 0``, no constraint and zero initial momentum, the OBA step with
  step size ``h`` and friction ``gamma`` equals
  ``optax.sgd(learning_rate, momentum=momentum)`` when

  .. math::
    h = \sqrt{\text{learning\_rate}}, \qquad \gamma = -\log(\text{momentum}) / h.

  Args:
    learning_rate: SGD's learning rate, ``> 0``.
    momentum: SGD's momentum, in ``(0, 1]``.

  Returns:
    ``(h, gamma)``.

  Example:
    >>> import jax.numpy as jnp, optax, cola_jax as cola
    >>> h, gamma = cola.sgd_momentum_to_langevin(0.1, 0.9)
    >>> round(h, 3), round(gamma, 3)
    (0.316, 0.333)
    >>> cola_tx, sgd_tx = cola.cola_ud(h, friction=gamma), optax.sgd(0.1, momentum=0.9)
    >>> params = cola_params = sgd_params = jnp.array([1.0, -2.0])
    >>> cola_state, sgd_state = cola_tx.init(params), sgd_tx.init(params)
    >>> grads = jnp.array([0.5, 0.5])
    >>> for _ in range(2):
    ...   updates, cola_state = cola_tx.update(grads, cola_state, cola_params)
    ...   cola_params = optax.apply_updates(cola_params, updates)
    ...   updates, sgd_state = sgd_tx.update(grads, sgd_state, sgd_params)
    ...   sgd_params = optax.apply_updates(sgd_params, updates)
    >>> bool(jnp.allclose(cola_params, sgd_params))
    True
  """
  check_positive("sgd_momentum_to_langevin", "learning_rate", learning_rate)
  check_positive("sgd_momentum_to_langevin", "momentum", momentum)
  if not 0 < momentum <= 1:
    raise ValueError(
      f"momentum must be in (0, 1], got {momentum!r} (momentum 0 is infinite friction; use cola_od for plain SGD)."
    )
  h = math.sqrt(learning_rate)
  return h, -math.log(momentum) / h


def langevin_to_sgd_momentum(learning_rate: float, friction: float) -> tuple[float, float]:
  """The inverse of :func:`sgd_momentum_to_langevin`: ``(h**2, exp(-gamma h))``.

  Example:
    >>> import cola_jax as cola
    >>> # The paper's c-CoLA-ud, h = 0.3 and gamma = 1, as SGD-m hyperparameters:
    >>> learning_rate, momentum = cola.langevin_to_sgd_momentum(0.3, 1.0)
    >>> round(learning_rate, 3), round(momentum, 3)
    (0.09, 0.741)
    >>> tuple(round(x, 3) for x in cola.sgd_momentum_to_langevin(learning_rate, momentum))
    (0.3, 1.0)
  """
  check_positive("langevin_to_sgd_momentum", "learning_rate", learning_rate)
  check_nonnegative("langevin_to_sgd_momentum", "friction", friction)
  return learning_rate**2, math.exp(-friction * learning_rate)
