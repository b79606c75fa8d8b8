"""How far parameters are from their constraint manifolds."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from cola_jax import _compiled
from cola_jax._engine import holds_constraint_states


def _cola_state(state):
  """The one state inside ``state`` that holds its leaves' constraint states (any transform built on the engine)."""
  found = []

  def collect(node):
    if holds_constraint_states(node):
      found.append(node)
      return True
    return False

  jax.tree.flatten(state, is_leaf=collect)
  if len(found) != 1:
    raise ValueError(
      f"constraint_residuals: expected exactly one cola_od/cola_ud/constrained/manifold_muon state inside "
      f"the optimizer state, found {len(found)}."
    )
  return found[0]


def _is_leaf_state(x) -> bool:
  return x is None or isinstance(x, optax.MaskedNode) or hasattr(x, "residual")


def constraint_residuals(params: Any, state: Any) -> Any:
  """The constraint residual of every constrained leaf.

  Circle leaves report ``max |theta^2 + xi^2 - r^2| / r^2`` (and any excess of
  ``|theta|`` over ``r``, relative to ``r``); orthogonal leaves report
  ``max |Q^T Q - I|``. Unconstrained leaves are ``None``.

  Args:
    params: the parameters.
    state: the state of a ``cola_od`` / ``cola_ud`` / ``constrained`` / ``manifold_muon`` transform, or of any optax
      transformation containing exactly one (a chain, ``inject_hyperparams``).

  Returns:
    A pytree shaped like ``params`` with scalar residuals (``None`` for free
    leaves).

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(3, 2), 'b': jnp.zeros(2)}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), cola.o_cola_od(0.1))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> residuals = cola.constraint_residuals(params, state)  # max |W^T W - I| for w
    >>> residuals['b'], bool(residuals['w'] < 1e-5)
    (None, True)
  """
  cola_state = _cola_state(state)
  leaves, treedef = jax.tree.flatten(params)
  try:
    # optax.masked and optax.partition leave an optax.MaskedNode where the state
    # skips parameters: broadcast it over the parameters it stands for.
    auxes = treedef.flatten_up_to(jax.tree.broadcast(cola_state.constraint_states, params, is_leaf=_is_leaf_state))
  except (ValueError, TypeError) as error:
    raise ValueError(
      f"constraint_residuals: the state's constraint_states do not have the structure of params.\n{error}"
    ) from None
  return treedef.unflatten(_compiled.call(_residuals, (), leaves, auxes))


def _residuals(leaves: list, auxes: list) -> list:
  return [
    None if aux is None or isinstance(aux, optax.MaskedNode) else aux.residual(jnp.asarray(param))
    for param, aux in zip(leaves, auxes)
  ]
