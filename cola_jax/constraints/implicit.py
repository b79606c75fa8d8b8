r"""Any smooth constraint on a leaf, given as a function: SHAKE and RATTLE.

The user writes the constraint as JAX functions of the leaf ``x`` (shaped like
the parameter, ``n`` entries): equalities ``c(x) = 0`` with ``c(x)`` in
``R^{m_E}`` and inequalities ``d(x) <= 0`` (entrywise) with ``d(x)`` in
``R^k``. As for :class:`~cola_jax.Circle`, each inequality gets a slack
variable ``s_i``, and the manifold is

.. math::
  M = \{z = (x, s) \in \mathbb{R}^{n + k} : g(z) = 0\}, \qquad
  g(z) = \begin{pmatrix} c(x) \\ d(x) + s \odot s \end{pmatrix} \in \mathbb{R}^m,
  \quad m = m_E + k,

with the Jacobian ``G(z) = dg/dz`` (``m x (n + k)``, by reverse-mode
autodiff) of full row rank on ``M``. Ambient vectors and momenta are flat
vectors of ``R^{n + k}``, the leaf's entries (row-major) then the slacks; so is
the momentum that ``cola_ud`` stores for the leaf.

Projection (SHAKE). From ``q_n`` on ``M``, an ambient step ``D`` (the
Euler-Maruyama increment, or ``h p`` in the A step) is corrected along the
constraint force at ``q_n``, as in the paper's general discretisation:

.. math::
  q_{n+1} = q_n + D + G(q_n)^T \lambda, \qquad g(q_{n+1}) = 0.

The multiplier ``lambda`` solves ``F(lambda) = g(q_n + D + G_n^T lambda) = 0``
by Newton's method, whose Jacobian is ``G(q^{(j)}) G_n^T``,

.. math::
  \lambda^{(j+1)} = \lambda^{(j)} - \big(G(q^{(j)})\, G_n^T\big)^{-1} g(q^{(j)}),

(quadratic convergence, one Jacobian and one ``m x m`` LU solve per
iteration), or by the quasi-Newton iteration with the fixed matrix
``G_n G_n^T`` (one Cholesky factorisation per projection, one evaluation of
``g`` per iteration, linear convergence at a rate that grows with ``|D|``;
for orthogonality it is the paper's ``Q - 1/2 Q_n (Q^T Q - I)``). Either runs
until ``max_i |g_i(q)| <= tolerance`` or ``max_iterations``.

Cotangent projection: ``Pi(q) v = v - G^T (G G^T)^{-1} G v`` (Cholesky).

A step (RATTLE): ``q_{n+1}`` is the projection of the step ``h p`` from
``q_n``, and the momentum takes the same impulse and is projected onto the new
cotangent space,

.. math::
  p_{n+1} = \Pi(q_{n+1}) \big(p + G(q_n)^T \lambda / h\big)
          = \Pi(q_{n+1}) \big(q_{n+1} - q_n\big) / h.

It is symplectic, time reversible and second order (local error
``O(h^3)``); the closed forms (:class:`~cola_jax.Circle`,
:class:`~cola_jax.Sphere`) flow along geodesics exactly.

Failure is never silent. A projection that does not meet the tolerance within
``max_iterations`` (or whose iterates stop being finite, or whose new momentum
is not finite) is rejected: the leaf stays at ``q_n`` and, in the A step, its
momentum is reversed, ``p -> -p``, the rule that keeps constrained HMC
reversible when a projection fails (Lelievre, Rousset, Stoltz), so the next
step heads away. The update's :class:`ImplicitState` has ``converged=False``
(``iterations`` counts the Newton iterations of all its projections); the
parameter stays on the manifold. A smaller step size is the remedy.

Start. A parameter with ``max |g| > tolerance`` at the start of an update
(the initial value, or one changed outside the optimizer) is first projected
from itself, ``z + G(z)^T lambda`` with ``lambda`` by Newton: radially for a
norm, onto the polar factor for orthogonality, orthogonally for linear
constraints. If that fails too, the update starts from the parameter as it
is and is flagged; :meth:`Implicit.nearest` (and so
:func:`~cola_jax.project_params`) raises instead. The slacks start at
``s = +sqrt(max(-d(x), 0))``, so a violated inequality starts with ``s = 0``
and is projected; along ``G(z)^T`` such a slack stays 0 (its column of ``G``
is ``2 s``), so the inequality ends active, which can be incompatible with the
equalities: start inside the inequalities when both are given.

Scope. ``G`` is a dense ``m x (n + k)`` matrix and the solves are ``m x m``:
meant for a few constraint components per leaf (a norm, sums per unit, a
small Gram matrix). Elementwise bounds on large leaves are what
:class:`~cola_jax.Circle` and :class:`~cola_jax.Sphere` are for.

Per unit. With ``axis`` given, the leaf is a collection of units (the entries
along ``axis`` for one index of the other axes, e.g. the columns of a Dense
kernel for ``axis=0``) and the functions constrain one unit; the manifold is
the product of the units' manifolds. Everything above then holds for each unit
on its own: its own ``(z, G, lambda)`` with ``G`` of size
``m_unit x (n_unit + k_unit)``, its own Newton iteration, its own rejection
and momentum reversal; the units are ``jax.vmap``-ed, so the cost grows
linearly with their number. The state aggregates the diagnostics
(``iterations`` the most any unit used, ``converged`` whether every unit's
projections succeeded); the momentum is stored as ``(units, n_unit +
k_unit)``, one row per unit (in the row-major order of the other axes).

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Appendix B (general constraint).
  Leimkuhler and Reich, *Simulating Hamiltonian Dynamics*, 2004, ch. 7
  (SHAKE, RATTLE).
  Lelievre, Rousset, Stoltz, *Hybrid Monte Carlo methods for sampling
  probability measures on submanifolds*, Numer. Math. 143, 2019 (rejection
  and momentum reversal when the projection fails).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cola_jax import _noise
from cola_jax._hyperparameters import check_positive, check_positive_integer
from cola_jax.constraints import _axes
from cola_jax.constraints.base import Constraint

_HIGHEST = jax.lax.Precision.HIGHEST


def _matmul(a, b):
  return jnp.matmul(a, b, precision=_HIGHEST)


def _or_per_unit(method):
  """The method for the whole leaf, or its ``_per_unit_`` version when ``axis`` is given."""

  @functools.wraps(method)
  def dispatch(self, *args):
    if self.axis is None:
      return method(self, *args)
    return getattr(self, "_per_unit_" + method.__name__)(*args)

  return dispatch


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["slack", "iterations", "converged"], meta_fields=["constraint"]
)
@dataclasses.dataclass(frozen=True)
class ImplicitState:
  """Auxiliary state of a leaf under an :class:`Implicit` constraint.

  ``constraint`` is static (part of the tree structure), so that the residual
  can evaluate ``g``.
  """

  # s, shaped like inequality(x), shape (0,) without inequalities; per unit (axis
  # given) shaped (*the other axes, *inequality(unit).shape), or (*the other axes, 0).
  slack: jax.Array
  iterations: jax.Array  # Newton iterations of the last update's projections, int32
  converged: jax.Array  # False: a projection of the last update failed and was rejected
  constraint: "Implicit"

  def residual(self, param: jax.Array) -> jax.Array:
    """``max_i |g_i(x, s)|`` (over every unit), computed in at least float32."""
    dtype = jnp.promote_types(param.dtype, jnp.float32)  # float64 stays float64
    if self.constraint.axis is not None:
      return self.constraint._per_unit_residual(param.astype(dtype), self.slack.astype(dtype))
    z = self.constraint._pack(param.astype(dtype), self.slack.astype(dtype))
    return jnp.max(jnp.abs(self.constraint._g(param.shape)(z)))


class ImplicitPoint(NamedTuple):
  """A leaf's point during an update, with the diagnostics of its projections."""

  x: jax.Array  # the leaf; per unit (axis given) the units, (units, *unit shape)
  slack: jax.Array  # per unit (units, *inequality(unit).shape)
  iterations: jax.Array  # totals over the projections of the current update (per unit)
  converged: jax.Array  # (per unit)


