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

with the Jacobian ``G(z) = dg/dz`` (``m x (n + k)``; its products by
autodiff: ``G^T mu`` in reverse mode, ``G v`` in forward mode) of full row
rank on ``M``. Ambient vectors and momenta are flat
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
  \delta^{(j)} = \big(G(q^{(j)})\, G_n^T\big)^{-1} g(q^{(j)}), \qquad
  \lambda^{(j+1)} = \lambda^{(j)} - \delta^{(j)}, \qquad
  q^{(j+1)} = q^{(j)} - G_n^T \delta^{(j)},

(quadratic convergence; per iteration ``m`` products ``G(q^{(j)}) v`` and one
``m x m`` solve), or by the quasi-Newton iteration with the fixed matrix
``G_n G_n^T`` (one evaluation of ``g`` per iteration, linear convergence at a
rate that grows with ``|D|``; for orthogonality it is the paper's
``Q - 1/2 Q_n (Q^T Q - I)``). Either runs until
``max_i |g_i(q)| <= tolerance`` or ``max_iterations``. The iterate is
corrected from the previous one rather than rebuilt as
``q_n + D + G_n^T lambda^{(j+1)}``: with a large multiplier (a projection
far onto a small sphere, say) the rounding of ``G_n^T lambda`` in float32 is
then corrected by the next iteration instead of drawn afresh, which would
leave ``max |g|`` at that rounding, above a tolerance of ``1e-6``.

Cotangent projection: ``Pi(q) v = v - G^T (G G^T)^{-1} G v``.

A step (RATTLE): ``q_{n+1}`` is the projection of the step ``h p`` from
``q_n``, and the momentum takes the same impulse and is projected onto the new
cotangent space,

.. math::
  p_{n+1} = \Pi(q_{n+1}) \big(p + G(q_n)^T \lambda / h\big)
          = \Pi(q_{n+1}) \big(q_{n+1} - q_n\big) / h.

It is symplectic, time reversible and second order (local error
``O(h^3)``); the closed forms (:class:`~cola_jax.Circle`,
:class:`~cola_jax.MaxNorm`) flow along geodesics exactly.

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
from itself by Newton's method along the normals of each iterate,
``z <- z - G(z)^T (G(z) G(z)^T)^{-1} g(z)``: radially for a norm, onto the
polar factor for orthogonality, orthogonally for linear constraints. Onto a
manifold far smaller than the start, a norm, say, each iteration scales the
point by a factor of order one, so the result keeps float32 rounding; SHAKE's
corrections along the start's fixed normals would cancel nearly all of the
start and leave its rounding in the result. If that fails too, the
update starts from the parameter as it is and is flagged;
:meth:`Implicit.nearest` (and so :func:`~cola_jax.project_params`) raises
instead. The slacks start at ``s = +sqrt(max(-d(x), 0))``, so a violated
inequality starts with ``s = 0`` and is projected; along ``G(z)^T`` such a
slack stays 0 (its column of ``G`` is ``2 s``), so the inequality ends
active, which can be incompatible with the equalities: start inside the
inequalities when both are given.

Scope. ``G`` is a dense ``m x (n + k)`` matrix and the solves are ``m x m``:
meant for a few constraint components per leaf (a norm, sums per unit, a
small Gram matrix). Elementwise bounds on large leaves are what
:class:`~cola_jax.Circle` and :class:`~cola_jax.MaxNorm` are for.

