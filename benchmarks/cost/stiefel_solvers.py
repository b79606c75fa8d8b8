"""The problems and solvers that :mod:`benchmarks.cost.stiefel_projection` times: random Stiefel points and
steps, the paper's projection and its alternatives, the float64 reference point."""

import jax
import jax.numpy as jnp
import numpy as np

from cola_jax.constraints import stiefel_projection as sp

PAPER_FORCE = ("quasi_newton", "newton_multiplier", "square_root")
OTHER = ("polar", "qr_tangent", "qr_ambient", "cayley_tangent")
METHODS = PAPER_FORCE + OTHER


# ----------------------------------------------------------------------------
# Problems.


def random_orthonormal(key, r, s):
  """The Q factor of an ``(r, s)`` Gaussian matrix (positive diagonal of R)."""
  q, rr = jnp.linalg.qr(jax.random.normal(key, (r, s), jnp.float32))
  return q * jnp.sign(jnp.diagonal(rr))


def normal_part(q_n, d):
  """``Q_n sym(Q_n^T D)``: the component of ``D`` in the normal space at ``Q_n``."""
  y = q_n.T @ d
  return q_n @ (0.5 * (y + y.T))


def make_step(key, q_n, h, temperature, grad_rms, kind="em"):
  """Euler-Maruyama step ``-h G + sqrt(2 tau h) R`` or its tangential / normal part."""
  r, s = q_n.shape
  kg, kh, kr = jax.random.split(key, 3)
  rank = min(128, s)
  g = jax.random.normal(kg, (r, rank)) @ jax.random.normal(kh, (rank, s))
  g = g * (grad_rms / jnp.sqrt(jnp.mean(g * g)))
  d = -h * g + jnp.sqrt(2 * temperature * h) * jax.random.normal(kr, (r, s))
  if kind == "tangent":
    return d - normal_part(q_n, d)
  if kind == "normal":
    return normal_part(q_n, d)
  return d


# ----------------------------------------------------------------------------
# Methods: (q_n, q_bar) -> (Q, iterations, converged flag or None).


def _positive_qr(x):
  q, r = jnp.linalg.qr(x)
  return q * jnp.sign(jnp.diagonal(r))


def _tangent(q_n, q_bar):
  d = q_bar - q_n
  return d - normal_part(q_n, d)


def polar(q_n, q_bar):
  u, _, vt = jnp.linalg.svd(q_bar, full_matrices=False)
  return u @ vt


def qr_tangent(q_n, q_bar):
  return _positive_qr(q_n + _tangent(q_n, q_bar))


def qr_ambient(q_n, q_bar):
  return _positive_qr(q_bar)


def cayley_tangent(q_n, q_bar):
  r, s = q_n.shape
  xi = _tangent(q_n, q_bar)
  if r == s:
    omega = q_n.T @ xi
    omega = 0.5 * (omega - omega.T)
    eye = jnp.eye(s, dtype=q_n.dtype)
    return q_n @ jnp.linalg.solve(eye - 0.5 * omega, eye + 0.5 * omega)
  p_xi = xi - 0.5 * q_n @ (q_n.T @ xi)
  u = jnp.concatenate([p_xi, q_n], axis=1)
  v = jnp.concatenate([q_n, -p_xi], axis=1)
  small = jnp.eye(2 * s, dtype=q_n.dtype) - 0.5 * (v.T @ u)
  return q_n + u @ jnp.linalg.solve(small, v.T @ q_n)


def method_fn(name, tolerance, max_iterations):
  """``(q_n, q_bar) -> (Q, iterations, converged)`` for the method ``name``."""
  if name in PAPER_FORCE:
    f = getattr(sp, f"{name}_projection")
    return lambda q_n, q_bar: tuple(f(q_n, q_bar, tolerance, max_iterations))
  f = {"polar": polar, "qr_tangent": qr_tangent, "qr_ambient": qr_ambient, "cayley_tangent": cayley_tangent}[name]

  def direct(q_n, q_bar):
    q = f(q_n, q_bar)
    # Polish: quasi-Newton steps along the point itself (the polar iteration
    # Q <- Q (3 I - Q^T Q) / 2), which leave a polar factor where it is; the
    # factorizations alone stop at a few times the float32 floor.
    polished = sp.quasi_newton_projection(q, q, tolerance, 5)
    return polished.matrix, polished.iterations, polished.converged

  return direct


def paper_point64(q_n, q_bar, max_iterations=200):
  """The paper's point in float64 (numpy): square root start, then chord steps.

  None when the chord steps do not converge (no root near ``Lambda = 0``).
  """
  q_n = np.asarray(q_n, np.float64)
  q_bar = np.asarray(q_bar, np.float64)
  c = q_n.T @ q_bar
  eye = np.eye(c.shape[0])
  k_mat = eye + c.T @ c - q_bar.T @ q_bar
  k_mat = 0.5 * (k_mat + k_mat.T)
  a = 0.5 * (c - c.T)
  w, v = np.linalg.eigh(k_mat - a.T @ a)
  if w.min() <= 0:
    return None
  s = (v * np.sqrt(w)) @ v.T
  for _ in range(max_iterations):
    f = (s - a) @ (s + a) - k_mat
    if np.linalg.norm(f) < 1e-13:
      return q_bar - q_n @ (0.5 * (c + c.T) - s)
    s = s - 0.25 * (f + f.T)
  return None


def float32_floor(q64):
  """``||Q^T Q - I||_F`` in float32 of the float64 point rounded to float32."""
  return float(sp.defect(jnp.asarray(q64, jnp.float32)))


def project_layers_loop(f):
  """Every layer of a stack projected on its own: a Python loop inside ``jit``."""

  def run(qs_n, qs_bar):
    outs = [f(qs_n[i], qs_bar[i]) for i in range(qs_n.shape[0])]
    return tuple(jnp.stack(parts) for parts in zip(*outs))

  return run


def project_layers_vmap(f):
  """All layers of a stack projected together: one batched ``while_loop``."""
  return jax.vmap(f)
