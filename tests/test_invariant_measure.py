r"""Statistical tests of the invariant measures of the CoLA samplers.

With temperature ``tau > 0`` both ``cola_od`` and ``cola_ud`` sample (the
latter in its position marginal) the measure with density proportional to
``exp(-V / tau)`` with respect to the surface measure of the constraint
manifold, up to the step-size bias of the discretisation.

Design. Each test runs many independent chains at once with FIXED keys in
float32 inside one ``jax.jit`` + ``jax.lax.scan``:

* circle: the parameter is one vector of ``N`` weights; each weight is its own
  circle ``theta^2 + xi^2 = r^2`` and the dynamics acts entrywise, so its ``N``
  entries are ``N`` independent chains. Only the final state is used, so the
  ``N`` samples are exactly i.i.d. and the Kolmogorov-Smirnov test applies.
* orthogonal: ``jax.vmap`` over keys runs ``B`` independent chains of one small
  matrix. After burn-in each chain records ``M`` snapshots; a statistic's
  time average per chain is one of ``B`` independent numbers, so its standard
  error is their spread over ``sqrt(B)`` whatever the autocorrelation (the
  effective sample size, printed, follows from it).

Discretisation bias. With zero gradient the circle and Stiefel dynamics are
equivariant under rotations (the noise is isotropic and the projections and
the RATTLE step commute with ``Q -> U Q V``), so their invariant law is the
uniform one exactly, for every ``h``: only mixing matters there. With a
potential the bias is O(h): Euler-Maruyama (od) raises the effective
temperature by ~``h k / 2`` plus ~``2 tau h / r^2`` from the radial projection
(relative); OBA (ud), with positions read after A, lowers it by ~``gamma h / 2``
(for a harmonic well OBA gives ``Var q = tau (1 - 0.88 h)`` at ``gamma = 2``,
from the exact discrete Lyapunov equation). The step sizes below keep the bias
of the KS statistic at about a third of its sampling noise or less; the numbers
are in the comments of each configuration.

Each test also shows that it can fail: its statistic rejects a wrong answer
(the arctan projection's quadrant loss, a uniform law instead of the arcsine
law, the density without the surface-measure factor, a chain stopped too early,
signed permutation matrices with the right second moments).

``pytest`` runs the quick arcsine law with CoLA-ud and Haar moments for the
square case with CoLA-ud; ``pytest -m extended`` the quick Gibbs law with
CoLA-od; ``pytest -m slow`` the long ones and the other quick ones.
"""

import dataclasses
import math
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended, quick_or_slow
from scipy import integrate, stats

import cola_jax as cola

# A p-value above ACCEPT passes; a wrong answer must give a p-value below REJECT.
ACCEPT = 1e-3
REJECT = 1e-6
# Moment tests: every |z| must stay below Z_ACCEPT (a few dozen statistics per
# test: under the null the chance of one |z| > 4.5 is < 3e-4); a wrong answer
# must reach Z_REJECT.
Z_ACCEPT = 4.5
Z_REJECT = 10.0


def _transform(method, h, constraint, tau, gamma, key):
  if method == "od":
    return cola.cola_od(h, constraints=constraint, temperature=tau, key=key)
  return cola.cola_ud(h, friction=gamma, constraints=constraint, temperature=tau, key=key)


# --------------------------------------------------------------------------------------
# Circle constraints


@dataclasses.dataclass(frozen=True)
class _ArctanCircle(cola.Circle):
  """The paper's overdamped projection ``alpha = arctan(xi_bar / theta_bar)``.

  ``(theta, xi) = r (cos alpha, sin alpha)`` loses the quadrant: theta >= 0
  always (docs/errata.md, erratum 2). Used only to show that the tests reject it.
  """

  def project(self, anchor, step):
    theta, xi = anchor[0] + step[0], anchor[1] + step[1]
    alpha = jnp.arctan(xi / theta)
    return self.radius * jnp.cos(alpha), self.radius * jnp.sin(alpha)