Per unit. With ``axis`` given, the leaf is a collection of units (the entries
along ``axis`` for one index of the other axes, e.g. the columns of a Dense
kernel for ``axis=0``) and the functions constrain one unit; the manifold is
the product of the units' manifolds. Everything above then holds for each unit
on its own: its own ``(z, G, lambda)`` with ``G`` of size
``m_unit x (n_unit + k_unit)``, its own Newton iteration, its own rejection
and momentum reversal; the whole leaf is the case of one unit. The units stay
in the leaf's own layout: the functions are ``jax.vmap``-ed over the other
axes where they lie, ``G^T mu`` and ``G v`` are one reverse- and one
forward-mode product of the vmapped function, ``G G^T`` is ``G`` applied to the
``m_unit`` rows of ``G``, and the ``m_unit x m_unit`` systems are solved over
all units at once. The cost is about ``m_unit + 1`` passes over the leaf per
product with ``G``, linear in the number of units. The state aggregates the
diagnostics (``iterations`` the most any unit used, ``converged`` whether every
unit's projections succeeded). The ambient vectors and the stored momentum are
laid out as for the whole leaf: ``(n + K,)``, the leaf's entries (row-major)
then the ``K`` slacks (row-major in their shape ``(*other axes, *d shape)``),
so a per-unit constraint and the dense constraint that stacks its units'
components follow the same trajectory, noise included.

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
import numpy as np

from cola_jax import _compiled, _noise
from cola_jax._hyperparameters import check_loop, check_positive, check_positive_integer
from cola_jax._numerics import bounded_while_loop, max_abs
from cola_jax._platform import one_matrix_at_a_time
from cola_jax.constraints import _axes
from cola_jax.constraints._unit_layout import UnitLayout
from cola_jax.constraints.base import Constraint


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=["slack", "iterations", "converged"], meta_fields=["constraint"]
)
@dataclasses.dataclass(frozen=True)
class ImplicitState:
  """Auxiliary state of a leaf under an :class:`Implicit` constraint.

  ``constraint`` is static (part of the tree structure), so that the residual
  can evaluate ``g``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> norm2 = cola.Implicit(equality=lambda w: jnp.sum(w**2) / 4 - 1)  # |w| = 2
    >>> w = jnp.array([2.0, 0.0])
    >>> state = cola.cola_od(0.1, constraints=norm2).init(w).constraint_states
    >>> bool(state.converged), int(state.iterations), state.slack.shape  # no inequality: no slack
    (True, 0, (0,))
    >>> float(state.residual(jnp.array([0.0, 3.0])))  # max |g|: 9 / 4 - 1
    1.25
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
    x = param.astype(dtype)
    geometry = self.constraint._geometry(x.shape)
    return max_abs(geometry.values(x, geometry.slack_matrix(self.slack.astype(dtype))))


class ImplicitPoint(NamedTuple):
  """A leaf's point during an update, with the diagnostics of its projections."""

  x: jax.Array  # the leaf
  slack: jax.Array  # as in ImplicitState
  iterations: jax.Array  # totals over the projections of the current update, per unit (axis given)
  converged: jax.Array  # per unit (axis given)


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """``g``, its Jacobian and the small solves of every unit of a leaf, in the leaf's layout.

  Per unit: ``g = (c(x), d(x) + s * s)`` with ``m = m_E + k`` components, the
  slacks ``s`` as ``(*other shape, k)``; per-unit values are ``(*other shape,
  m)``. The products with the Jacobian's ``x`` part are autodiff products of
  the vmapped functions (every unit's at once, in the leaf's layout: see
  :mod:`~cola_jax.constraints._unit_layout`); its ``s`` part, ``2 s`` on the
  inequality rows, is applied in closed form.
  """

  constraint: "Implicit"
  layout: UnitLayout
  equalities: int  # m_E, per unit
  inequalities: int  # k, per unit

  @property
  def components(self) -> int:
    return self.equalities + self.inequalities

  def slack_matrix(self, slack):
    return slack.reshape(self.layout.other_shape + (self.inequalities,))

  def _pad(self, inequality_part):
    """``(*other, k)`` values as ``(*other, m)``: zero on the equality components."""
    zeros = jnp.zeros(inequality_part.shape[:-1] + (self.equalities,), inequality_part.dtype)
    return jnp.concatenate([zeros, inequality_part], -1)

  def _unit_values(self, unit):
    c = self.constraint
    parts = [jnp.ravel(fn(unit)).astype(unit.dtype) for fn in (c.equality, c.inequality) if fn is not None]
    return jnp.concatenate(parts)

  def values(self, x, s):
    """``g`` of every unit, ``(*other shape, m)``."""
    return self.layout.map(self._unit_values)(x) + self._pad(s * s)

  def transpose(self, x, s, mu):
    """``G(x, s)^T mu`` per unit (``mu``: ``(*other shape, m)``): the leaf part and the slacks' part."""
    _, pullback = jax.vjp(self.layout.map(self._unit_values), x)
    return pullback(mu)[0], 2 * s * mu[..., self.equalities :]

  def apply(self, x, s, vx, vs):
    """``G(x, s) v`` per unit, ``(*other shape, m)``."""
    return jax.jvp(self.layout.map(self._unit_values), (x,), (vx,))[1] + self._pad(2 * s * vs)

  def products(self, xa, sa, xb, sb):
    """``G(a) G(b)^T`` per unit, ``(*other shape, m, m)``: ``G(a)`` applied to the rows of ``G(b)``."""
    m = self.components
    basis = jnp.broadcast_to(jnp.eye(m, dtype=xb.dtype), self.layout.other_shape + (m, m))
    column = lambda e: self.apply(xa, sa, *self.transpose(xb, sb, e))
    if m <= _FEW_COMPONENTS:  # separate passes over the leaf, each fused
      return jnp.stack([column(basis[..., j]) for j in range(m)], -1)
    return jax.vmap(column, in_axes=-1, out_axes=-1)(basis)

  def worst(self, values):
    """``max_i |g_i|`` per unit."""
    return max_abs(values, axis=-1)

  def finite(self, vx, vs):
    """Per unit: whether every entry of ``(vx, vs)`` is finite."""
    return self.layout.all(jnp.isfinite(vx)) & jnp.all(jnp.isfinite(vs), axis=-1)

  def where(self, per_unit, a, b):
    """``a`` on the units where ``per_unit`` holds, else ``b``; both ``(leaf, slacks)`` pairs."""
    return (jnp.where(self.layout.spread(per_unit), a[0], b[0]), jnp.where(per_unit[..., None], a[1], b[1]))

  def split(self, v):
    """A flat ambient vector ``(n + K,)`` as ``(leaf, (*other shape, k))``."""
    n = self.layout.size
    return v[:n].reshape(self.layout.shape), v[n:].reshape(self.layout.other_shape + (self.inequalities,))

  def join(self, vx, vs):
    return jnp.concatenate([vx.ravel(), vs.ravel()])

  def cotangent(self, x, s, vx, vs):
    multiplier = _solve(self.products(x, s, x, s), self.apply(x, s, vx, vs), symmetric=True)
    dx, ds = self.transpose(x, s, multiplier)
    return vx - dx, vs - ds

  def shake(self, x_n, s_n, step_x, step_s, quasi_newton):
    """``(q, impulse, iterations, converged)`` per unit: ``q = z_n + step + impulse`` on M.

    ``impulse = G(z_n)^T lambda``. Where a unit did not converge, ``q`` is the
    last iterate (the caller keeps ``z_n`` there) and its impulse is 0.
    """
    c = self.constraint
    if quasi_newton:
      fixed = self.products(x_n, s_n, x_n, s_n)
      matrix = lambda qx, qs: fixed
    else:
      matrix = lambda qx, qs: self.products(qx, qs, x_n, s_n)

    def pending(carry):
      _, _, _, gq, k = carry
      # NaN compares False: a diverged unit stops.
      return (self.worst(gq) > c.tolerance) & (k < c.max_iterations)

    def iterate(carry):
      lam, qx, qs, gq, k = carry
      active = pending(carry)
      delta = jnp.where(active[..., None], _solve(matrix(qx, qs), gq, symmetric=quasi_newton), 0)
      # From the current iterate (not from z_n + step + G_n^T lambda afresh), so
      # that the rounding of the large G_n^T lambda is corrected, not redrawn.
      dx, ds = self.transpose(x_n, s_n, delta)
      qx, qs = qx - dx, qs - ds
      return lam - delta, qx, qs, self.values(qx, qs), k + active

    moved_x, moved_s = x_n + step_x, s_n + step_s
    start = (
      jnp.zeros(self.layout.other_shape + (self.components,), x_n.dtype),
      moved_x,
      moved_s,
      self.values(moved_x, moved_s),
      jnp.zeros(self.layout.other_shape, jnp.int32),
    )
    lam, qx, qs, gq, k = bounded_while_loop(
      lambda carry: jnp.any(pending(carry)), iterate, start, c.max_iterations, c.loop == "fixed"
    )
    converged = (self.worst(gq) <= c.tolerance) & self.finite(qx, qs)
    impulse = self.transpose(x_n, s_n, jnp.where(converged[..., None], lam, 0))
    return (qx, qs), impulse, k, converged

  def descend(self, x, s):
    """Newton's method for ``g = 0`` along each iterate's own normals: ``(q, iterations, converged)`` per unit.

    ``q <- q - G(q)^T (G(q) G(q)^T)^{-1} g(q)``, the shortest step that zeroes
    the linearisation of ``g`` at ``q``. Far from a small manifold (a norm
    projected from 500 times its bound, say) each step scales a unit by a
    factor of order one, so the unit keeps float32 rounding; SHAKE's
    corrections along the fixed ``G(z)^T`` would cancel nearly all of ``z``
    and leave ``|z| / |q|`` ulp of it in the result. Where a unit did not
    converge, ``q`` is the last iterate.
    """
    c = self.constraint

    def pending(carry):
      _, _, gq, k = carry
      return (self.worst(gq) > c.tolerance) & (k < c.max_iterations)  # NaN compares False: a diverged unit stops

    def iterate(carry):
      qx, qs, gq, k = carry
      active = pending(carry)
      delta = jnp.where(active[..., None], _solve(self.products(qx, qs, qx, qs), gq, symmetric=True), 0)
      dx, ds = self.transpose(qx, qs, delta)
      qx, qs = qx - dx, qs - ds
      return qx, qs, self.values(qx, qs), k + active

    start = (x, s, self.values(x, s), jnp.zeros(self.layout.other_shape, jnp.int32))
    qx, qs, gq, k = bounded_while_loop(
      lambda carry: jnp.any(pending(carry)), iterate, start, c.max_iterations, c.loop == "fixed"
    )
    return (qx, qs), k, (self.worst(gq) <= c.tolerance) & self.finite(qx, qs)


