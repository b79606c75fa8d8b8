"""Float tolerances derived from the computation, so that they hold on any CPU that XLA targets.

XLA:CPU orders a reduction's sums by the CPU's vector width and contracts
``a * b + c`` into fused multiply-adds where the CPU has them, so the same
program rounds differently on an AVX-512, an AVX2 and an SSE machine. A bound
read off one machine's rounding fails on another; these bounds count the
roundings instead, in units of ``u = eps / 2``.
"""

import numpy as np


def unit_roundoff(dtype=np.float32) -> float:
  """``u = eps / 2``: the largest relative error of one correctly rounded operation."""
  return float(np.finfo(dtype).eps) / 2


def renormalised(n: int, dtype=np.float32) -> float:
  """The relative distance from its sphere of a unit of ``n`` entries that the library renormalised.

  The sum of the ``n`` squares is within ``n u`` of its value in any order of
  summation (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1),
  its inverse square root within ``n u / 2`` and another ``3 u``
  (``lax.rsqrt`` is not correctly rounded: XLA:CPU's is a vectorised
  approximation, within 2.7 u over float32's exponent range, and CUDA's
  ``rsqrtf`` within 2 ulp), and scaling by it and by the radius rounds each
  entry by ``2 u``.
  """
  return (n / 2 + 5) * unit_roundoff(dtype)


def stepped(n: int, dtype=np.float32) -> float:
  """As ``renormalised``, after ``optax.apply_updates`` adds ``new - p`` to ``p`` (both roundings: ``3 u |new|``)."""
  return renormalised(n, dtype) + 3 * unit_roundoff(dtype)


def unit_tangent(n: int, dtype=np.float32) -> float:
  """The relative error of ``a / |a|``, ``a = g - w (w . g) / r^2``, for a unit of ``n`` entries, where ``|a| ~ |g|``.

  The dot product rounds by ``n u`` of ``|w| |g|``, the product and the
  difference by ``2 u``; ``|a|`` as a renormalisation, ``(n / 2 + 5) u``.
  """
  return (3 * n / 2 + 7) * unit_roundoff(dtype)


def roundings(k: float, dtype=np.float32) -> float:
  """``k u``: the relative error of ``k`` correctly rounded operations in a row (first order)."""
  return k * unit_roundoff(dtype)
