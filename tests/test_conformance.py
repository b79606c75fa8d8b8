"""cola_jax.testing.check_constraint: every built-in constraint passes it, and each property it names can fail.

The registry of constraints is ``tests/_constraints.py``. The failing cases
are a small constraint written as a user would (the sphere ``|w| = r``, two
methods and a residual, public names only) with one method broken at a time:
the check must name the property that the broken method violates.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from _constraints import CASES, VARIANTS, params
from jax.core import Tracer

import cola_jax as cola
from cola_jax.testing import check_constraint


# Quick: non_negative here and the circle in float64 below; the other constraints extended, the variants slow.
@pytest.mark.parametrize(
  ("constraint", "shape"),
  params(CASES, quick={"non_negative"}, rest=pytest.mark.extended) + params(VARIANTS, quick=()),
)
def test_the_built_in_constraints_conform(constraint, shape):
  check_constraint(constraint, shape)


@pytest.mark.parametrize(("constraint", "shape"), params(quick={"circle"}))
def test_the_built_in_constraints_conform_in_float64(constraint, shape):
  """Every comparison in float64 against float64's bound (an inner product in float32 once failed them all)."""
  with jax.enable_x64(True):
    check_constraint(constraint, shape, dtype=jnp.float64)


def test_the_registry_has_every_constraint_of_the_library():
  classes = {type(c) for _, c, _ in CASES}
  public = {
    obj
    for obj in vars(cola).values()
    if isinstance(obj, type) and issubclass(obj, cola.Constraint) and obj is not cola.Constraint
  }
  assert public <= classes, f"no case in tests/_constraints.py for {sorted(k.__name__ for k in public - classes)}"


@dataclasses.dataclass(frozen=True)
class Sphere(cola.Constraint):
  """``|w| = radius`` for the whole leaf: a projection, a cotangent projection and a residual."""

  radius: float = 1.0

  def project(self, anchor, step):
    moved = anchor + step
    return moved * (self.radius / jnp.linalg.norm(moved))

  def cotangent(self, point, vector):
    return vector - jnp.vdot(point, vector) / self.radius**2 * point

  def residual(self, param, aux):
    return jnp.abs(jnp.sum(param * param) / self.radius**2 - 1)


class OffTheSet(Sphere):
  def project(self, anchor, step):
    return 1.01 * super().project(anchor, step)


class NotIdempotent(Sphere):
  def project(self, anchor, step):
    return jnp.roll(super().project(anchor, step), 1)  # on the sphere, but moved again by every projection


class HalfProjection(Sphere):
  def cotangent(self, point, vector):
    return 0.5 * super().cotangent(point, vector)  # into the tangent plane, but not a projection


class Oblique(Sphere):
  def cotangent(self, point, vector):
    along = point + 0.5 * jnp.roll(point, 1)  # onto the tangent plane, along another direction than the normal
    return vector - jnp.vdot(point, vector) / jnp.vdot(point, along) * along


class WrongNormals(Sphere):
  def cotangent(self, point, vector):
    return vector.at[0].set(0)  # an orthogonal projection, but onto another plane than the tangent one


class RetractionMoves(Sphere):
  def retract(self, point, tangent):
    return self.project(point, tangent + 0.01 * jnp.roll(point, 1))


class MomentumLeftBehind(Sphere):
  def a_step(self, point, momentum, h):
    return self.project(point, h * momentum), momentum  # not projected onto the new tangent space


class HidesNaN(Sphere):
  def project(self, anchor, step):
    return super().project(jnp.nan_to_num(anchor), jnp.nan_to_num(step))


class CompiledDiffers(Sphere):
  def a_step(self, point, momentum, h):
    point, momentum = super().a_step(point, momentum, h)
    if isinstance(momentum, Tracer):  # only when traced: compiled and eager disagree
      momentum = momentum * (1 + h)
    return point, momentum


@pytest.mark.extended  # quick: the broken-method cases below, each passing every check before the one it breaks
def test_a_constraint_of_two_methods_conforms():
  check_constraint(Sphere(2.0), (3,))


@pytest.mark.parametrize(
  ("constraint", "message"),
  [
    (OffTheSet(), r"projection: residual\(nearest\(x\)\) is 0.0201"),
    (NotIdempotent(), r"projection: max \|nearest\(w\) - w\| / max \|w\| \(not idempotent\)"),
    (HalfProjection(), r"cotangent projection: max \|Pi\(Pi v\) - Pi v\| / \|v\| \(not idempotent\)"),
    (Oblique(), r"cotangent projection: \|<v - Pi v, Pi v>\| / \|v\|\^2 \(not an orthogonal projection\)"),
    (WrongNormals(), r"normals: \|P\(q \+ delta t\) - \(w \+ delta t\)\| / delta \(a tangent step is not kept\)"),
    (RetractionMoves(), r"retraction: max \|R\(q, 0\) - q\|"),
    (MomentumLeftBehind(), r"A step: max \|Pi\(p'\) - p'\| / \|p'\| \(the new momentum is not tangent\)"),
    (HidesNaN(), r"NaN shows: a parameter with a NaN entry gives a finite first point"),
    (CompiledDiffers(), r"jit equals eager: max \|compiled - eager\| of the A step's momentum"),
  ],
  ids=lambda x: type(x).__name__ if isinstance(x, cola.Constraint) else "",
)
def test_a_broken_method_fails_the_property_it_breaks(constraint, message):
  with pytest.raises(
    AssertionError, match=rf"^{type(constraint).__name__}\(radius=1.0\) on a leaf of shape \(3,\), float32: {message}"
  ):
    check_constraint(constraint, (3,))


def test_a_constraint_without_state_reports_its_residual():
  """The default state names its constraint, so that constraint_residuals finds its residual (not None)."""
  sphere = Sphere(2.0)
  params = {"w": jnp.array([3.0, 0.0, 4.0]), "b": jnp.zeros(2)}
  tx = cola.cola_od(0.1, constraints={"w": sphere, "b": None})
  state = tx.init(params)
  aux = state.constraint_states["w"]  # pyright: ignore[reportAttributeAccessIssue]  (cola_od's state)
  assert aux == cola.ConstraintState(slack=None, constraint=sphere)
  residuals = cola.constraint_residuals(params, state)
  assert residuals["b"] is None
  assert float(residuals["w"]) == pytest.approx(25 / 4 - 1)  # |w|^2 / r^2 - 1, far off before the first update
