r"""Conformance checks for constraints: what any :class:`~cola_jax.Constraint` must satisfy to be stepped.

:func:`check_constraint` runs a constraint's methods on one leaf shape and
raises an ``AssertionError`` naming the first property that fails. Every
constraint of the library passes it (``tests/test_conformance.py``); run it
on a constraint of your own (``docs/guides/custom_constraint.md``).

Rounding. Each comparison allows what float rounding can leave, from the
computation and not from one machine's results: a residual, an inner product
or a projection of the geometry is a sum of at most ``N`` products, ``N`` the
ambient dimension (the entries of an ambient vector: the leaf's, and its
slacks'), and two such computations compared (a projection and its check,
compiled and eager) differ by at most twice Higham's ``gamma_N`` bound,
``2 N u`` (``u = eps / 2`` the unit roundoff) relative to the sizes involved.
The bound used is

.. math::
  b = 2 (N + 2)\, \varepsilon,

the ``2`` more terms for the subtraction and the scaling that most residuals
add. A projection that stops at a tolerance (``Orthogonal``'s and
``Implicit``'s ``tolerance``) may leave that much of its residual.
"""

import contextlib
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax.constraints.base import Constraint
from cola_jax.diagnostics import constraint_residuals
from cola_jax.transforms import cola_ud

_FIRST_ORDER = 0.1  # how much of a step of size delta a first-order check allows at second order (delta kappa << 1)
_H = 0.1  # the A step's time, relative to the point's size over the momentum's
_STEPS = 60  # the noisy run's steps
_TEMPERATURE = 0.05


