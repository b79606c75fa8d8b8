"""``cola.constrained``: any optax transformation on the constraint manifolds.

Equivalence with o-CoLA-od for ``optax.sgd``, the constraints of the catalog
under adaptive optimizers pulling against them, free leaves as ``inner``
leaves them, the known optimum of a Stiefel problem, and the optax, Flax and
orbax idioms.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _constraints import CASES

import cola_jax as cola


def run(tx, params, loss, steps, grad_map=lambda g: g, state=None):
  """``steps`` jitted steps of ``tx`` on ``grad_map`` of the gradients of ``loss``; (params, state)."""

  def step(carry, _):
    p, s = carry
    updates, s = tx.update(grad_map(jax.grad(loss)(p)), s, p)
    return (optax.apply_updates(p, updates), s), None

  start = tx.init(params) if state is None else state
  return jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps)[0])((params, start))


def max_residual(params, state):
  return max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(params, state)))


def stiefel_top_k(n=48, k=6, seed=0):
  """(start, loss, optimum) of max tr(W^T A W) over orthonormal n x k W: the sum of A's k largest eigenvalues."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, n))
  a = jnp.asarray((x + x.T) / 2, jnp.float32)
  start = jnp.asarray(np.linalg.qr(rng.standard_normal((n, k)))[0], jnp.float32)
  optimum = float(np.sort(np.linalg.eigvalsh(np.asarray(a, np.float64)))[-k:].sum())
  return start, lambda w: -jnp.trace(w.T @ a @ w), optimum


def test_sgd_is_o_cola_od():
  w0, loss, _ = stiefel_top_k(12, 4)
  params = {"w": w0, "b": jnp.ones(3)}
  full_loss = lambda p: loss(p["w"]) + jnp.sum(p["b"] ** 2)
  spec = {"w": cola.Orthogonal(), "b": None}
  ours, _ = run(cola.constrained(optax.sgd(0.02), constraints=spec, retraction="projection"), params, full_loss, 20)
  reference, _ = run(cola.cola_od(0.02, constraints=spec), params, full_loss, 20)
  # The same point up to the projection's tolerance (the steps differ by a normal part the multiplier absorbs).
  np.testing.assert_allclose(ours["w"], reference["w"], atol=2e-6)
  np.testing.assert_array_equal(ours["b"], reference["b"])
  # The polar retraction is another retraction: it agrees with the projection to second order in the step.
  grads = jax.grad(full_loss)(params)

  @jax.jit
  def gap(h):
    polar = cola.constrained(optax.sgd(h), constraints=spec)
    projection = cola.cola_od(h, constraints=spec)
    a = polar.update(grads, polar.init(params), params)[0]["w"]
    b = projection.update(grads, projection.init(params), params)[0]["w"]
    return jnp.max(jnp.abs(a - b))

  assert float(gap(0.02)) > 8 * float(gap(0.005)) > 0


def test_riemannian_adam_reaches_the_known_optimum_where_the_naive_chain_stalls():
  w0, loss, optimum = stiefel_top_k()
  gap = lambda w: (optimum + float(loss(w))) / optimum
  tx = cola.constrained(optax.adam(3e-2), constraints=cola.Orthogonal())
  params, state = run(tx, w0, loss, 200)
  assert gap(params) < 1e-4
  assert max_residual(params, state) <= 1e-6
  # Euclidean gradients into Adam, then the projection: the normal part never vanishes (issue 23: 77 %).
  naive, _ = run(optax.chain(optax.scale_by_adam(), cola.cola_od(3e-2, constraints=cola.Orthogonal())), w0, loss, 200)
  assert gap(naive) > 1e-2


# One leaf per constraint of the registry (each accepts a (6, 4) leaf), and a free one.
CATALOG = {name: c for name, c, _ in CASES} | {"free": None}


