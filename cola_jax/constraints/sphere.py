"""The module of the previous release's ``Sphere``, now :mod:`cola_jax.constraints.max_norm`.

``from cola_jax.constraints.sphere import Sphere`` (or ``SphereState``) keeps
working for one release: the names resolve to ``MaxNorm`` and
``MaxNormState``, with a DeprecationWarning that names them.
"""

from cola_jax.constraints.max_norm import deprecated_name


def __getattr__(name: str):
  return deprecated_name("cola_jax.constraints", name)