def check_constraint(
  constraint: Constraint,
  shape: tuple[int, ...],
  *,
  dtype: Any = jnp.float32,
  key: jax.Array | None = None,
  tolerance: float | None = None,
) -> None:
  r"""Checks ``constraint`` against the protocol of :class:`~cola_jax.Constraint` on a leaf of ``shape``.

  From a standard normal start ``x`` (drawn from ``key``), with ``q`` the
  first update's point, ``w`` its parameter and ``v`` a standard normal
  ambient vector, it checks, in this order:

  1. *projection*: :meth:`~cola_jax.Constraint.nearest` is where the first
     update starts, on the set (``residual(w) <= b``), and idempotent
     (``nearest(w) = w``);
  2. *cotangent projection*: ``Pi v`` (:meth:`~cola_jax.Constraint.cotangent`,
     as a vector by :meth:`~cola_jax.Constraint.momentum_vector`) is
     idempotent, the rest ``v - Pi v`` is orthogonal to it and projects to 0,
     and a frame's coordinates are an isometry;
  3. *normals*: the normals are the set's: a small step ``delta`` along the
     tangent ``Pi v`` is kept by :meth:`~cola_jax.Constraint.project` and one
     along the normal ``v - Pi v`` is undone, both to first order
     (``|error| <= 0.1 delta`` with ``delta = sqrt(max(eps, tolerance))
     max(max |w|, 1)``);
  4. *retraction*: ``R(q, 0) = q``, ``R(q, delta v)`` first order along
     ``v``, and ``R(q, v)`` on the set;
  5. *A step*: on the set with a tangent momentum after time ``h``
     (``h |v| = 0.1 |w|``), and nothing moves at ``h = 0``;
  6. *invariant measure (smoke)*: 60 steps of :func:`~cola_jax.cola_ud` with
     noise (temperature 0.05, key fixed) on the quadratic loss
     ``|x - w|^2 / 2`` stay on the set, move, and have finite means and
     variances, and :func:`~cola_jax.constraint_residuals` reads the trained
     state (its constraint state must name the constraint: a
     :class:`~cola_jax.ConstraintState`, or a state with a
     ``residual(param)`` method);
  7. *jit equals eager*: the start and an A step compiled and op by op agree
     to ``b`` (the A step's momentum to ``b / h``), NaN in the same places;
  8. *NaN shows*: a NaN entry in the parameter gives NaN in the first
     update's point, and a NaN momentum NaN after the A step.

  Each comparison allows the rounding bound ``b = 2 (N + 2) eps`` (see the
  module docstring) relative to the sizes compared, and a residual
  ``max(b, tolerance)``; every quantity is computed in ``dtype`` (at least
  float32), so ``dtype=jnp.float64`` (under ``jax.enable_x64``) checks to
  float64's bound. An exception raised inside a method of the constraint
  (or by an output of the wrong structure) fails the property being checked,
  naming the method. With the default :meth:`~cola_jax.Constraint.residual`
  (how far :meth:`~cola_jax.Constraint.point` moves the leaf) the
  projection is checked only against itself, so a consistent projection
  onto another set passes: a ``UserWarning`` says so.

  Args:
    constraint: the constraint to check.
    shape: a leaf shape the constraint accepts (its ``validate`` is called
      first).
    dtype: the leaf's floating dtype.
    key: a PRNG key for the start, the vectors and the noisy run; ``None``:
      ``jax.random.key(0)``.
    tolerance: the residual a projection may leave above rounding; ``None``:
      the constraint's own ``tolerance`` attribute where it has one, else 0.

  Raises:
    AssertionError: naming the property that failed, the constraint, the
      shape and the numbers compared, or the method that raised.

  Example:
    >>> import cola_jax as cola
    >>> from cola_jax.testing import check_constraint
    >>> check_constraint(cola.Circle(0.5), (3, 2))  # passes: returns None
    >>> import jax.numpy as jnp
    >>> class Shrunk(cola.Circle):  # a wrong cotangent space: the radial direction
    ...   def cotangent(self, point, vector):
    ...     theta, xi = point
    ...     return (vector[0] * theta + vector[1] * xi) / self.radius
    >>> check_constraint(Shrunk(0.5), (3,))
    Traceback (most recent call last):
    ...
    AssertionError: Shrunk(radius=0.5) on a leaf of shape (3,), float32: cotangent projection: ...
  """
  key = jax.random.key(0) if key is None else key
  if tolerance is None:
    tolerance = float(getattr(constraint, "tolerance", 0.0))
  check = _Check(constraint, tuple(shape), jnp.dtype(dtype), tolerance)
  k_start, k_vector, k_run = jax.random.split(key, 3)
  x = jax.random.normal(k_start, shape, dtype)
  constraint.validate(x, "check_constraint")
  if type(constraint).residual is Constraint.residual:
    warnings.warn(
      f"check_constraint: {constraint!r} keeps the default residual (how far point() moves the leaf), so the "
      "projection is checked only against itself: a consistent projection onto another set passes. Override "
      "residual(param, aux) with max |g(x)| to check the set itself.",
      UserWarning,
      stacklevel=2,
    )
  check.run(x, k_vector, k_run)