@pytest.mark.extended  # quick: the next test steps the catalog under constrained; adam holds Orthogonal above
@pytest.mark.parametrize(
  "inner",
  [
    optax.adam(0.05),
    pytest.param(optax.adamw(0.05, weight_decay=0.1), marks=pytest.mark.slow),
    pytest.param(optax.lion(0.01), marks=pytest.mark.slow),
    pytest.param(optax.rmsprop(0.05), marks=pytest.mark.slow),
    pytest.param(optax.sgd(0.05, momentum=0.9), marks=pytest.mark.slow),
  ],
  ids=["adam", "adamw", "lion", "rmsprop", "sgd_momentum"],
)
def test_every_catalog_constraint_holds_against_the_pull(inner):
  keys = jax.random.split(jax.random.key(0), len(CATALOG))
  params = {name: 0.1 * jax.random.normal(k, (6, 4)) for name, k in zip(CATALOG, keys)}
  params = cola.project_params(params, CATALOG)
  target = jax.tree.map(lambda p: 2.0 + 0 * p, params)  # outside every bound, and far from orthonormal
  loss = lambda p: sum(jnp.sum((x - t) ** 2) for x, t in zip(jax.tree.leaves(p), jax.tree.leaves(target)))
  tx = cola.constrained(inner, constraints=CATALOG)
  end, state = run(tx, params, loss, 300)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(end))
  assert max_residual(end, state) <= 1e-6
  for name in CATALOG:  # each leaf moved towards the target
    assert float(jnp.sum((end[name] - 2) ** 2)) < float(jnp.sum((params[name] - 2) ** 2)) - 1e-2, name


def test_a_start_off_the_manifold_steps_from_where_project_params_puts_it():
  """The first update from an off-manifold start is the step from ``project_params``' point with the same gradient.

  Both runs compute one SGD step from the same point, once re-established from the off-manifold parameters and once
  from the projected ones, which differ by the rounding of one projection (a few ulp of values of size 1); a step of
  0.1 along a gradient of size 1 and the retractions are Lipschitz with constants of order 1 there, so 64 ulp bound
  the difference.
  """
  keys = jax.random.split(jax.random.key(1), 2 * len(CATALOG))
  off = {name: 1.5 * jax.random.normal(k, (6, 4)) for name, k in zip(CATALOG, keys)}
  grads = {name: jax.random.normal(k, (6, 4)) for name, k in zip(CATALOG, keys[len(CATALOG) :])}
  projected = cola.project_params(off, CATALOG)
  assert all(float(jnp.max(jnp.abs(off[name] - projected[name]))) > 0.1 for name in CATALOG if CATALOG[name])
  tx = cola.constrained(optax.sgd(0.1), constraints=CATALOG)
  step = jax.jit(lambda p: optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0]))
  from_off, from_projected = step(off), step(projected)
  for name in CATALOG:
    np.testing.assert_allclose(from_off[name], from_projected[name], rtol=0, atol=64 * np.finfo(np.float32).eps)


def test_free_leaves_follow_inner_exactly_and_weight_decay_leaves_orthogonal_leaves_alone():
  w0, stiefel_loss, _ = stiefel_top_k(10, 3)
  params = {"w": w0, "free": jnp.linspace(-1.0, 1.0, 5, dtype=jnp.bfloat16)}
  loss = lambda p: stiefel_loss(p["w"]) + jnp.sum(jnp.sin(p["free"].astype(jnp.float32)))
  spec = {"w": cola.Orthogonal(), "free": None}
  ours, _ = run(cola.constrained(optax.adamw(0.01, weight_decay=0.5), constraints=spec), params, loss, 10)
  plain, _ = run(optax.adamw(0.01, weight_decay=0.5), params, loss, 10)
  assert ours["free"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(ours["free"], plain["free"])
  # W is normal to the Stiefel manifold at W: the Riemannian gradient of |W|^2 / 2 is zero.
  no_decay, _ = run(cola.constrained(optax.adamw(0.01, weight_decay=0.0), constraints=spec), params, loss, 10)
  np.testing.assert_allclose(ours["w"], no_decay["w"], atol=1e-6)


def test_large_adam_steps_stay_finite_and_on_the_manifold():
  w0, loss, optimum = stiefel_top_k(64, 16, seed=1)
  tx = cola.constrained(optax.adam(0.3), constraints=cola.Orthogonal())
  params, state = w0, tx.init(w0)
  step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(jax.grad(loss)(p), s, p)))
  for _ in range(20):
    params, state = step(params, state)
    assert bool(jnp.all(jnp.isfinite(params)))
    assert max_residual(params, state) <= 1e-6
  assert (optimum + float(loss(params))) / optimum < 0.1  # and it still optimises


