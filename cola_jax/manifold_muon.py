r"""Manifold Muon: steepest descent under the spectral norm on the Stiefel manifold.

For a weight ``W`` with orthonormal columns (``W^T W = I``, the
:class:`~cola_jax.Orthogonal` constraint) and a gradient or momentum ``G``, the
step direction is the tangent vector of unit spectral norm that decreases the
loss fastest to first order,

.. math::
  A = \arg\max_{A} \langle G, A \rangle \quad\text{subject to}\quad
  \|A\|_2 \le 1, \quad W^T A + A^T W = 0,

and the step is ``W <- R_W(-eta A)``, a retraction to the manifold. Muon solves
the same problem without the tangency condition (its answer is the matrix sign
``msign(G)``); with it, the direction is the one the blog post "Modular
Manifolds" (Bernstein, Thinking Machines, 2025) calls manifold Muon.

How ``A`` is found.

* Square ``W`` (``W^T W = W W^T = I``): every tangent vector is ``W Omega``
  with ``Omega`` skew and ``|W Omega|_2 = |Omega|_2``, so
  ``A = W msign(skew(W^T G))`` in closed form (the matrix sign of a skew
  matrix is skew).
* Tall ``W`` (``n x p``, ``n > p``): a tangent vector is
  ``W Omega + E B`` with ``E`` an orthonormal basis of the part of the
  complement of ``W`` that ``G`` reaches (``m = min(p, n - p)`` columns, from
  one QR factorisation of ``[W, G - W W^T G]``) and ``A^T A = Omega^T Omega +
  B^T B``. The problem is the same in these ``(p + m) x p`` coordinates, and is
  solved there by ADMM (Boyd et al., 2011): alternating projections onto the
  spectral-norm ball (singular values clipped at 1, from a ``p x p``
  eigendecomposition) and onto the tangent space (``Omega`` made skew), with
  the penalty balanced between the two residuals. It stops when both residuals
  (``|A - Z|_F / p`` and ``rho |Z_{k+1} - Z_k|_F / p``) are at most
  ``tolerance``, and reports the iterations it took, whether it got there,
  and a certificate: the direction returned is feasible (tangent, spectral
  norm at most 1), and the multiplier ADMM holds bounds the best value from
  above (weak duality), so ``gap = 1 - <G, A> / bound`` is a proven bound on
  how far from the steepest direction it is, whether or not it converged.
  The reference's dual ascent on the multiplier ``Lambda`` (``A =
  msign(G + 2 W Lambda)``) solves the same problem: its objective is
  non-smooth wherever ``G + 2 W Lambda`` loses rank, and there it stalls.

On XLA:CPU, under ``jax.vmap`` a step loops over the models (seeds), each
leaf's direction and retraction one model at a time, and
:func:`steepest_tangent_direction` loops over a batch of matrices (a stacked
leaf's) (:func:`~cola_jax._platform.one_matrix_at_a_time`): jaxlib 0.10.2's
batched CPU LAPACK kernels block the pool threads their own tasks need, and a
step over two seeds of a 784-128-64-10 MLP deadlocked (one leaf's ADMM
``eigh`` and another's ``svd``). A model's result under ``vmap`` is its
unbatched step's, to float32 rounding.

``A`` depends on the direction of ``G`` only (``A(c G) = A(G)`` for ``c >
0``): the learning rate alone sets the length of the step, ``eta`` in the
spectral norm.

References:
  Bernstein, *Modular Manifolds*, Thinking Machines Lab: Connectionism, 2025
  (manifold Muon).
  Jordan et al., *Muon: An optimizer for hidden layers in neural networks*,
  2024.
  Boyd, Parikh, Chu, Peleato, Eckstein, *Distributed Optimization and
  Statistical Learning via the Alternating Direction Method of Multipliers*,
  2011 (ADMM, residual balancing, Sec. 3.4.1).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from cola_jax._default_leaves import weight_matrices
from cola_jax._hyperparameters import caller, check_nonnegative, check_positive, check_positive_integer
from cola_jax._numerics import max_abs, power_of_two_scale
from cola_jax._platform import one_matrix_at_a_time
from cola_jax._tree import (
  NOT_PARAMS,
  ConstraintSpec,
  LeafLayout,
  check_state,
  initial_auxes,
  is_params_placeholder,
  without_variables,
)
from cola_jax.constraints.base import Euclidean
from cola_jax.constraints.orthogonal import Orthogonal

_HIGHEST = jax.lax.Precision.HIGHEST
_INITIAL_PENALTY = 0.1  # rho for a gradient of unit Frobenius norm; balanced as the iteration goes


class DirectionInfo(NamedTuple):
  """How the steepest tangent direction of a leaf's last step was found.

  ``gap`` certifies the direction: ``<G, A>`` is within the fraction ``gap``
  of the best value, by weak duality (any symmetric ``Lambda`` bounds it by
  ``|G + 2 W Lambda|_*``; ADMM's multiplier gives the bound). For a leaf of
  several matrices (``Orthogonal`` with batch axes): the most iterations any
  matrix used, converged only if every matrix converged, and the largest gap.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> tx = cola.manifold_muon(0.1)
    >>> params = {'w': jnp.eye(4, 2)}
    >>> _, state = tx.update({'w': jnp.ones((4, 2))}, tx.init(params), params)
    >>> info = state.direction_info['w']  # a cola.DirectionInfo
    >>> bool(info.converged), int(info.iterations) > 0, float(info.gap) < 1e-5
    (True, True, True)
  """

  iterations: jax.Array  # ADMM iterations (0: closed form, or a zero gradient)
  converged: jax.Array  # both residuals reached the tolerance, and the direction is finite
  gap: jax.Array  # 1 - <G, A> / (an upper bound of its maximum): 0 for an exact direction


class ManifoldMuonState(NamedTuple):
  """State of :func:`manifold_muon`.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> state = cola.manifold_muon(0.1).init({'w': jnp.eye(3, 2)})
    >>> state.momentum['w'].shape, state.direction_info['w']
    ((3, 2), DirectionInfo(iterations=Array(0, dtype=int32), converged=Array(True, dtype=bool),
                           gap=Array(0., dtype=float32)))
  """

  count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  (steps taken, int32, as optax names it)
  momentum: Any  # the exponential moving average of the gradients, shaped like the parameters
  constraint_states: Any  # per leaf: its constraint's state (a ProjectionInfo for Orthogonal, None if free)
  direction_info: Any  # per leaf: a DirectionInfo for Orthogonal leaves, None for free ones


def _sym(x):
  return 0.5 * (x + jnp.swapaxes(x, -1, -2))


def _skew(x):
  return 0.5 * (x - jnp.swapaxes(x, -1, -2))


def _mm(a, b):
  return jnp.matmul(a, b, precision=_HIGHEST)


def _clip_singular_values(m: jax.Array) -> jax.Array:
  """The nearest matrix of spectral norm at most 1: ``m``'s singular values above 1 set to 1."""
  eigenvalues, vectors = jnp.linalg.eigh(_mm(m.T, m))
  sigma = jnp.sqrt(jnp.maximum(eigenvalues, 0))
  factor = jnp.where(sigma > 1, 1 / jnp.maximum(sigma, 1), 1)
  return _mm(m, _mm(vectors * factor, vectors.T))


def _sign_of_skew(s: jax.Array) -> jax.Array:
  """``msign(S)`` of a skew matrix: its nonzero singular values set to 1, the others (odd size: one at least) to 0.

  From the SVD rather than the eigendecomposition of ``S^T S``, whose squaring
  loses the small singular values' digits. A zero singular value must map to 0
  for the result to be skew.
  """
  u, sigma, vt = jnp.linalg.svd(s)
  keep = sigma > jnp.finfo(s.dtype).eps * s.shape[0] * sigma[0]
  return _mm(u * keep, vt)


def _admm(coordinates: jax.Array, p: int, tolerance: float, max_iterations: int):
  """ADMM for ``max <Gc, A>`` over ``|A|_2 <= 1`` with ``A[:p]`` skew, in the ``(p + m) x p`` coordinates."""

  def tangent(a):
    return a.at[:p].set(_skew(a[:p]))

  def not_done(carry):
    k, _, _, _, primal, dual = carry
    return (k < max_iterations) & ~((primal <= tolerance) & (dual <= tolerance))

  def step(carry):
    k, z, u, rho, _, _ = carry
    a = _clip_singular_values(z - u + coordinates / rho)
    z_new = tangent(a + u)
    u = u + a - z_new
    primal = jnp.linalg.norm(a - z_new) / p
    dual = rho * jnp.linalg.norm(z_new - z) / p
    # Residual balancing: the scaled multiplier u = y / rho is rescaled with rho.
    factor = jnp.where(primal > 10 * dual, 2.0, jnp.where(dual > 10 * primal, 0.5, 1.0)).astype(z.dtype)
    return k + 1, z_new, u / factor, rho * factor, primal, dual

  z = tangent(coordinates)
  inf = jnp.array(jnp.inf, z.dtype)
  init = (jnp.zeros((), jnp.int32), z, jnp.zeros_like(z), jnp.array(_INITIAL_PENALTY, z.dtype), inf, inf)
  k, z, u, rho, primal, dual = jax.lax.while_loop(not_done, step, init)
  # A feasible point (tangent, spectral norm at most 1) and the dual bound of the multiplier rho u.
  a = tangent(_clip_singular_values(z))
  a = a / jnp.maximum(1, jnp.linalg.norm(a, 2))
  bound = jnp.sum(jnp.linalg.svd(coordinates.at[:p].add(-rho * _sym(u[:p])), compute_uv=False))
  gap = jnp.maximum(1 - jnp.sum(coordinates * a) / bound, 0)
  return a, k, (primal <= tolerance) & (dual <= tolerance), gap


def _steepest_tangent_direction(w, g, tolerance, max_iterations):
  """:func:`steepest_tangent_direction` of one matrix."""
  n, p = w.shape
  finite = jnp.all(jnp.isfinite(g))
  scaled = jnp.where(finite, g * power_of_two_scale(max_abs(g)), 0)  # entries of order one
  norm = jnp.linalg.norm(scaled)
  nonzero = norm > 0
  g = scaled / jnp.where(nonzero, norm, 1)
  k = _mm(w.T, g)
  if n == p:  # exact: the bound with Lambda = -sym(W^T G) / 2 is |skew(W^T G)|_*, the value reached
    a, iterations, converged = _mm(w, _sign_of_skew(_skew(k))), jnp.zeros((), jnp.int32), jnp.array(True)
    gap = jnp.zeros((), g.dtype)
  else:
    m = min(p, n - p)
    normal = g - _mm(w, k)
    basis = jnp.linalg.qr(jnp.concatenate([w, normal], axis=1))[0][:, p : p + m]
    coordinates = jnp.concatenate([k, _mm(basis.T, g)])
    solution, iterations, converged, gap = _admm(coordinates, p, tolerance, max_iterations)
    a = _mm(w, solution[:p]) + _mm(basis, solution[p:])
  a = jnp.where(finite, jnp.where(nonzero, a, 0), jnp.nan)
  converged = finite & (converged | ~nonzero)
  gap = jnp.where(finite, jnp.where(nonzero, gap, 0), jnp.nan)
  return a, DirectionInfo(jnp.where(nonzero, iterations, 0), converged, gap)


def steepest_tangent_direction(
  w: jax.Array, g: jax.Array, *, tolerance: float = 1e-6, max_iterations: int = 300
) -> tuple[jax.Array, DirectionInfo]:
  r"""The unit-spectral-norm tangent vector ``A`` at ``W`` maximising ``<G, A>`` (manifold Muon's direction).

  Args:
    w: a tall matrix ``(n, p)``, ``n >= p``, with orthonormal columns.
    g: the gradient (or momentum) at ``w``, of the same shape.
    tolerance: the ADMM residuals to reach (tall ``w``; unused for square).
    max_iterations: the bound on ADMM iterations.

  Returns:
    ``A`` (a tangent vector with ``|A|_2 <= 1``, to rounding) and its
    :class:`DirectionInfo`. A zero ``g`` gives ``A = 0``; a non-finite one
    gives NaN, flagged.

  Example:
    >>> import jax.numpy as jnp
    >>> from cola_jax.manifold_muon import steepest_tangent_direction
    >>> w = jnp.eye(3, 2)
    >>> a, info = steepest_tangent_direction(w, jnp.array([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]]))
    >>> a  # x = 1/sqrt(5), y = 2/sqrt(5) maximise x + 2 y subject to x^2 + y^2 <= 1
    Array([[ 0.       ,  0.4472...], [-0.4472...,  0.       ], [ 0.8944...,  0.       ]], dtype=float32)
    >>> bool(info.converged)
    True
  """
  direction = lambda w, g: _steepest_tangent_direction(w, g, tolerance, max_iterations)
  return one_matrix_at_a_time(direction)(w, g)


def manifold_muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  constraints: ConstraintSpec = None,
  momentum: float = 0.95,
  nesterov: bool = True,
  tolerance: float = 1e-6,
  max_iterations: int = 300,
) -> optax.GradientTransformationExtraArgs:
  r"""Manifold Muon: Muon's spectral-norm steepest descent inside the tangent space of the Stiefel manifold.

  The optax counterpart is ``optax.contrib.muon``, which orthogonalises the
  update but lets the weights leave any manifold; this keeps every
  :class:`~cola_jax.Orthogonal` leaf on it. Per such leaf, with ``W`` its tall
  view (see :class:`~cola_jax.Orthogonal`) and ``g`` its gradient:

  .. math::
    m \leftarrow \beta m + (1 - \beta) g, \qquad
    d = \beta m + (1 - \beta) g \ \text{(Nesterov; else } d = m),

  .. math::
    A = \arg\max_{|A|_2 \le 1,\ W^T A + A^T W = 0} \langle d, A \rangle, \qquad
    W \leftarrow R_W(-\eta A),

  with ``R_W`` the leaf's :meth:`Orthogonal.retract
  <cola_jax.Constraint.retract>` (the polar factor, the nearest orthonormal
  matrix). The direction is found as :mod:`cola_jax.manifold_muon` describes
  (closed form for square matrices, ADMM in ``(p + m) x p`` coordinates for
  tall ones); its iterations and whether it met ``tolerance`` are in
  ``state.direction_info``. Unconstrained leaves (``None``) take
  ``-eta d``, the same momentum without a direction: they move as under
  ``optax.sgd(eta * (1 - beta), momentum=beta, nesterov=nesterov)``. There is
  no ``free=`` here: to put them on Adam, as ``optax.contrib.muon`` does,
  route them there with ``optax.partition``.

  Args:
    learning_rate: ``eta``, the spectral norm of each step (a number or an optax schedule).
    constraints: :class:`~cola_jax.Orthogonal` or ``None`` per leaf, as for
      :func:`~cola_jax.cola_od` (a constraint, a pytree prefix of the
      parameters, or a callable of them). Default: ``Orthogonal()`` on the
      weight matrices, every leaf with ``ndim >= 2`` but biases, scales and
      embedding tables, named in a ``UserWarning`` when there are more than
      one (the rule of every entry, in docs/choosing.md, "Which leaves are
      constrained"); the others are free.
    momentum: ``beta`` in ``[0, 1)``; 0 gives the reference's rule (no momentum).
    nesterov: whether ``d`` looks ahead (as ``optax.contrib.muon``).
    tolerance: the residuals at which the direction's ADMM stops.
    max_iterations: the bound on its iterations per matrix and step.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
    ``params``. It must be the last link of a chain.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> params = {'w': jnp.eye(4, 2), 'b': jnp.zeros(2)}
    >>> tx = cola.manifold_muon(0.1, constraints={'w': cola.Orthogonal(), 'b': None})
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.arange(8.0).reshape(4, 2), 'b': jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> w = optax.apply_updates(params, updates)['w']
    >>> bool(jnp.allclose(w.T @ w, jnp.eye(2), atol=1e-6)), bool(state.direction_info['w'].converged)
    (True, True)

  References:
    Bernstein, *Modular Manifolds*, Thinking Machines Lab: Connectionism, 2025.
    Jordan et al., *Muon: An optimizer for hidden layers in neural networks*, 2024.
  """
  owner = caller("manifold_muon")
  if not callable(learning_rate):
    check_positive(owner, "learning_rate", learning_rate)
  if callable(momentum):
    raise TypeError(f"{owner}: momentum must be a number, not a schedule.")
  check_nonnegative(owner, "momentum", momentum)
  if not float(momentum) < 1:
    raise ValueError(f"{owner}: momentum must be in [0, 1), got {momentum!r}.")
  check_positive(owner, "tolerance", tolerance)
  check_positive_integer(owner, "max_iterations", max_iterations)
  if not isinstance(nesterov, bool):
    raise TypeError(f"{owner}: nesterov must be True or False, got {nesterov!r}.")
  if constraints is None:
    orthogonal = Orthogonal()
    constraints = lambda params: jax.tree.map(
      lambda taken: orthogonal if taken else None,
      weight_matrices(owner, params, "cola.Orthogonal()", "constraints="),
    )

  def layout_of(params) -> LeafLayout:
    layout = LeafLayout(owner, constraints, params)
    for path, c in zip(layout.paths, layout.constraints):
      if not isinstance(c, (Orthogonal, Euclidean)):
        raise ValueError(
          f"{owner}: the leaf at {path} has the constraint {c!r}; manifold Muon steps Orthogonal leaves "
          "(the Stiefel manifold) and free ones (None). For other manifolds use "
          "cola.constrained(optax.contrib.muon(...), constraints=...)."
        )
    return layout

  def init_fn(params):
    count = jnp.zeros([], jnp.int32)
    if is_params_placeholder(params):  # optax.tree.map_params: the momenta are the copy of the parameters
      return ManifoldMuonState(count, momentum=params, constraint_states=NOT_PARAMS, direction_info=NOT_PARAMS)
    layout = layout_of(without_variables(params))
    auxes = initial_auxes(tuple(layout.constraints), layout.compute)
    infos = [
      None if isinstance(c, Euclidean) else DirectionInfo(jnp.zeros((), jnp.int32), jnp.array(True), jnp.zeros(()))
      for c in layout.constraints
    ]
    return ManifoldMuonState(
      count,
      momentum=layout.unflatten([jnp.zeros_like(p) for p in layout.params]),
      constraint_states=layout.unflatten(auxes),
      direction_info=layout.unflatten(infos),
    )

  def leaf_step(c, p, aux, d, eta):
    """An ``Orthogonal`` leaf ``p`` stepped along ``d``: its new value and constraint state, its direction's info."""
    point = c.point(p, aux)
    # The tangent space at Q = scale U is U's: the direction is found for U (Orthogonal's scale).
    w, ambient = point.matrix / c.scale, c.ambient_gradient(point, d)
    direction = lambda w, g: steepest_tangent_direction(w, g, tolerance=tolerance, max_iterations=max_iterations)
    a, info = direction(w, ambient) if w.ndim == 2 else jax.vmap(direction)(w, ambient)
    new_param, new_aux = c.unpack(c.retract(point, -eta * c.cotangent(point, a)), p)
    return new_param, new_aux, DirectionInfo(jnp.max(info.iterations), jnp.all(info.converged), jnp.max(info.gap))

  def update_fn(grads, state, params=None, **extra_args):
    del extra_args
    check_state(owner, state, ManifoldMuonState)
    layout = layout_of(params)
    grad_leaves = layout.gradients(grads)
    auxes = layout.flatten(state.constraint_states, "state.constraint_states")
    layout.check_state(auxes)
    stored = layout.flatten(state.momentum, "state.momentum")
    eta = jnp.asarray(learning_rate(state.count) if callable(learning_rate) else learning_rate)
    new_params, momenta, new_auxes, infos = [], [], [], []
    for c, g, m, p, aux in zip(layout.constraints, grad_leaves, stored, layout.compute, auxes):
      m = momentum * m.astype(p.dtype) + (1 - momentum) * g
      d = momentum * m + (1 - momentum) * g if nesterov else m
      momenta.append(m)
      if isinstance(c, Euclidean):
        new_params.append(p - eta * d)
        new_auxes.append(aux)
        infos.append(None)
        continue
      new_param, new_aux, info = one_matrix_at_a_time(functools.partial(leaf_step, c))(p, aux, d, eta)
      new_params.append(new_param)
      new_auxes.append(new_aux)
      infos.append(info)
    momenta = [m.astype(old.dtype) for m, old in zip(momenta, stored)]
    return layout.updates(new_params), ManifoldMuonState(
      jnp.asarray(optax.safe_increment(state.count)),
      layout.unflatten(momenta),
      layout.unflatten(new_auxes),
      layout.unflatten(infos),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