class _Check:
  """The checks of :func:`check_constraint` for one constraint and leaf."""

  def __init__(self, constraint: Constraint, shape: tuple[int, ...], dtype, tolerance: float):
    self.c = constraint
    self.shape = shape
    self.dtype = dtype
    self.eps = float(jnp.finfo(dtype).eps)
    self.tolerance = tolerance

  def fail(self, prop: str, detail: str):
    error = AssertionError(f"{self.c!r} on a leaf of shape {self.shape}, {self.dtype}: {prop}: {detail}")
    error.from_check = True  # pyright: ignore[reportAttributeAccessIssue]
    raise error

  @contextlib.contextmanager
  def calling(self, prop: str, methods: str):
    """Turns an exception inside ``methods`` (those that ``prop`` calls) into ``prop``'s failure, naming the method."""
    try:
      yield
    except Exception as error:
      if getattr(error, "from_check", False):
        raise
      at_fault = _methods_in_traceback(self.c, error.__traceback__)
      where = (
        f"{at_fault[-1]} raised" + (f" (called by {' <- '.join(reversed(at_fault[:-1]))})" if at_fault[:-1] else "")
        if at_fault
        else f"the outputs of {methods} do not fit together (see the protocol of Constraint)"
      )
      message = str(error).split("\n--------------------\n")[0]  # without JAX's note on its filtered frames
      self.fail(prop, f"{where}: {type(error).__name__}: {message}")

  def at_most(self, prop: str, what: str, value, bound: float):
    value = float(value)
    if not value <= bound:  # NaN fails
      self.fail(prop, f"{what} is {value:.3g}, above the bound {bound:.3g}")

  def run(self, x, k_vector, k_run):
    self.check_structure(x, k_vector)
    sample = jax.jit(lambda x: self.sample(x, k_vector))(x)
    self.bound = 2 * (sample["ambient_size"] + 2) * self.eps
    self.residual_bound = max(self.bound, self.tolerance)
    self.check_projection(sample)
    self.check_cotangent(sample)
    self.check_normals(sample)
    self.check_retraction(sample)
    self.check_a_step(sample)
    self.check_noisy_run(sample["w"], k_run)
    self.check_eager(x, sample)
    self.check_nan(sample)

  def check_structure(self, x, k_vector):
    """The protocol's shapes: the ambient vectors, the gradient and the stored momentum fit the point."""
    c = self.c
    prop = "protocol shapes"
    with self.calling(prop, "init, point, ambient_normal"):
      _, v = jax.eval_shape(lambda x: _point_and_vector(c, x, k_vector), x)
    with self.calling(prop, "ambient_gradient"):
      gradient = jax.eval_shape(lambda x: c.ambient_gradient(_point_and_vector(c, x, k_vector)[0], x), x)
    if not _same_shapes(gradient, v):
      self.fail(
        prop,
        f"ambient_gradient(point, grad) has shapes {_shapes(gradient)} where the ambient vectors (ambient_normal) "
        f"have {_shapes(v)}: a point other than the leaf needs ambient_gradient (the gradient, zero on slacks)",
      )
    with self.calling(prop, "zero_momentum, load_momentum, cotangent"):
      loaded = jax.eval_shape(lambda x: c.load_momentum(c.zero_momentum(x)), x)
      coordinates = jax.eval_shape(lambda x: c.cotangent(*_point_and_vector(c, x, k_vector)), x)
    if not _same_shapes(loaded, coordinates):
      self.fail(
        prop,
        f"load_momentum(zero_momentum(x)) has shapes {_shapes(loaded)} where cotangent(q, v) has "
        f"{_shapes(coordinates)}: zero_momentum (or load_momentum) does not give a momentum",
      )

  # What is computed, compiled once.

  def sample(self, x, k_vector):
    c = self.c
    with self.calling("projection", "init, point, unpack, nearest, residual"):
      q = c.point(x, c.init(x))
      w, aux = c.unpack(q, x)
      projection = {"w": w, "nearest_of_x": c.nearest(x), "nearest_of_w": c.nearest(w), "residual": c.residual(w, aux)}
    with self.calling("cotangent projection", "ambient_normal, cotangent, momentum_vector"):
      v = c.ambient_normal(k_vector, q)
      coordinates = c.cotangent(q, v)
      t = c.momentum_vector(q, coordinates)
      n = _sub(v, t)
      cotangent = {
        "v": v,
        "coordinates": coordinates,
        "t": t,
        "n": n,
        "twice_projected": c.cotangent(q, t),
        "projected_normal": c.cotangent(q, n),
      }
    scale = jnp.maximum(jnp.max(jnp.abs(w)), 1)
    delta = math.sqrt(max(self.eps, self.tolerance)) * scale  # a normal step of delta is above the tolerance
    unit_t, unit_n = _scaled(t, 1 / _norm(t)), _scaled(n, 1 / _norm(n))
    with self.calling("normals", "ambient_gradient, project, unpack"):
      param_part = _adjoint_of_ambient_gradient(c, q, x)
      normals = {
        "delta": delta,
        "t_param": param_part(unit_t),
        "along_tangent": c.unpack(c.project(q, _scaled(unit_t, delta)), x)[0],
        "along_normal": c.unpack(c.project(q, _scaled(unit_n, delta)), x)[0],
      }
    h = _H * _norm(w) / _norm(t)
    with self.calling("retraction", "retract, unpack, residual"):
      retracted = c.retract(q, _scaled(coordinates, h))
      w_retracted, aux_retracted = c.unpack(retracted, x)
      retraction = {
        "retract_zero": c.unpack(c.retract(q, _scaled(coordinates, 0.0)), x)[0],
        "retract_delta": c.unpack(c.retract(q, _scaled(coordinates, delta / _norm(t))), x)[0],
        "retracted_residual": c.residual(w_retracted, aux_retracted),
      }
    with self.calling("A step", "a_step, unpack, residual, cotangent, momentum_vector"):
      q1, p1 = c.a_step(q, coordinates, h)
      w1, aux1 = c.unpack(q1, x)
      q_still, p_still = c.a_step(q, coordinates, jnp.zeros((), w.dtype))
      a_step = {
        "h": h,
        "a_step_residual": c.residual(w1, aux1),
        "p1": p1,
        "p1_projected": c.cotangent(q1, c.momentum_vector(q1, p1)),
        "still_w": c.unpack(q_still, x)[0],
        "still_p": p_still,
        "w1": w1,
      }
    with self.calling("NaN shows", "init, point, unpack, a_step"):
      nan_x = x.at[(0,) * x.ndim].set(jnp.nan)
      nan_momentum = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), coordinates)
      nan_q1, nan_p1 = c.a_step(q, nan_momentum, h)
      nan = {"nan_start": c.unpack(c.point(nan_x, c.init(nan_x)), x)[0], "nan_step": (c.unpack(nan_q1, x)[0], nan_p1)}
    ambient_size = sum(a.size for a in jax.tree.leaves(v))
    return {"ambient_size": ambient_size, **projection, **cotangent, **normals, **retraction, **a_step, **nan}

  # The properties.

  def check_projection(self, s):
    w = s["w"]
    scale = max(float(np.max(np.abs(w))), 1e-30)
    self.at_most(
      "projection",
      "max |nearest(x) - w| / max |w| (nearest is not where the first update starts)",
      _max_abs(s["nearest_of_x"], w) / scale,
      self.bound,
    )
    self.at_most("projection", "residual(nearest(x))", s["residual"], self.residual_bound)
    self.at_most(
      "projection",
      "max |nearest(w) - w| / max |w| (not idempotent)",
      _max_abs(s["nearest_of_w"], w) / scale,
      self.bound,
    )

  def check_cotangent(self, s):
    c = self.c
    v_norm = float(_norm(s["v"]))
    prop = "cotangent projection"
    if jax.tree.structure(s["t"]) != jax.tree.structure(s["v"]) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(s["t"]), jax.tree.leaves(s["v"]))
    ):
      self.fail(prop, "momentum_vector(q, cotangent(q, v)) is not shaped like the ambient vector v")
    self.at_most(
      prop,
      "max |Pi(Pi v) - Pi v| / |v| (not idempotent)",
      _max_abs(s["twice_projected"], s["coordinates"]) / v_norm,
      self.bound,
    )
    self.at_most(
      prop,
      "max |Pi(v - Pi v)| / |v| (the normal part is not projected out)",
      _max_abs(s["projected_normal"]) / v_norm,
      self.bound,
    )
    self.at_most(
      prop,
      "|<v - Pi v, Pi v>| / |v|^2 (not an orthogonal projection)",
      abs(float(_dot(s["n"], s["t"]))) / v_norm**2,
      self.bound,
    )
    if c.momentum_coordinates == "frame":
      coordinates = float(_norm(s["coordinates"]))
      self.at_most(
        prop,
        "| |momentum_vector(q, u)| - |u| | / |v| (the frame is not orthonormal)",
        abs(float(_norm(s["t"])) - coordinates) / v_norm,
        self.bound,
      )

  def check_normals(self, s):
    delta, w = float(s["delta"]), s["w"]
    moved_t = _norm(_sub(_sub(s["along_tangent"], w), _scaled(s["t_param"], delta)))
    self.at_most(
      "normals", "|P(q + delta t) - (w + delta t)| / delta (a tangent step is not kept)", moved_t / delta, _FIRST_ORDER
    )
    moved_n = _norm(_sub(s["along_normal"], w))
    self.at_most("normals", "|P(q + delta n) - w| / delta (a normal step is not undone)", moved_n / delta, _FIRST_ORDER)

  def check_retraction(self, s):
    w = s["w"]
    scale = max(float(np.max(np.abs(w))), 1e-30)
    self.at_most("retraction", "max |R(q, 0) - q| / max |w|", _max_abs(s["retract_zero"], w) / scale, self.bound)
    delta = float(s["delta"])
    error = _norm(_sub(_sub(s["retract_delta"], w), _scaled(s["t_param"], delta)))
    self.at_most("retraction", "|R(q, delta v) - (w + delta v)| / delta (not first order)", error / delta, _FIRST_ORDER)
    self.at_most("retraction", "residual(R(q, h v))", s["retracted_residual"], self.residual_bound)

  def check_a_step(self, s):
    self.at_most("A step", "residual after an A step", s["a_step_residual"], self.residual_bound)
    p1 = s["p1"]
    scale = max(float(_norm(p1)), 1e-30)
    self.at_most(
      "A step",
      "max |Pi(p') - p'| / |p'| (the new momentum is not tangent)",
      _max_abs(s["p1_projected"], p1) / scale,
      self.residual_bound,  # the new point is on the set to the projection's tolerance, Pi idempotent to as much
    )
    w = s["w"]
    w_scale = max(float(np.max(np.abs(w))), 1e-30)
    self.at_most(
      "A step", "max |A_0(q) - q| / max |w| (h = 0 moves the point)", _max_abs(s["still_w"], w) / w_scale, self.bound
    )
    p_scale = max(float(_norm(s["coordinates"])), 1e-30)
    self.at_most(
      "A step",
      "max |A_0(p) - p| / |p| (h = 0 changes the momentum)",
      _max_abs(s["still_p"], s["coordinates"]) / p_scale,
      self.bound,
    )

  def check_noisy_run(self, w, key):
    prop = "invariant measure (smoke)"
    with self.calling(prop, "cola_ud's steps and the constraint state's residual(param)"):
      trajectory, residuals, trained = self.noisy_run(w, key)
    # params + updates rounds once more than the step's own point: an eps of the leaf's size, relative to it.
    self.at_most(
      prop,
      "the largest residual along a noisy run",
      np.max(np.where(np.isnan(residuals), np.inf, residuals)),
      self.residual_bound + 2 * self.eps,
    )
    later = np.asarray(trajectory[_STEPS // 2 :], np.float64)
    mean, variance = later.mean(axis=0), later.var(axis=0)
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(variance))):
      self.fail(prop, "the noisy run's means or variances are not finite")
    if not np.max(variance) > 0:
      self.fail(prop, "the noisy run does not move the leaf")
    params, state = trained
    with self.calling(prop, "constraint_residuals on the trained state (the constraint state's residual)"):
      reported = constraint_residuals(params, state)
    self.at_most(
      prop,
      "constraint_residuals of the trained state",
      np.nan_to_num(np.asarray(reported, np.float64), nan=np.inf),
      self.residual_bound + 2 * self.eps,
    )

  def noisy_run(self, w, key):
    c = self.c
    tx = cola_ud(0.1, friction=1.0, temperature=_TEMPERATURE, key=key, constraints=c)
    target = jnp.asarray(w)

    def step(carry, _):
      params, state = carry
      updates, state = tx.update(params - target, state, params)
      params = params + updates
      aux = state.constraint_states  # pyright: ignore[reportAttributeAccessIssue]  (cola_ud's state)
      # As constraint_residuals reads it: the state's own residual where it has one (the transforms keep any other
      # state beside its constraint), else the constraint's.
      return (params, state), (params, aux.residual(params) if hasattr(aux, "residual") else c.residual(params, aux))

    @jax.jit
    def run(params):
      trained, (trajectory, residuals) = jax.lax.scan(step, (params, tx.init(params)), length=_STEPS)
      return trajectory, residuals, trained

    with warnings.catch_warnings():  # the leaf alone, read as the constraint's own methods read it: nothing to say
      warnings.filterwarnings("ignore", "[^:]*: a matrix in no layer whose layout is known", UserWarning)
      return run(target)

  def check_eager(self, x, s):
    c, h = self.c, s["h"]
    prop = "jit equals eager"
    with self.calling(prop, "init, point, cotangent, a_step, unpack"), jax.disable_jit():
      q = c.point(x, c.init(x))
      q1, p1 = c.a_step(q, c.cotangent(q, s["v"]), h)
      eager = (c.unpack(q, x)[0], c.unpack(q1, x)[0], p1)
    compiled = (s["w"], s["w1"], s["p1"])
    for name, a, b, slack in zip(("start", "A step's point", "A step's momentum"), compiled, eager, (1, 1, float(h))):
      for ca, eb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        ca, eb = np.asarray(ca, np.float64), np.asarray(eb, np.float64)
        if not np.array_equal(np.isnan(ca), np.isnan(eb)):
          self.fail(prop, f"the {name} has NaN in other entries compiled than eager")
        scale = max(float(np.max(np.abs(np.where(np.isnan(ca), 0, ca)), initial=0)), 1.0)
        self.at_most(
          prop, f"max |compiled - eager| of the {name} / max(|.|, 1)", _max_abs(ca, eb) * slack / scale, self.bound
        )

  def check_nan(self, s):
    if not np.any(np.isnan(np.asarray(s["nan_start"]))):
      self.fail("NaN shows", "a parameter with a NaN entry gives a finite first point: the NaN goes unseen")
    if not any(np.any(np.isnan(np.asarray(a))) for a in jax.tree.leaves(s["nan_step"])):
      self.fail("NaN shows", "an A step with a NaN momentum gives a finite point and momentum: the NaN goes unseen")