@dataclasses.dataclass(frozen=True)
class Implicit(Constraint):
  r"""The leaf on ``{x : equality(x) = 0, inequality(x) <= 0}``, for smooth functions.

  Args:
    equality: ``x -> c(x)``, a JAX function of the leaf (shaped like it) to an
      array of any shape, whose entries are the equality constraints ``= 0``.
    inequality: ``x -> d(x)``, likewise; each entry ``d_i(x) <= 0`` becomes
      ``d_i(x) + s_i^2 = 0`` with a slack ``s_i`` (shaped like ``d(x)``, in
      :class:`ImplicitState`).
    tolerance: a projection succeeds once ``max_i |g_i| <= tolerance``, an
      absolute bound on the constraint functions: write them with values of
      order one (``jnp.sum(w**2) / c**2 - 1`` rather than
      ``jnp.sum(w**2) - c**2``) so that their float32 rounding stays far
      below it, or no projection can succeed.
    max_iterations: the bound on Newton iterations per projection.
    quasi_newton: use the fixed matrix ``G(q_n) G(q_n)^T`` instead of Newton's
      ``G(q^{(j)}) G(q_n)^T``: cheaper iterations, more of them, and a smaller
      step size at which it converges. The projection of a parameter that
      starts off the manifold always uses Newton.
    axis: ``None`` (default): the functions take the whole leaf. An int or a
      tuple of ints (negative values count from the end, as for
      :class:`~cola_jax.Sphere` and Keras' constraints): the axes that form one
      unit; the functions take one unit (shaped by those axes, in the leaf's
      order) and apply to every unit (see "Per unit" in the module docstring).
      ``axis=0`` on a Dense kernel ``(in, out)`` constrains each column.

  At least one of ``equality`` and ``inequality`` is required; the functions
  must be traceable (``jnp``) and differentiable. Two ``Implicit`` compare equal
  when their functions are the same objects, so define them once (not inside
  a callable ``constraints=`` spec, which is called at every update). See the
  module docstring for the projection, the RATTLE A step and what happens when
  a projection fails (``ImplicitState.converged``).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> # Incoming weights of every unit sum to zero, the kernel's norm is 2.
    >>> zero_mean_norm2 = cola.Implicit(
    ...     equality=lambda w: jnp.append(w.sum(axis=0), jnp.sum(w**2) / 4 - 1))
    >>> tx = cola.cola_ud(0.1, friction=1.0,
    ...                   constraints={'kernel': zero_mean_norm2, 'bias': None})
    >>> # Each unit (column) sums to zero and has norm 1: two components per unit.
    >>> per_unit = cola.Implicit(
    ...     equality=lambda w: jnp.stack([w.sum(), jnp.sum(w**2) - 1]), axis=0)
  """

  equality: Callable | None = None
  inequality: Callable | None = None
  tolerance: float = 1e-6
  max_iterations: int = 20
  quasi_newton: bool = False
  axis: tuple[int, ...] | None = None  # an int is accepted and stored as a tuple

  stack_same_shape = True  # small dense solves in loops: batch same-shape leaves

  def __post_init__(self):
    for name in ("equality", "inequality"):
      fn = getattr(self, name)
      if fn is not None and not callable(fn):
        raise TypeError(f"Implicit: {name} must be a function x -> array, got {fn!r}.")
    if self.equality is None and self.inequality is None:
      raise ValueError("Implicit: give equality=, inequality= or both.")
    check_positive("Implicit", "tolerance", self.tolerance)
    check_positive_integer("Implicit", "max_iterations", self.max_iterations)
    object.__setattr__(self, "axis", _axes.normalize("Implicit", "axis", self.axis))

  # The constraint function on flat vectors z = (x.ravel(), s.ravel()).

  def validate(self, param, path):
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    where = f"Implicit constraint on the leaf at {path}, of shape {param.shape}"
    shape = param.shape
    if self.axis is not None:
      shape = tuple(param.shape[a] for a in _axes.resolve(where, shape, axis=self.axis)["axis"])
      where = f"{where}, per unit of shape {shape} (axis={self.axis})"
    leaf = jax.ShapeDtypeStruct(shape, dtype)
    sizes = {}
    for name in ("equality", "inequality"):
      fn = getattr(self, name)
      if fn is None:
        continue
      try:
        out = jax.eval_shape(fn, leaf)
      except Exception as error:  # the user's function, any error: say where it came from
        raise ValueError(f"{where}: {name}(x) fails on an array of that shape: {error}") from error
      if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise ValueError(f"{where}: {name}(x) must return one array, got {out!r}.")
      if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(
          f"{where}: {name}(x) returns dtype {out.dtype}; it must be floating point (a smooth function of x)."
        )
      sizes[name] = math.prod(out.shape)
    m = sum(sizes.values())
    if m == 0:
      raise ValueError(f"{where}: the constraint functions return no components.")
    coordinates = math.prod(shape) + sizes.get("inequality", 0)
    if m > coordinates:
      raise ValueError(
        f"{where}: {m} constraint components for {coordinates} coordinates "
        "(leaf entries and slacks); G G^T cannot be invertible."
      )

  def _slack_shape(self, shape, dtype):
    if self.inequality is None:
      return (0,)
    return jax.eval_shape(self.inequality, jax.ShapeDtypeStruct(shape, dtype)).shape

  def _pack(self, x, slack):
    return jnp.concatenate([x.ravel(), slack.ravel()])

  def _g(self, shape) -> Callable[[jax.Array], jax.Array]:
    """``z -> g(z)`` for a leaf of shape ``shape``, flat in and out."""
    n = math.prod(shape)

    def g(z):
      x = z[:n].reshape(shape)
      parts = []
      if self.equality is not None:
        parts.append(jnp.ravel(self.equality(x)).astype(z.dtype))
      if self.inequality is not None:
        s = z[n:]
        parts.append(jnp.ravel(self.inequality(x)).astype(z.dtype) + s * s)
      return jnp.concatenate(parts)

    return g

  def _shake(self, g, z_n, step, quasi_newton):
    """``(q, impulse, iterations, converged)``: ``q = z_n + step + impulse`` on M.

    ``impulse = G(z_n)^T lambda``; not converged: ``q = z_n`` and ``impulse = 0``.
    """
    jacobian = jax.jacrev(g)
    g_n = jacobian(z_n)
    moved = z_n + step
    if quasi_newton:
      factor = jax.scipy.linalg.cho_factor(_matmul(g_n, g_n.T))
      newton_step = lambda q, gq: jax.scipy.linalg.cho_solve(factor, gq)
    else:
      newton_step = lambda q, gq: jnp.linalg.solve(_matmul(jacobian(q), g_n.T), gq)

    def not_done(carry):
      _, _, gq, k = carry
      # NaN compares False: a diverged iteration stops here.
      return (jnp.max(jnp.abs(gq)) > self.tolerance) & (k < self.max_iterations)

    def iterate(carry):
      lam, q, gq, k = carry
      lam = lam - newton_step(q, gq)
      q = moved + _matmul(g_n.T, lam)
      return lam, q, g(q), k + 1

    lam0 = jnp.zeros(g_n.shape[0], z_n.dtype)
    lam, q, gq, k = jax.lax.while_loop(not_done, iterate, (lam0, moved, g(moved), jnp.zeros((), jnp.int32)))
    converged = (jnp.max(jnp.abs(gq)) <= self.tolerance) & jnp.all(jnp.isfinite(q))
    impulse = _matmul(g_n.T, jnp.where(converged, lam, jnp.zeros_like(lam)))
    return jnp.where(converged, q, z_n), impulse, k, converged

  def _flat(self, point):
    return self._pack(point.x, point.slack)

  def _unflat(self, z, like, iterations, converged):
    n = like.x.size
    return ImplicitPoint(z[:n].reshape(like.x.shape), z[n:].reshape(like.slack.shape), iterations, converged)

  # The Constraint interface.

  @_or_per_unit
  def init(self, param):
    if self.inequality is None:
      slack = jnp.zeros((0,), param.dtype)
    else:
      slack = jnp.sqrt(jnp.maximum(-self.inequality(param).astype(param.dtype), 0))
    return ImplicitState(slack=slack, iterations=jnp.zeros((), jnp.int32), converged=jnp.array(True), constraint=self)

  @_or_per_unit
  def point(self, param, aux):
    """The leaf and slacks; projected from themselves first if ``max |g| > tolerance``."""
    g = self._g(param.shape)
    z = self._pack(param, aux.slack.astype(param.dtype))
    off = ~(jnp.max(jnp.abs(g(z))) <= self.tolerance)  # NaN too: its projection fails, flagged

    # A while loop of at most one iteration rather than lax.cond: under vmap a
    # cond runs both branches for every member, the loop only while one needs it.
    def reproject(carry):
      z, _, _, _ = carry
      q, _, k, converged = self._shake(g, z, jnp.zeros_like(z), quasi_newton=False)
      return q, k, converged, jnp.array(False)

    z, k, converged, _ = jax.lax.while_loop(
      lambda carry: carry[3], reproject, (z, jnp.zeros((), jnp.int32), jnp.array(True), off)
    )
    n = param.size
    return ImplicitPoint(z[:n].reshape(param.shape), z[n:].reshape(aux.slack.shape), k, converged)

  def nearest(self, param):
    """The parameter projected onto the manifold from itself (see the module docstring).

    Raises ValueError, where the values are known (outside ``jit``), if that
    projection fails; under ``jit`` the parameter is returned unprojected.
    """
    point = jax.jit(lambda p: self.point(p, self.init(p)))(param)  # one compilation, not op by op
    try:
      failed = not bool(jnp.all(point.converged))
    except jax.errors.ConcretizationTypeError:
      failed = False
    if failed:
      raise ValueError(
        f"Implicit: the parameter of shape {param.shape} could not be projected onto "
        f"the manifold in {self.max_iterations} Newton iterations (max |g| = "
        f"{float(self.init(param).residual(param)):.3g}); start closer to it."
      )
    return self.unpack(point, param)[0]

  @_or_per_unit
  def unpack(self, point, param):
    return point.x, ImplicitState(
      slack=point.slack, iterations=point.iterations, converged=point.converged, constraint=self
    )

  @_or_per_unit
  def ambient_gradient(self, point, grad):
    return jnp.concatenate([grad.ravel(), jnp.zeros(point.slack.size, grad.dtype)])

  @_or_per_unit
  def ambient_normal(self, key, point):
    return _noise.normal(key, (point.x.size + point.slack.size,), point.x.dtype)

  @_or_per_unit
  def project(self, anchor, step):
    q, _, k, converged = self._shake(self._g(anchor.x.shape), self._flat(anchor), step, self.quasi_newton)
    return self._unflat(q, anchor, anchor.iterations + k, anchor.converged & converged)

  @_or_per_unit
  def cotangent(self, point, vector):
    return self._cotangent(self._g(point.x.shape), self._flat(point), vector)

  def _cotangent(self, g, z, vector):
    jac = jax.jacrev(g)(z)
    factor = jax.scipy.linalg.cho_factor(_matmul(jac, jac.T))
    return vector - _matmul(jac.T, jax.scipy.linalg.cho_solve(factor, _matmul(jac, vector)))

  def cotangent_normal(self, key, point):
    return self.cotangent(point, self.ambient_normal(key, point))

  @_or_per_unit
  def zero_momentum(self, param):
    """The momentum is stored flat, ``(n + k,)``: the leaf's coordinates, then the slacks'."""
    return jnp.zeros(param.size + math.prod(self._slack_shape(param.shape, param.dtype)), param.dtype)

  @_or_per_unit
  def a_step(self, point, momentum, h):
    g = self._g(point.x.shape)
    z_n = self._flat(point)
    q, impulse, k, converged = self._shake(g, z_n, h * momentum, self.quasi_newton)
    # At h = 0 nothing moves: no impulse (rather than 0 / 0).
    moving = h != 0
    impulse = jnp.where(moving, impulse * (1 / jnp.where(moving, h, 1)), 0)
    new_momentum = self._cotangent(g, q, momentum + impulse)
    accepted = converged & jnp.all(jnp.isfinite(new_momentum))
    # Rejected: stay at q_n with the momentum reversed.
    q = jnp.where(accepted, q, z_n)
    new_momentum = jnp.where(accepted, new_momentum, -momentum)
    return (self._unflat(q, point, point.iterations + k, point.converged & accepted), new_momentum)

  # Per unit (axis given): the whole-leaf geometry above applied to each unit,
  # jax.vmap-ed over the units, which are brought to one leading axis.

  @property
  def _unit(self) -> "Implicit":
    """The constraint on one unit: the same functions on the unit as a whole leaf."""
    return dataclasses.replace(self, axis=None)

  def _unit_axes(self, ndim):
    """(other axes, unit axes) of a leaf of rank ``ndim``."""
    unit = tuple(sorted(a % ndim for a in self.axis or ()))
    return _axes.others(ndim, unit), unit

  def _units(self, x):
    """The units of ``x``: ``(units, *unit shape)``, in the row-major order of the other axes."""
    return _axes.to_parts(x, *self._unit_axes(x.ndim))

  def _unit_slacks(self, slack, ndim):
    """The stored slacks ``(*other axes, *d shape)`` as ``(units, *d shape)``."""
    others = len(self._unit_axes(ndim)[0])
    return slack.reshape((math.prod(slack.shape[:others]),) + slack.shape[others:])

  def _unit_state(self, slack):
    unit = self._unit
    return ImplicitState(slack=slack, iterations=jnp.zeros((), jnp.int32), converged=jnp.array(True), constraint=unit)

  def _per_unit_residual(self, param, slack):
    slacks = self._unit_slacks(slack, param.ndim)
    return jnp.max(jax.vmap(lambda x, s: self._unit_state(s).residual(x))(self._units(param), slacks))

  def _per_unit_init(self, param):
    slacks = jax.vmap(self._unit.init)(self._units(param)).slack
    other_shape = tuple(param.shape[a] for a in self._unit_axes(param.ndim)[0])
    return ImplicitState(
      slack=slacks.reshape(other_shape + slacks.shape[1:]),
      iterations=jnp.zeros((), jnp.int32),
      converged=jnp.array(True),
      constraint=self,
    )

  def _per_unit_point(self, param, aux):
    slacks = self._unit_slacks(aux.slack, param.ndim)
    return jax.vmap(lambda x, s: self._unit.point(x, self._unit_state(s)))(self._units(param), slacks)

  def _per_unit_unpack(self, point, param):
    others, unit = self._unit_axes(param.ndim)
    other_shape = tuple(param.shape[a] for a in others)
    x = _axes.from_parts(point.x, param.shape, others, unit)
    return x, ImplicitState(
      slack=point.slack.reshape(other_shape + point.slack.shape[1:]),
      iterations=jnp.max(point.iterations),
      converged=jnp.all(point.converged),
      constraint=self,
    )

  def _per_unit_ambient_gradient(self, point, grad):
    return jax.vmap(self._unit.ambient_gradient)(point, self._units(grad))

  def _per_unit_ambient_normal(self, key, point):
    size = math.prod(point.x.shape[1:]) + math.prod(point.slack.shape[1:])
    return _noise.normal(key, (point.x.shape[0], size), point.x.dtype)

  def _per_unit_project(self, anchor, step):
    return jax.vmap(self._unit.project)(anchor, step)

  def _per_unit_cotangent(self, point, vector):
    return jax.vmap(self._unit.cotangent)(point, vector)

  def _per_unit_zero_momentum(self, param):
    return jax.vmap(self._unit.zero_momentum)(self._units(param))

  def _per_unit_a_step(self, point, momentum, h):
    return jax.vmap(self._unit.a_step, in_axes=(0, 0, None))(point, momentum, h)