@pytest.mark.slow  # two compilations of a three-constraint model; jit alone is in every other test
def test_vmap_over_seeds_is_the_loop():
  spec = {"w": cola.Orthogonal(), "s": cola.MaxNorm(1.0), "b": None}
  a = jax.random.normal(jax.random.key(5), (8, 8))
  loss = lambda p: jnp.sum(jnp.sin(a @ p["w"])) + jnp.sum(p["s"] ** 3) + jnp.sum(p["b"] ** 2)
  tx = cola.constrained(optax.adam(0.05), constraints=spec)

  @jax.jit
  def train(key):
    kw, ks, kb = jax.random.split(key, 3)
    p = {"w": jax.random.normal(kw, (8, 3)), "s": jax.random.normal(ks, (4, 2)), "b": jax.random.normal(kb, (3,))}
    return run(tx, cola.project_params(p, spec), loss, 10)[0]

  keys = jax.random.split(jax.random.key(1), 2)
  batched = jax.vmap(train)(keys)
  for i, key in enumerate(keys):
    for name, leaf in train(key).items():
      np.testing.assert_allclose(batched[name][i], leaf, rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_inside_and_a_chain_around():
  w0, loss, _ = stiefel_top_k(10, 3)
  schedule = optax.linear_schedule(0.05, 0.0, 10)
  injected_adam = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
  injected = cola.constrained(injected_adam, constraints=cola.Orthogonal())
  direct = cola.constrained(optax.adam(schedule), constraints=cola.Orthogonal())
  a, state = run(injected, w0, loss, 12)
  b, _ = run(direct, w0, loss, 12)
  np.testing.assert_allclose(a, b, atol=1e-5)  # the injected rate is an array: Adam rounds otherwise
  assert float(state.inner_state.hyperparams["learning_rate"]) == 0.0
  # Clipping before it is the same transform on clipped gradients.
  clipped = optax.chain(optax.clip(0.5), cola.constrained(optax.adam(0.05), constraints=cola.Orthogonal()))
  c, chain_state = run(clipped, w0, loss, 10)
  by_hand, _ = run(
    cola.constrained(optax.adam(0.05), constraints=cola.Orthogonal()), w0, loss, 10, lambda g: jnp.clip(g, -0.5, 0.5)
  )
  np.testing.assert_allclose(c, by_hand, atol=2e-6)
  assert max_residual(c, chain_state) <= 1e-6


def test_errors_name_the_problem():
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    cola.constrained(lambda g: g, constraints=None)  # pyright: ignore[reportArgumentType]
  with pytest.raises(ValueError, match="retraction must be one of"):
    cola.constrained(optax.adam(1e-3), constraints=None, retraction="qr")
  tx = cola.constrained(optax.adam(1e-3), constraints=cola.Orthogonal())
  w = jnp.eye(4, 2)
  with pytest.raises(ValueError, match=r"constrained: update\(\) needs the current parameters"):
    tx.update(w, tx.init(w))
  with pytest.raises(ValueError, match=r"Orthogonal constraint on the leaf at \['b'\]"):
    tx.init({"b": jnp.zeros(3)})
  with pytest.raises(TypeError, match="must be the ConstrainedState"):
    tx.update(w, optax.adam(1e-3).init(w), w)


@pytest.mark.slow  # the state is a NamedTuple of the inner state and cola's: test_checkpoint.py covers both kinds
def test_orbax_round_trip_resumes_the_same_run(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  spec = {"w": cola.Orthogonal(), "c": cola.Circle(0.5), "b": None}
  a = jax.random.normal(jax.random.key(2), (6, 6))
  loss = lambda p: jnp.sum(jnp.cos(a @ p["w"])) + jnp.sum((p["c"] - 1) ** 2) + jnp.sum(p["b"] ** 2)
  params = cola.project_params({"w": jnp.eye(6, 3), "c": jnp.zeros(4), "b": jnp.ones(2)}, spec)
  tx = cola.constrained(optax.adam(0.05), constraints=spec)
  half, half_state = run(tx, params, loss, 5)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": half, "state": half_state})
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "ckpt", {"params": params, "state": tx.init(params)})
  assert isinstance(restored["state"], cola.ConstrainedState)

  resumed = run(tx, restored["params"], loss, 5, state=restored["state"])[0]
  uninterrupted = run(tx, half, loss, 5, state=half_state)[0]
  for name in spec:
    np.testing.assert_array_equal(resumed[name], uninterrupted[name])  # the same program from the same values


@pytest.mark.slow  # test_flax.py trains cola's methods through both (quick): constrained is a transform as they are
def test_flax_train_state_and_nnx_optimizer_train_as_the_plain_loop():
  pytest.importorskip("flax")
  from flax import linen as nn
  from flax import nnx
  from flax.training import train_state

  x = jax.random.normal(jax.random.key(3), (16, 4))
  y = jnp.sin(x[:, :2])
  rules = cola.path_constraints([(r"kernel$", cola.Orthogonal())])
  tx = cola.constrained(optax.adamw(0.02, weight_decay=1e-2), constraints=rules)

  linen = nn.Dense(4)
  params = cola.project_params(linen.init(jax.random.key(0), x)["params"], rules)
  state = train_state.TrainState.create(apply_fn=linen.apply, params=params, tx=tx)
  linen_loss = lambda p: jnp.mean((linen.apply({"params": p}, x)[:, :2] - y) ** 2)
  linen_step = jax.jit(lambda state: state.apply_gradients(grads=jax.grad(linen_loss)(state.params)))
  for _ in range(4):
    state = linen_step(state)
  reference, _ = run(tx, params, linen_loss, 4)
  np.testing.assert_allclose(state.params["kernel"], reference["kernel"], atol=1e-6)
  assert max_residual(state.params, state.opt_state) <= 1e-6

  # nnx, with the constraint declared on the layer and read back by constraints_from.
  declared = cola.with_constraint(nnx.initializers.lecun_normal(), cola.Orthogonal())
  model = nnx.Linear(4, 4, kernel_init=declared, rngs=nnx.Rngs(0))
  start = nnx.as_pure(nnx.state(model, nnx.Param))
  tx = cola.constrained(optax.adamw(0.02, weight_decay=1e-2), constraints=cola.constraints_from(nnx.state(model)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, nnx.grad(lambda m: jnp.mean((m(x)[:, :2] - y) ** 2))(model))

  for _ in range(4):
    step(model, optimizer)
  nnx_loss = lambda p: jnp.mean(((x @ p["kernel"] + p["bias"])[:, :2] - y) ** 2)
  reference, _ = run(tx, start, nnx_loss, 4)
  trained = nnx.as_pure(nnx.state(model, nnx.Param))
  np.testing.assert_allclose(trained["kernel"], reference["kernel"], atol=1e-6)
  np.testing.assert_allclose(trained["bias"], reference["bias"], atol=1e-6)
  np.testing.assert_allclose(trained["kernel"].T @ trained["kernel"], jnp.eye(4), atol=1e-6)
  assert not np.allclose(trained["kernel"], start["kernel"])  # it trained


class _ZeroSumState(NamedTuple):
  def residual(self, param):
    return jnp.abs(jnp.sum(param))


@dataclasses.dataclass(frozen=True)
class _ZeroSum(cola.Constraint):
  """``sum(w) = 0``, a hyperplane, written against the ``Constraint`` interface alone."""

  def init(self, param):
    return _ZeroSumState()

  def point(self, param, aux):
    return param - jnp.mean(param)

  def unpack(self, point, param):
    return point, _ZeroSumState()

  def ambient_gradient(self, point, grad):
    return grad

  def ambient_normal(self, key, point):
    return jax.random.normal(key, point.shape, point.dtype)

  def project(self, anchor, step):
    return anchor + step - jnp.mean(step)

  def cotangent(self, point, vector):
    return vector - jnp.mean(vector)

  def a_step(self, point, momentum, h):
    return point + h * momentum, momentum


# Quick: the projection (test_sgd_is_o_cola_od compares the polar retraction with it).
@pytest.mark.parametrize("retraction", [pytest.param("polar", marks=pytest.mark.extended), "projection"])
def test_a_constraint_written_outside_the_library_works_with_constrained(retraction):
  """constrained reaches a new constraint only through the interface: nothing in it names a constraint."""
  target = jnp.arange(6.0).reshape(2, 3)
  loss = lambda p: jnp.sum((p["w"] - target) ** 2) + jnp.sum(p["b"] ** 2)
  params = {"w": jnp.zeros((2, 3)), "b": jnp.ones(3)}
  tx = cola.constrained(optax.adam(0.1), constraints={"w": _ZeroSum(), "b": None}, retraction=retraction)
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
  for _ in range(300):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params["w"], target - jnp.mean(target), atol=1e-3)  # the plane's nearest point
  assert float(cola.constraint_residuals(params, state)["w"]) < 1e-5