def _methods_in_traceback(c: Constraint, traceback) -> list[str]:
  """The constraint methods a traceback passes through, outermost first (``Circle.project`` for another's)."""
  names = []
  while traceback is not None:
    frame = traceback.tb_frame
    owner, name = frame.f_locals.get("self"), frame.f_code.co_name
    if isinstance(owner, Constraint) and callable(getattr(type(owner), name, None)):
      names.append(name if owner is c else f"{type(owner).__name__}.{name}")
    traceback = traceback.tb_next
  return names


def _point_and_vector(c: Constraint, x, key):
  q = c.point(x, c.init(x))
  return q, c.ambient_normal(key, q)


def _shapes(tree):
  return jax.tree.map(lambda a: tuple(a.shape), tree)


def _same_shapes(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def _adjoint_of_ambient_gradient(c: Constraint, q, x):
  """The leaf-shaped part of an ambient vector: the adjoint of the linear ``grad -> ambient_gradient(q, grad)``."""
  _, pullback = jax.vjp(lambda g: c.ambient_gradient(q, g), jnp.zeros_like(x))
  return lambda vector: pullback(vector)[0]


def _sub(a, b):
  return jax.tree.map(lambda x, y: x - y, a, b)


def _scaled(a, factor):
  return jax.tree.map(lambda x: x * factor, a)


def _dot(a, b):
  """``<a, b>`` over every array of two trees, in their dtype (at least float32: float64 stays float64)."""
  total = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    dtype = jnp.promote_types(jnp.promote_types(x.dtype, y.dtype), jnp.float32)
    total = total + jnp.sum(x.astype(dtype) * y.astype(dtype))
  return total


def _norm(a):
  return jnp.sqrt(_dot(a, a))


def _max_abs(a, b=None) -> float:
  """``max |a - b|`` (or ``max |a|``) over every array of two trees, in float64 on the host; ``inf`` for NaN."""
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b) if b is not None else [None] * len(jax.tree.leaves(a)))
  largest = 0.0
  for x, y in pairs:
    d = np.asarray(x, np.float64) - (0 if y is None else np.asarray(y, np.float64))
    if d.size:
      largest = max(largest, float(np.max(np.where(np.isnan(d), np.inf, np.abs(d)))))
  return largest
