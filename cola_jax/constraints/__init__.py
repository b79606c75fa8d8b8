"""Constraint manifolds, one module each."""

from cola_jax.constraints.base import Constraint, Euclidean
from cola_jax.constraints.circle import Circle, CircleState
from cola_jax.constraints.implicit import Implicit, ImplicitState
from cola_jax.constraints.orthogonal import Orthogonal, ProjectionInfo
from cola_jax.constraints.sphere import Sphere, SphereState

__all__ = [
    "Circle", "CircleState", "Constraint", "Euclidean", "Implicit", "ImplicitState", "Orthogonal",
    "ProjectionInfo", "Sphere", "SphereState",
]
