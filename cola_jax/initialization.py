"""Putting parameters on their constraint manifolds before training."""

from typing import Any

from cola_jax._engine import Driver
from cola_jax._tree import ConstraintSpec


def project_params(params: Any, constraints: ConstraintSpec) -> Any:
  """The parameters with every constrained leaf moved onto its manifold.

  Each constrained leaf goes to its constraint's ``nearest``. A
  :class:`~cola_jax.Circle` weight with ``|w| > 0.99 r`` moves to ``0.99 r``
  with its sign, not to the bound: there its slack would be 0, the gradient
  has no component along the circle, and the weight would barely move;
  weights with ``|w| <= 0.99 r`` stay. Likewise a :class:`~cola_jax.Box`
  weight beyond a bound or within ``0.01 (upper - lower) / 2`` of it moves to
  that distance inside, and a :class:`~cola_jax.MaxNorm` unit with
  ``|w_j| > 0.99 r`` is scaled to ``|w_j| = 0.99 r``.
  :class:`~cola_jax.UnitNorm` units are scaled to norm ``r``,
  :class:`~cola_jax.NonNegative` weights at or below 0 lifted to ``0.00508``
  (where a force reaches them: at 0 none does), orthogonal leaves replaced
  by their polar factor (the nearest matrix with orthonormal columns or rows);
  free leaves are unchanged. A constrained leaf with an ``inf`` or NaN entry
  comes back as NaN (an :class:`~cola_jax.Implicit` one raises ValueError);
  finite leaves of any size are projected. The first update of a CoLA transform does the
  same, so this is for starting a run on the manifold (or looking at the
  initial network) rather than a requirement.

  Args:
    params: a pytree of parameters, e.g. a Flax model's ``variables['params']``.
    constraints: as for :func:`cola_jax.cola_od`; to match an alias, pass
      :func:`cola_jax.circle_constraints` or :func:`cola_jax.orthogonal_constraints`
      with the same ``radius`` and ``mask``.

  Returns:
    Parameters of the same structure and dtypes.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> params = {'w': jnp.array([[2.0, 0.0], [0.0, 0.5]]), 'b': jnp.array([3.0, -0.5]), 'free': jnp.ones(2)}
    >>> projected = cola.project_params(params, {'w': cola.Orthogonal(), 'b': cola.Circle(1.0), 'free': None})
    >>> with jnp.printoptions(precision=4):  # 3.0 beyond the circle's radius 1: 0.99, just inside
    ...   print(projected)
    {'b': Array([ 0.99, -0.5 ], dtype=float32), 'free': Array([1., 1.], dtype=float32),
     'w': Array([[1., 0.], [0., 1.]], dtype=float32)}
  """
  leaves = Driver("project_params", constraints).leaves(params)
  return leaves.unflatten(
    [c.nearest(p).astype(param.dtype) for c, p, param in zip(leaves.constraints, leaves.compute, leaves.params)]
  )
