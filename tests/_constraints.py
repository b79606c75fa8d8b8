"""The shared registry of constraints: one case per built-in constraint, and variants, for generic tests.

A case is ``(id, constraint, shape)``: a constraint of the catalog and a leaf
shape it accepts. ``CASES`` holds one case per constraint class (the quick
suite runs them all); ``VARIANTS`` other views, solvers and options of the
same classes (slow). A test that holds for every constraint iterates
``CASES + VARIANTS`` through :func:`params`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola


def _unit_sphere(w):
  return jnp.atleast_1d(jnp.sum(w * w) - 1)


def _column_sums_and_norm(w):
  return jnp.stack([jnp.sum(w), jnp.sum(w * w) - 1])


CASES = [
  ("circle", cola.Circle(0.5), (3, 2)),
  ("box", cola.Box(-0.5, 1.5), (4,)),
  ("unit_norm", cola.UnitNorm(), (3, 2)),
  ("max_norm", cola.MaxNorm(1.0), (3, 2)),
  ("non_negative", cola.NonNegative(), (5,)),
  ("orthogonal", cola.Orthogonal(), (5, 3)),
  ("orthogonal_scaled_wide", cola.Orthogonal(scale=2.0), (3, 5)),
  ("max_spectral_norm", cola.MaxSpectralNorm(1.0), (5, 3)),
  ("implicit", cola.Implicit(equality=_unit_sphere), (4,)),
]

VARIANTS = [
  ("unit_norm_all", cola.UnitNorm(2.0, axis="all"), (3, 2)),
  ("max_norm_all", cola.MaxNorm(0.5, axis="all"), (3, 2)),
  ("orthogonal_per_matrix", cola.Orthogonal(row_axes=(1,), column_axes=(2,)), (2, 4, 3)),
  ("orthogonal_per_head", cola.Orthogonal(blocks=(2, 1)), (4, 6)),
  ("orthogonal_newton", cola.Orthogonal(projection="newton"), (5, 3)),
  ("orthogonal_square_root", cola.Orthogonal(projection="square_root"), (4, 4)),
  ("max_spectral_norm_per_matrix", cola.MaxSpectralNorm(0.5, row_axes=(1,), column_axes=(2,)), (2, 4, 3)),
  ("implicit_inequality", cola.Implicit(inequality=_unit_sphere), (4,)),
  ("implicit_quasi_newton", cola.Implicit(equality=_unit_sphere, quasi_newton=True), (4,)),
  ("implicit_per_unit", cola.Implicit(equality=_column_sums_and_norm, axis=(0,)), (3, 2)),
]


def params(cases=None, *, names: bool = False, quick=None, rest=pytest.mark.slow) -> list:
  """``pytest.param(constraint, shape, id=id)`` for each case (``(id, constraint, shape)`` with ``names``): of
  ``cases``, or of ``CASES`` and ``VARIANTS``, those of ``VARIANTS`` marked slow; with ``quick``, a collection of
  ids, every case whose id is not in it marked ``rest`` (slow, or ``pytest.mark.extended``)."""

  def param(name, constraint, shape, marks=()):
    if quick is not None:
      marks = () if name in quick else rest
    return pytest.param(*((name,) if names else ()), constraint, shape, id=name, marks=marks)

  if cases is not None:
    return [param(*c) for c in cases]
  return [param(*c) for c in CASES] + [param(*c, marks=pytest.mark.slow) for c in VARIANTS]


def case(name: str) -> tuple:
  """``(constraint, shape)`` of the case ``name`` of ``CASES`` or ``VARIANTS``."""
  found = [(c, shape) for n, c, shape in CASES + VARIANTS if n == name]
  if not found:
    raise KeyError(f"no case {name!r} in tests/_constraints.py")
  return found[0]


def start(constraint, shape, seed: int = 0) -> np.ndarray:
  """A point of ``constraint`` on a float32 leaf of ``shape``: ``cola.project_params`` of standard normal entries."""
  w = jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)
  return np.asarray(cola.project_params({"w": w}, {"w": constraint})["w"])


@functools.cache
def takes(constraint, shape: tuple) -> bool:
  """Whether the transforms take a float32 leaf of ``shape`` under ``constraint``, on a manifold of positive
  dimension (``Implicit``: more entries per unit than equalities; a unit of 1 entry on a sphere is two points)."""
  leaf = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  try:
    jax.eval_shape(cola.cola_od(0.1, constraints={"w": constraint}).init, leaf)
  except (ValueError, TypeError):
    return False
  if isinstance(constraint, cola.Implicit) and constraint.equality is not None and math.prod(shape):
    unit = tuple(shape[a] for a in (range(len(shape)) if constraint.axis is None else constraint.axis))
    equalities = jax.eval_shape(constraint.equality, jax.ShapeDtypeStruct(unit, jnp.float32))
    return math.prod(unit) > math.prod(equalities.shape)
  return True
