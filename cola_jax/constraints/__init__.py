"""Constraint manifolds, one module each."""

from cola_jax.constraints.base import Constraint, ConstraintState, Euclidean
from cola_jax.constraints.box import Box, BoxState
from cola_jax.constraints.circle import Circle, CircleState, start_slack
from cola_jax.constraints.implicit import Implicit, ImplicitState
from cola_jax.constraints.max_norm import MaxNorm, MaxNormState
from cola_jax.constraints.max_spectral_norm import MaxSpectralNorm, MaxSpectralNormState
from cola_jax.constraints.non_negative import NonNegative, NonNegativeState
from cola_jax.constraints.orthogonal import Orthogonal, ProjectionInfo, StiefelPoint, from_tall_view, tall_view
from cola_jax.constraints.unit_norm import UnitNorm, UnitNormState

__all__ = [
  "Box",
  "BoxState",
  "Circle",
  "CircleState",
  "Constraint",
  "ConstraintState",
  "Euclidean",
  "Implicit",
  "ImplicitState",
  "MaxNorm",
  "MaxNormState",
  "MaxSpectralNorm",
  "MaxSpectralNormState",
  "NonNegative",
  "NonNegativeState",
  "Orthogonal",
  "ProjectionInfo",
  "StiefelPoint",
  "UnitNorm",
  "UnitNormState",
  "from_tall_view",
  "start_slack",
  "tall_view",
]
