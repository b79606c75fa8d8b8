"""cola_jax: constrained Langevin training (CoLA) as optax transformations.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks*, OPT2020.
"""

from cola_jax import langevin, sampling, testing
from cola_jax._platform import one_matrix_at_a_time
from cola_jax.alias import (
  c_cola_od,
  c_cola_ud,
  circle_constraints,
  langevin_to_sgd_momentum,
  o_cola_od,
  o_cola_ud,
  orthogonal_constraints,
  sgd_momentum_to_langevin,
)
from cola_jax.constrained import ConstrainedState, constrained
from cola_jax.constraints import (
  Box,
  BoxState,
  Circle,
  CircleState,
  Constraint,
  ConstraintState,
  Implicit,
  ImplicitState,
  MaxNorm,
  MaxNormState,
  MaxSpectralNorm,
  MaxSpectralNormState,
  NonNegative,
  NonNegativeState,
  Orthogonal,
  ProjectionInfo,
  UnitNorm,
  UnitNormState,
)
from cola_jax.declared import constraints_from, with_constraint
from cola_jax.diagnostics import constraint_residuals
from cola_jax.hyperspherical import hyperspherical_descent
from cola_jax.initialization import project_params
from cola_jax.langevin import Splitting
from cola_jax.manifold_muon import ManifoldMuonState, manifold_muon
from cola_jax.path_rules import path_constraints
from cola_jax.stiefel_direction import DirectionInfo
from cola_jax.transforms import OverdampedState, UnderdampedState, cola_od, cola_ud

__version__ = "0.1.0"

__all__ = [
  "Box",
  "BoxState",
  "Circle",
  "CircleState",
  "ConstrainedState",
  "Constraint",
  "ConstraintState",
  "DirectionInfo",
  "Implicit",
  "ImplicitState",
  "ManifoldMuonState",
  "MaxNorm",
  "MaxNormState",
  "MaxSpectralNorm",
  "MaxSpectralNormState",
  "NonNegative",
  "NonNegativeState",
  "Orthogonal",
  "OverdampedState",
  "ProjectionInfo",
  "Splitting",
  "UnderdampedState",
  "UnitNorm",
  "UnitNormState",
  "c_cola_od",
  "c_cola_ud",
  "circle_constraints",
  "cola_od",
  "cola_ud",
  "constrained",
  "constraint_residuals",
  "constraints_from",
  "hyperspherical_descent",
  "langevin",
  "langevin_to_sgd_momentum",
  "manifold_muon",
  "o_cola_od",
  "o_cola_ud",
  "one_matrix_at_a_time",
  "orthogonal_constraints",
  "path_constraints",
  "project_params",
  "sampling",
  "sgd_momentum_to_langevin",
  "testing",
  "with_constraint",
]