def _circle_samples(method, cfg, *, grad_fn, seed, constraint=None, steps=None):
  """(theta, xi) of ``cfg['n']`` independent weights after ``steps`` steps from theta = 0."""
  r, tau = cfg["r"], cfg["tau"]
  constraint = cola.Circle(r) if constraint is None else constraint
  tx = _transform(method, cfg["h"], constraint, tau, cfg.get("gamma"), jax.random.key(seed))
  steps = cfg["steps"] if steps is None else steps

  def body(carry, _):
    params, state = carry
    updates, state = tx.update(grad_fn(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  @jax.jit
  def run(params):
    (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return params, state.constraint_states.slack

  theta, xi = run(jnp.zeros((cfg["n"],), jnp.float32))
  assert theta.dtype == jnp.float32
  theta, xi = np.asarray(theta, np.float64), np.asarray(xi, np.float64)
  np.testing.assert_allclose(theta**2 + xi**2, r**2, rtol=1e-5)
  return theta, xi


def _arcsine_cdf(x):
  return 0.5 + np.arcsin(np.clip(x, -1.0, 1.0)) / np.pi


def _uniform_cdf(x):
  return np.clip((x + 1.0) / 2.0, 0.0, 1.0)


def _circle_cdf(r, tau, potential, surface_measure=True, grid=200_001):
  """CDF of theta for the density ``exp(-V/tau) / sqrt(r^2 - theta^2)`` on (-r, r).

  Computed on a fine grid in the angle ``phi``, ``theta = r sin(phi)``: since
  ``d theta = sqrt(r^2 - theta^2) d phi`` the integrand in phi is the smooth
  ``exp(-V(r sin phi)/tau)`` (trapezoid rule, interpolated linearly in theta).
  ``surface_measure=False`` gives the WRONG density ``exp(-V/tau)`` on (-r, r)
  (Lebesgue measure in theta), used to check that the test can tell them apart.
  """
  phi = np.linspace(-np.pi / 2, np.pi / 2, grid)
  theta = r * np.sin(phi)
  weight = np.exp(-potential(theta) / tau)
  if not surface_measure:
    weight = weight * r * np.cos(phi)
  cdf = np.concatenate([[0.0], np.cumsum(0.5 * (weight[1:] + weight[:-1]) * np.diff(phi))])
  cdf /= cdf[-1]
  return lambda x: np.interp(x, theta, cdf)


def _ks(samples, cdf, label):
  result = stats.kstest(samples, cdf)
  print(f"  KS {label}: D = {result.statistic:.5f}, p = {result.pvalue:.3g}, n = {samples.size}")
  return result


# Circle, zero gradient. r = 0.5, tau = 0.25: the angle diffuses with
# D = tau / r^2 = 1 per unit time (od), its slowest Fourier mode relaxes as
# exp(-D t); starting from the single point theta = 0 (all chains), t = 10
# leaves exp(-10) = 5e-5 of it, far below the KS noise (~0.9 / sqrt(n)). The
# law is exactly the uniform angle for every h (rotation invariance), so h only
# sets the speed. ud: gamma = 1, |v| ~ sqrt(tau) = 0.5 = r, relaxation time ~2,
# t = 20.
CIRCLE_FREE = {
  "quick": dict(r=0.5, tau=0.25, gamma=1.0, n=20_000, od=dict(h=0.01, steps=1_000), ud=dict(h=0.05, steps=400)),
  "slow": dict(r=0.5, tau=0.25, gamma=1.0, n=1_000_000, od=dict(h=0.01, steps=2_000), ud=dict(h=0.05, steps=800)),
}


def _circle_cases(quick_method, extended=False):
  """(method, size) for both methods and sizes: only ``quick_method``'s quick version outside slow (with
  ``extended``, under extended)."""
  cases = [(method, size) for size in ("quick", "slow") for method in ("od", "ud")]
  ids = lambda method, size: f"{method}-{size}"
  if extended:
    return quick_or_extended(cases, (), ids=ids, extended={(quick_method, "quick")})
  return quick_or_slow(cases, {(quick_method, "quick")}, ids=ids)


def _config(table, size, method):
  cfg = {k: v for k, v in table[size].items() if k not in ("od", "ud")}
  cfg.update(table[size][method])
  if method == "ud":
    cfg["gamma"] = table[size]["gamma"]
  return cfg


@pytest.mark.parametrize("method, size", _circle_cases("ud"))
def test_circle_without_force_samples_the_arcsine_law(method, size):
  cfg = _config(CIRCLE_FREE, size, method)
  r = cfg["r"]
  theta, xi = _circle_samples(method, cfg, grad_fn=jnp.zeros_like, seed=11)
  print(f"\ncircle, zero gradient, {method} ({size}): {cfg}")
  # theta / r and xi / r are arcsine distributed; the angle (both quadrant
  # signs) is uniform on (-pi, pi].
  assert _ks(theta / r, _arcsine_cdf, "theta/r vs arcsine").pvalue > ACCEPT
  assert _ks(xi / r, _arcsine_cdf, "xi/r vs arcsine").pvalue > ACCEPT
  angle = np.arctan2(theta, xi) / np.pi
  assert _ks(angle, _uniform_cdf, "angle/pi vs uniform").pvalue > ACCEPT

  # The test has power: a uniform law for theta, and the quadrant-losing
  # arctan projection (it maps (theta, xi) to (|theta|, sign(theta) xi)), are
  # rejected on these same samples.
  assert _ks(theta / r, _uniform_cdf, "theta/r vs uniform (wrong)").pvalue < REJECT
  assert _ks(np.abs(theta) / r, _arcsine_cdf, "|theta|/r vs arcsine (wrong)").pvalue < REJECT
  if method == "od":
    # ... and so is the actual dynamics with the paper's arctan projection.
    wrong, _ = _circle_samples(method, cfg, grad_fn=jnp.zeros_like, seed=11, constraint=_ArctanCircle(r))
    assert wrong.min() >= 0
    assert _ks(wrong / r, _arcsine_cdf, "arctan projection vs arcsine (wrong)").pvalue < REJECT
  else:
    # ... and so is the ud chain stopped long before it mixes (t = 0.5).
    early, _ = _circle_samples(method, cfg, grad_fn=jnp.zeros_like, seed=11, steps=10)
    assert _ks(early / r, _arcsine_cdf, "ud at t = 0.5 vs arcsine (wrong)").pvalue < REJECT


# Circle with V = k/2 (theta - c)^2, r = 0.5, tau = 0.25, k = 4, c = 0.25
# (V/tau = 8 (theta - 0.25)^2: 4.5 at theta = -r, 0.5 at theta = r; the law
# differs from the arcsine one by a KS distance ~0.36). The theta marginal
# relaxes within t ~ 3 (measured); t = 10 (od) and 20 (ud).
# Step-size bias, measured with 2e5-4e5 chains (mean of theta, exact 0.24154,
# s.e. 0.0005; KS distance includes ~0.0014 of noise):
#   od  h = 0.01: mean -0.0030, KS 0.0046; h = 0.005: KS 0.0019; h = 0.0025: KS 0.0013;
#   ud  gamma = 2: h = 0.05: mean +0.0032, h = 0.025: +0.0013 (O(gamma h)), KS 0.0035.
# The bias is linear in h (gamma h for ud); the values below are extrapolated:
# quick (n = 2e4, KS noise ~0.006, critical value 0.0138 at p = 1e-3):
#   od h = 0.004 (KS bias ~0.0015), ud gamma = 1, h = 0.02 (KS bias ~0.001).
# slow (n = 4e5, KS noise ~0.0014, critical value 0.0031 at p = 1e-3):
#   od h = 0.001 (KS bias ~0.0004), ud gamma = 1, h = 0.005 (KS bias ~0.0003).
CIRCLE_FORCE = {
  "quick": dict(
    r=0.5, tau=0.25, gamma=1.0, n=20_000, k=4.0, c=0.25, od=dict(h=0.004, steps=2_500), ud=dict(h=0.02, steps=1_000)
  ),
  "slow": dict(
    r=0.5, tau=0.25, gamma=1.0, n=400_000, k=4.0, c=0.25, od=dict(h=0.001, steps=10_000), ud=dict(h=0.005, steps=4_000)
  ),
}


# Its quick version under extended; quick: the arcsine law above (the circle's chains without a force).
@pytest.mark.parametrize("method, size", _circle_cases("od", extended=True))
def test_circle_with_quadratic_potential_samples_its_gibbs_law(method, size):
  cfg = _config(CIRCLE_FORCE, size, method)
  r, tau, k, c = cfg["r"], cfg["tau"], cfg["k"], cfg["c"]

  def potential(theta):
    return 0.5 * k * (theta - c) ** 2

  theta, _ = _circle_samples(method, cfg, grad_fn=lambda p: k * (p - c), seed=23)
  print(f"\ncircle, V = k/2 (theta - c)^2, {method} ({size}): {cfg}")
  target = _circle_cdf(r, tau, potential)

  # The grid CDF agrees with direct quadrature of the density in theta.
  density = lambda t: math.exp(-potential(t) / tau) / math.sqrt(r * r - t * t)
  total = integrate.quad(density, -r, r, limit=200)[0]
  for x in (-0.3, 0.0, 0.2, 0.4):
    assert abs(integrate.quad(density, -r, x, limit=200)[0] / total - target(x)) < 1e-6

  exact_mean = integrate.quad(lambda t: t * density(t), -r, r, limit=200)[0] / total
  print(f"  mean theta {theta.mean():.5f} (exact {exact_mean:.5f}, s.e. {theta.std() / math.sqrt(theta.size):.5f})")
  assert _ks(theta, target, "theta vs exp(-V/tau)/sqrt(r^2-theta^2)").pvalue > ACCEPT

  # Power: the arcsine law (no force) and the density without the
  # surface-measure factor 1/sqrt(r^2 - theta^2) are rejected.
  assert _ks(theta / r, _arcsine_cdf, "theta/r vs arcsine (wrong)").pvalue < REJECT
  flat = _circle_cdf(r, tau, potential, surface_measure=False)
  assert _ks(theta, flat, "theta vs exp(-V/tau) dtheta (wrong)").pvalue < REJECT


# --------------------------------------------------------------------------------------
# Orthogonality constraints


def _stiefel_start(shape):
  """The leaf ``[I; 0]`` (tall) or its transpose (wide); I for a square one."""
  rows, cols = shape
  return jnp.eye(rows, cols, dtype=jnp.float32)


def _tall(w):
  """The ``(n, p)``, ``n >= p``, view with orthonormal columns (batched)."""
  return w if w.shape[-2] >= w.shape[-1] else jnp.swapaxes(w, -1, -2)


def _orthogonal_snapshots(method, cfg, shape, *, seed, grad_fn=None, burn_in=None):
  """Snapshots ``(B, M, n, p)`` (tall view) of B independent chains, float64.

  Each chain starts at ``_stiefel_start(shape)`` with its own key, runs
  ``burn_in`` steps, then records M snapshots ``every`` steps apart.
  """
  constraint = cola.Orthogonal()
  burn_in = cfg["burn_in"] if burn_in is None else burn_in
  grad_fn = jnp.zeros_like if grad_fn is None else grad_fn

  def chain(key):
    tx = _transform(method, cfg["h"], constraint, cfg["tau"], cfg.get("gamma"), key)

    def step(carry, _):
      params, state = carry
      updates, state = tx.update(grad_fn(params), state, params)
      return (optax.apply_updates(params, updates), state), None

    def advance(carry, steps):
      return jax.lax.scan(step, carry, None, length=steps)[0]

    def snapshot(carry, _):
      carry = advance(carry, cfg["every"])
      return carry, (carry[0], carry[1].constraint_states.converged)

    params = _stiefel_start(shape)
    carry = advance((params, tx.init(params)), burn_in)
    _, (snaps, converged) = jax.lax.scan(snapshot, carry, None, length=cfg["snapshots"])
    return snaps, converged

  keys = jax.random.split(jax.random.key(seed), cfg["chains"])
  snaps, converged = jax.jit(jax.vmap(chain))(keys)
  assert snaps.dtype == jnp.float32
  # The quasi-Newton projection met its tolerance (else the polar factor is
  # used and flagged) in nearly every step: it converges linearly, slowly for
  # the largest noise draws (docs/errata.md, erratum 5).
  failed = 1.0 - float(jnp.mean(converged))
  print(f"  projections not converged: {failed:.2g}")
  assert failed < 1e-3
  q = np.asarray(_tall(snaps), np.float64)
  gram = np.einsum("bmij,bmik->bmjk", q, q)
  np.testing.assert_allclose(gram, np.broadcast_to(np.eye(q.shape[-1]), gram.shape), atol=1e-5)
  return q


def _haar_statistics(q):
  """Per-snapshot statistics of ``q`` (..., n, p) and their Haar expectations.

  Each column of a Haar matrix is uniform on the sphere S^{n-1}, and so is each
  row of a Haar O(n) matrix, of which the Stiefel matrix is the first p
  columns. For a uniform unit vector x in R^n, E x_i^2 = 1/n,
  E x_i^4 = 3/(n(n+2)), E x_i^2 x_k^2 = 1/(n(n+2)) (i != k): from
  x = g/|g| with g standard normal, independent of |g|, E|g|^4 = n(n+2).
  For SO(3) (the dynamics keeps det = +1, so a 3x3 chain lives there), the
  rotation angle has density (1 - cos a)/pi on (0, pi) and trace 1 + 2 cos a:
  E tr = 0 and E tr^2 = 1. ``test_haar_moment_formulas`` checks all of them
  on exact Haar samples.
  """
  n, p = q.shape[-2:]
  out = {}
  for i in range(n):
    for j in range(p):
      out[f"Q[{i},{j}]"] = (q[..., i, j], 0.0)
      out[f"Q[{i},{j}]^2"] = (q[..., i, j] ** 2, 1 / n)
      out[f"Q[{i},{j}]^4"] = (q[..., i, j] ** 4, 3 / (n * (n + 2)))
    if p >= 2:
      out[f"Q[{i},0]^2 Q[{i},1]^2"] = (q[..., i, 0] ** 2 * q[..., i, 1] ** 2, 1 / (n * (n + 2)))
  if n == p == 3:
    trace = np.trace(q, axis1=-2, axis2=-1)
    out["tr"] = (trace, 0.0)
    out["tr^2"] = (trace**2, 1.0)
  return out


def _z_scores(statistics, label, verbose=True):
  """z = (mean - exact) / s.e. from B independent chains' time averages.

  ``statistics``: name -> (values of shape (B, M), exact). Each chain's time
  average is one independent sample, so s.e. = std over chains / sqrt(B),
  whatever the autocorrelation within a chain; the effective sample size is
  the variance of one snapshot over s.e.^2.
  """
  z, ess = {}, []
  for name, (values, exact) in statistics.items():
    per_chain = values.mean(axis=1)
    se = per_chain.std(ddof=1) / math.sqrt(per_chain.size)
    error = per_chain.mean() - exact
    if se > 0:
      z[name] = error / se
      ess.append(values.var() / se**2)
    else:  # a constant statistic: exact or certainly wrong
      z[name] = 0.0 if abs(error) < 1e-12 else math.inf
  worst = max(z, key=lambda k: abs(z[k]))
  if verbose:
    values, exact = statistics[worst]
    print(
      f"  {label}: {len(z)} statistics, max |z| = {abs(z[worst]):.2f} at {worst} "
      f"(mean {values.mean():.5f}, exact {exact:.5f}); "
      f"effective samples {min(ess):.0f} to {max(ess):.0f} "
      f"(B = {values.shape[0]} chains x M = {values.shape[1]} snapshots)"
    )
  return z


def test_haar_moment_formulas():
  """The expectations of ``_haar_statistics`` hold for exact Haar samples."""
  rng = np.random.default_rng(0)
  for n, p in ((4, 2), (3, 3)):
    # QR of a Gaussian matrix with the signs of R's diagonal made positive is
    # Haar on O(n); flipping one column of the det = -1 ones gives SO(n).
    q, r = np.linalg.qr(rng.standard_normal((400, 50, n, n)))
    q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
    if n == p:
      q[..., 0] *= np.sign(np.linalg.det(q))[..., None]
    z = _z_scores(_haar_statistics(q[..., :p]), f"exact Haar {n}x{p}")
    assert max(abs(v) for v in z.values()) < Z_ACCEPT


# Orthogonal constraints, zero gradient: tau = 1 (entries are O(1)). The law is
# Haar for every h (equivariance), so h only sets the speed; the projection
# converges within its 20 iterations at these steps (asserted).
# od: h = 0.01 (per-entry noise 0.14 per step; at h = 0.02 the quasi-Newton
# projection misses its 20-iteration bound in 0.4 % of the 3x3 steps, at 0.01
# in < 1e-5). Measured relaxation rates of E Q_11 (from 1): ~2.4 for 4x2, ~1
# for E tr on SO(3); burn-in t = 8 leaves < 3 e^{-8} = 1e-3, far below the
# s.e. (~0.015 for tr).
# ud: gamma = 1, h = 0.05; E Q_11 is ~0 by t = 3; burn-in t = 10.
# Snapshots every t = 0.3 (od) / 0.5 (ud); B chains x M snapshots.
ORTHO_FREE = {
  "quick": dict(
    tau=1.0,
    gamma=1.0,
    chains=400,
    snapshots=16,
    od=dict(h=0.01, burn_in=800, every=30),
    ud=dict(h=0.05, burn_in=200, every=10),
  ),
  "slow": dict(
    tau=1.0,
    gamma=1.0,
    chains=2_000,
    snapshots=40,
    od=dict(h=0.01, burn_in=1_000, every=30),
    ud=dict(h=0.05, burn_in=300, every=10),
  ),
}


def _signed_permutations(rng, count, n, p):
  """Random signed permutation matrices (first p columns): on the manifold,
  with the Haar first and second moments, but E Q_ij^4 = 1/n."""
  perms = np.argsort(rng.random((count, n)), axis=-1)
  q = np.eye(n)[perms] * rng.choice([-1.0, 1.0], size=(count, n, 1))
  return q[..., :p]


# The quick suite samples the square case with CoLA-ud (its noise projected with
# the force, its RATTLE step); CoLA-od's, and the tall and wide cases (each as
# long as the square one), run with the long versions, under -m slow.
ORTHO_SHAPES = {"tall4x2": (4, 2), "wide2x4": (2, 4), "square3x3": (3, 3)}
ORTHO_CASES = quick_or_slow(
  [(method, shape, size) for shape in ORTHO_SHAPES.values() for size in ("quick", "slow") for method in ("od", "ud")],
  {("ud", ORTHO_SHAPES["square3x3"], "quick")},
  ids=lambda method, shape, size: f"{method}-{next(k for k, v in ORTHO_SHAPES.items() if v == shape)}-{size}",
)


@pytest.mark.parametrize("method,shape,size", ORTHO_CASES)
def test_orthogonal_without_force_samples_haar_moments(method, shape, size):
  cfg = _config(ORTHO_FREE, size, method)
  print(f"\northogonal {shape}, zero gradient, {method} ({size}): {cfg}")
  seed = 31 + 100 * shape[0] + shape[1]  # tall and wide runs independent
  q = _orthogonal_snapshots(method, cfg, shape, seed=seed)
  if shape[0] == shape[1]:
    # A continuous path from I stays in SO(3).
    np.testing.assert_allclose(np.linalg.det(q), 1.0, atol=1e-5)
  z = _z_scores(_haar_statistics(q), "dynamics")
  assert max(abs(v) for v in z.values()) < Z_ACCEPT

  # Power: the chains stopped at t = 0.2 (od) / 0.5 (ud), still near the
  # start, are rejected...
  early_steps = 20 if method == "od" else 10
  early_cfg = dict(cfg, burn_in=0, every=early_steps, snapshots=1)
  early = _orthogonal_snapshots(method, early_cfg, shape, seed=seed)
  z = _z_scores(_haar_statistics(early), f"stopped after {early_steps} steps (wrong)")
  assert max(abs(v) for v in z.values()) > Z_REJECT
  # ... and so are signed permutation matrices, Haar in first and second
  # moments (E Q_ij = 0, E Q_ij^2 = 1/n), not in the fourth.
  n, p = q.shape[-2:]
  fake = _signed_permutations(np.random.default_rng(5), q.shape[0] * q.shape[1], n, p)
  z = _z_scores(_haar_statistics(fake.reshape(q.shape)), "signed permutations (wrong)")
  low = [v for name, v in z.items() if not name.endswith("^4") and "Q[" in name and " " not in name]
  fourth = [v for name, v in z.items() if name.endswith("^4")]
  assert max(abs(v) for v in low) < Z_ACCEPT
  assert min(abs(v) for v in fourth) > Z_REJECT