# Up to this many components per unit, G G^T is built from separate passes over
# the leaf (one per row of the Jacobian) and the small systems are solved by
# elimination elementwise over the units (LAPACK's batched solve loops over them).
_FEW_COMPONENTS = 8


def _solve(matrix, rhs, symmetric):
  """``matrix^{-1} rhs`` for a batch of small systems ``(..., m, m)``, ``(..., m)``.

  Few components: Gaussian elimination with partial pivoting, elementwise
  over the batch. Otherwise LAPACK: Cholesky for the symmetric positive
  definite ``G G^T``, LU for Newton's ``G(q) G(q_n)^T``. On CPU a ``vmap``
  is a loop (:func:`~cola_jax._platform.one_matrix_at_a_time`), each
  iteration the units' batch as one call (one unit at a time was the slower
  form on XLA:CPU).
  """
  if rhs.shape[-1] <= _FEW_COMPONENTS:
    return _eliminate(matrix, rhs)
  if symmetric:
    solve = lambda a, b: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), b[..., None])[..., 0]
  else:
    solve = lambda a, b: jnp.linalg.solve(a, b[..., None])[..., 0]
  return one_matrix_at_a_time(solve)(matrix, rhs)


def _eliminate(a, b):
  """Gaussian elimination with partial pivoting, each row operation at once over the batch.

  ``m`` unrolled steps of a few array operations (written out entry by entry,
  the ``m^3`` scalar operations are slow to compile).
  """
  m = b.shape[-1]
  rows = np.arange(m)
  for k in range(m):
    # The first row at or below k with the largest |a[., k]| is swapped into row k.
    pivot = jnp.argmax(jnp.where(rows >= k, jnp.abs(a[..., :, k]), -1), axis=-1)[..., None]
    a_pivot = jnp.take_along_axis(a, pivot[..., None], axis=-2)
    b_pivot = jnp.take_along_axis(b, pivot, axis=-1)
    at_pivot = rows == pivot
    a = jnp.where(at_pivot[..., None], a[..., k : k + 1, :], a).at[..., k, :].set(a_pivot[..., 0, :])
    b = jnp.where(at_pivot, b[..., k : k + 1], b).at[..., k].set(b_pivot[..., 0])
    factor = jnp.where(rows > k, a[..., :, k] / a[..., k : k + 1, k], 0)
    a = a - factor[..., None] * a[..., k : k + 1, :]
    b = b - factor * b[..., k : k + 1]
  x = jnp.zeros_like(b)
  for i in reversed(range(m)):
    known = jnp.sum(jnp.where(rows > i, a[..., i, :] * x, 0), axis=-1)
    x = x.at[..., i].set((b[..., i] - known) / a[..., i, i])
  return x


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
      :class:`~cola_jax.MaxNorm` and Keras' constraints): the axes that form one
      unit; the functions take one unit (shaped by those axes, in the leaf's
      order) and apply to every unit (see "Per unit" in the module docstring).
      ``axis=0`` on a Dense kernel ``(in, out)`` constrains each column.
    loop: ``"while"`` (the default) stops the Newton iteration as soon as
      every unit meets the tolerance and reprojects a parameter found off the
      manifold only then. ``"fixed"`` runs ``max_iterations`` iterations,
      those after convergence masked, and always computes the reprojection,
      selected where needed: the same point, iterations and flags with no loop
      whose end the host must read; on a GPU it is the slower form.

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
    >>> w = zero_mean_norm2.nearest(jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    >>> bool(jnp.allclose(w.sum(axis=0), 0.0, atol=1e-5)), round(float(jnp.sum(w**2)), 4)
    (True, 4.0)
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
  loop: str = "while"

  project_noise_with_force = True

  def __post_init__(self):
    for name in ("equality", "inequality"):
      fn = getattr(self, name)
      if fn is not None and not callable(fn):
        raise TypeError(f"Implicit: {name} must be a function x -> array, got {fn!r}.")
    if self.equality is None and self.inequality is None:
      raise ValueError("Implicit: give equality=, inequality= or both.")
    check_positive("Implicit", "tolerance", self.tolerance)
    check_positive_integer("Implicit", "max_iterations", self.max_iterations)
    check_loop("Implicit", self.loop)
    object.__setattr__(self, "axis", _axes.normalize("Implicit", "axis", self.axis))

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

  def _layout(self, shape) -> UnitLayout:
    """The units of a leaf of ``shape``: the whole leaf without ``axis``."""
    ndim = len(shape)
    unit = tuple(range(ndim)) if self.axis is None else tuple(sorted(a % ndim for a in self.axis))
    return UnitLayout(tuple(shape), unit)

  def _geometry(self, shape) -> _Geometry:
    layout = self._layout(shape)
    unit = jax.ShapeDtypeStruct(layout.unit_shape, jnp.float32)
    sizes = [0 if fn is None else math.prod(jax.eval_shape(fn, unit).shape) for fn in (self.equality, self.inequality)]
    return _Geometry(self, layout, *sizes)

  def _slack_shape(self, shape):
    """The stored slacks: ``(*other shape, *inequality(unit).shape)``, or ``(*other shape, 0)``."""
    layout = self._layout(shape)
    if self.inequality is None:
      return layout.other_shape + (0,)
    unit = jax.ShapeDtypeStruct(layout.unit_shape, jnp.float32)
    return layout.other_shape + jax.eval_shape(self.inequality, unit).shape

  # The Constraint interface.

  def init(self, param):
    if self.inequality is None:
      slack = jnp.zeros(self._slack_shape(param.shape), param.dtype)
    else:
      d = self._layout(param.shape).map(self.inequality)(param).astype(param.dtype)
      slack = jnp.sqrt(jnp.maximum(-d, 0))
    return ImplicitState(slack=slack, iterations=jnp.zeros((), jnp.int32), converged=jnp.array(True), constraint=self)

  def point(self, param, aux):
    """The leaf and slacks; the units with ``max |g| > tolerance`` projected from themselves first."""
    geometry = self._geometry(param.shape)
    s = geometry.slack_matrix(aux.slack.astype(param.dtype))
    off = ~(geometry.worst(geometry.values(param, s)) <= self.tolerance)  # NaN too: its projection fails, flagged
    x, s, k, converged = self._from_itself(geometry, param, s, off)
    return ImplicitPoint(x, s.reshape(aux.slack.shape), k, converged)

  def _from_itself(self, geometry, x, s, needed):
    """The units where ``needed`` projected from themselves by Newton: ``(x, s, iterations, converged)`` per unit.

    A unit whose projection fails is left as it was, flagged; the others are
    left as they are (no iteration, converged).
    """

    # A while loop of at most one iteration rather than lax.cond: under vmap a
    # cond runs both branches for every member, the loop only while one needs it
    # (with fixed loops: always, selected).
    def reproject(carry):
      x, s, _, _, _ = carry
      q, k, converged = geometry.descend(x, s)
      x, s = geometry.where(needed & converged, q, (x, s))
      return x, s, jnp.where(needed, k, 0), converged | ~needed, jnp.array(False)

    per_unit = geometry.layout.other_shape
    start = (x, s, jnp.zeros(per_unit, jnp.int32), jnp.ones(per_unit, bool), jnp.any(needed))
    x, s, k, converged, _ = bounded_while_loop(lambda carry: carry[4], reproject, start, 1, self.loop == "fixed")
    return x, s, k, converged

  def nearest(self, param):
    """The parameter projected onto the manifold from itself (see the module docstring).

    Raises ValueError, where the values are known (outside ``jit``), if that
    projection fails; under ``jit`` the parameter is returned unprojected.
    """
    point = _compiled.call(_projected_from_itself, (self,), param)
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

  def unpack(self, point, param):
    return point.x, ImplicitState(
      slack=point.slack,
      iterations=jnp.max(point.iterations),
      converged=jnp.all(point.converged),
      constraint=self,
    )

  def residual(self, param, aux):
    """:meth:`ImplicitState.residual`."""
    return aux.residual(param)

  def ambient_gradient(self, point, grad):
    """Ambient vectors and momenta are flat, ``(n + K,)``: the leaf's entries, then the slacks'."""
    return jnp.concatenate([grad.ravel(), jnp.zeros(point.slack.size, grad.dtype)])

  def ambient_normal(self, key, point):
    return _noise.normal(key, (point.x.size + point.slack.size,), point.x.dtype)

  def project(self, anchor, step):
    geometry = self._geometry(anchor.x.shape)
    s = geometry.slack_matrix(anchor.slack)
    q, _, k, converged = geometry.shake(anchor.x, s, *geometry.split(step), self.quasi_newton)
    x, s = geometry.where(converged, q, (anchor.x, s))
    return ImplicitPoint(x, s.reshape(anchor.slack.shape), anchor.iterations + k, anchor.converged & converged)

  def retract(self, point, tangent):
    """SHAKE from ``q`` along ``q + v``; a unit where it has no solution is projected from ``q + v`` itself.

    SHAKE corrects along the normals at ``q``, which cannot reach the
    manifold from a step that goes too far (past the vertex of a parabola,
    say); Newton from the moved point, along the normals of each iterate, as
    at the start of an update, can. A unit that neither reaches stays at
    ``q``, flagged.
    """
    geometry = self._geometry(point.x.shape)
    shaken = self.project(point, tangent)
    vx, vs = geometry.split(tangent)
    failed = ~shaken.converged
    x, s, k, converged = self._from_itself(geometry, point.x + vx, geometry.slack_matrix(point.slack) + vs, failed)
    # Where SHAKE failed and Newton too, SHAKE's result: the unit left at q, flagged (converged is then False).
    x, s = geometry.where(failed & converged, (x, s), (shaken.x, geometry.slack_matrix(shaken.slack)))
    return ImplicitPoint(x, s.reshape(point.slack.shape), shaken.iterations + k, converged)

  def cotangent(self, point, vector):
    geometry = self._geometry(point.x.shape)
    return geometry.join(*geometry.cotangent(point.x, geometry.slack_matrix(point.slack), *geometry.split(vector)))

  def zero_momentum(self, param):
    """The momentum is stored flat, ``(n + K,)``: the leaf's entries, then the slacks' (``K`` of them)."""
    return jnp.zeros(param.size + math.prod(self._slack_shape(param.shape)), param.dtype)

  def a_step(self, point, momentum, h):
    geometry = self._geometry(point.x.shape)
    x_n, s_n = point.x, geometry.slack_matrix(point.slack)
    px, ps = geometry.split(momentum)
    (qx, qs), (ix, is_), k, converged = geometry.shake(x_n, s_n, h * px, h * ps, self.quasi_newton)
    # At h = 0 nothing moves: no impulse (rather than 0 / 0).
    moving = h != 0
    inverse_h = jnp.where(moving, 1 / jnp.where(moving, h, 1), 0)
    kick = lambda impulse: jnp.where(moving, impulse * inverse_h, 0)
    new_px, new_ps = geometry.cotangent(qx, qs, px + kick(ix), ps + kick(is_))
    accepted = converged & geometry.finite(new_px, new_ps)
    # Rejected units (not converged, or a non-finite momentum) stay at q_n with the momentum reversed.
    qx, qs = geometry.where(accepted, (qx, qs), (x_n, s_n))
    new_px, new_ps = geometry.where(accepted, (new_px, new_ps), (-px, -ps))
    new_point = ImplicitPoint(qx, qs.reshape(point.slack.shape), point.iterations + k, point.converged & accepted)
    return new_point, geometry.join(new_px, new_ps)


def _projected_from_itself(constraint: Implicit, param: jax.Array) -> ImplicitPoint:
  return constraint.point(param, constraint.init(param))
