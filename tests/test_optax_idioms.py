"""CoLA transforms inside common optax idioms.

Clipping before CoLA, schedules through ``inject_hyperparams``, gradient
accumulation with ``MultiSteps``, ``apply_if_finite``, ``partition`` with adam,
and what goes wrong when a transform follows CoLA in a chain.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola

# Layer 0 on circles, layer 1 orthonormal, layer 2 and the biases free: every
# kind of per-leaf state (slack, ProjectionInfo, momentum) appears.
MIXED = {"layer0": {"w": cola.Circle(0.3), "b": None}, "layer1": {"w": cola.Orthogonal(), "b": None}, "layer2": None}


def mixed_ud(key=jax.random.key(11), temperature=1e-4):
  return cola.cola_ud(0.3, friction=1.0, constraints=MIXED, temperature=temperature, key=key)


def run(tx, params, loss, steps, grad_map=lambda g: g):
  """``steps`` jitted steps of ``tx`` on ``grad_map(grad)``; (params, state)."""

  def step(carry, i):
    p, s = carry
    updates, s = tx.update(grad_map(jax.grad(loss)(p, i)), s, p)
    return (optax.apply_updates(p, updates), s), None

  return jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(steps))[0])((params, tx.init(params)))


def leaves_of(tree):
  """The leaves with typed PRNG keys as their raw data, for comparisons."""
  return [jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves_of(a), leaves_of(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves_of(a), leaves_of(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def max_residual(params, state):
  return max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(params, state)))


# Clipping before CoLA.


@pytest.mark.slow  # quick: test_constrained.py checks a clip before a transform is it on clipped gradients
def test_clip_by_global_norm_then_cola_is_cola_on_clipped_gradients(mlp_problem):
  params, loss = mlp_problem
  max_norm = 0.05
  norms = [float(optax.tree.norm(jax.grad(loss)(params, i))) for i in range(3)]
  assert min(norms) > 2 * max_norm  # the clip is active, not a no-op

  def clip_by_hand(grads):
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    factor = jnp.minimum(1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * factor, grads)

  chained, chain_state = run(optax.chain(optax.clip_by_global_norm(max_norm), mixed_ud()), params, loss, 30)
  reference, reference_state = run(mixed_ud(), params, loss, 30, grad_map=clip_by_hand)
  assert_trees_close(chained, reference, rtol=1e-5, atol=1e-6)
  assert_trees_close(chain_state[1], reference_state, rtol=1e-5, atol=1e-6)
  assert max_residual(chained, chain_state) <= 1e-5


# inject_hyperparams with schedules (constant hyperparameters and a temperature
# schedule alone are covered in test_transforms.py).


@pytest.mark.slow  # test_optax_contract.py's scheduled hyperparameters stay quick
def test_inject_hyperparams_with_learning_rate_and_temperature_schedules(mlp_problem):
  params, loss = mlp_problem
  steps, anneal = 12, 8
  learning_rate = optax.warmup_cosine_decay_schedule(0.05, 0.3, warmup_steps=3, decay_steps=steps, end_value=0.1)
  temperature = optax.linear_schedule(1e-3, 0.0, transition_steps=anneal)
  injected = optax.inject_hyperparams(cola.cola_ud)(
    learning_rate=learning_rate, friction=1.0, temperature=temperature, key=jax.random.key(3), constraints=MIXED
  )

  def step(carry, i):
    p, s = carry
    updates, s = injected.update(jax.grad(loss)(p, i), s, p)
    return (optax.apply_updates(p, updates), s), (s.hyperparams["learning_rate"], s.hyperparams["temperature"])

  (final, state), (rates, temperatures) = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(steps)))(
    (params, injected.init(params))
  )

  # The state records the value each step used: the schedules at 0, 1, ...
  np.testing.assert_allclose(rates, [learning_rate(i) for i in range(steps)], rtol=1e-6)
  np.testing.assert_allclose(temperatures, [temperature(i) for i in range(steps)], rtol=1e-6, atol=1e-12)
  assert float(state.hyperparams["temperature"]) <= 1e-9 and int(state.count) == steps
  # The same schedules given to the plain transform give the same run.
  plain, plain_state = run(
    cola.cola_ud(learning_rate, friction=1.0, temperature=temperature, key=jax.random.key(3), constraints=MIXED),
    params,
    loss,
    steps,
  )
  assert_trees_close(final, plain, rtol=1e-5, atol=1e-6)
  assert max_residual(final, state) <= 1e-5
  # Annealed to zero: the next step draws no noise, whatever the key.
  grads = jax.grad(loss)(final, steps)
  update = jax.jit(injected.update)
  other_key = state._replace(inner_state=state.inner_state._replace(key=jax.random.key(999)))
  assert_trees_equal(update(grads, state, final)[0], update(grads, other_key, final)[0])
  assert_trees_close(state.inner_state, plain_state, rtol=1e-5, atol=1e-6)


# Gradient accumulation.


@pytest.mark.slow  # test_optax_contract.py's MultiSteps mean-gradient test stays quick
def test_multisteps_accumulates_k_gradients_into_one_cola_step(mlp_problem):
  params, loss = mlp_problem
  k = 3
  tx = optax.MultiSteps(mixed_ud(), every_k_schedule=k)
  reference_tx = mixed_ud()
  update = jax.jit(tx.update)
  reference_update = jax.jit(reference_tx.update)
  grad = jax.jit(jax.grad(loss))

  state, reference_state = tx.init(params), reference_tx.init(params)
  p, reference = params, params
  batch = 0
  for _ in range(2):  # two accumulation cycles
    grads = []
    for micro in range(k):
      g = grad(p, batch)
      batch += 1
      grads.append(g)
      updates, state = update(g, state, p)
      new = optax.apply_updates(p, updates)
      if micro < k - 1:  # parameters and the inner state do not move between updates
        assert_trees_equal(new, p)
        assert int(state.inner_opt_state.count) == int(reference_state.count)
        assert_trees_equal(state.inner_opt_state.key, reference_state.key)
      p = new
    mean = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
    updates, reference_state = reference_update(mean, reference_state, reference)
    reference = optax.apply_updates(reference, updates)
    assert_trees_close(p, reference, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.inner_opt_state, reference_state, rtol=1e-5, atol=1e-6)
  assert int(state.gradient_step) == 2 and int(state.inner_opt_state.count) == 2
  assert max_residual(p, state) <= 1e-5


# apply_if_finite.


@pytest.mark.extended  # quick: test_optax_contract.py's apply_if_finite test, on cola_ud
def test_apply_if_finite_skips_a_nan_step_and_loses_nothing(mlp_problem):
  params, loss = mlp_problem
  tx = optax.apply_if_finite(mixed_ud(), max_consecutive_errors=2)

  @jax.jit
  def step(p, s, i, poison):
    grads = jax.grad(loss)(p, i)
    grads["layer1"]["w"] = grads["layer1"]["w"].at[0, 0].set(jnp.where(poison, jnp.nan, grads["layer1"]["w"][0, 0]))
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  def train(nan_at):
    p, s = params, tx.init(params)
    batch = 0
    for t in range(8):
      poison = t in nan_at
      before = (p, s)
      p, s = step(p, s, batch, poison)
      if poison:
        assert_trees_equal(p, before[0])  # parameters, bit for bit
        assert_trees_equal(s.inner_state, before[1].inner_state)  # slack, momenta, key, count
        assert int(s.notfinite_count) == int(before[1].notfinite_count) + 1
        assert not bool(s.last_finite)
      else:
        batch += 1
    return p, s

  clean, clean_state = train(nan_at=())
  skipped, skipped_state = train(nan_at=(3, 5, 6))
  assert int(skipped_state.total_notfinite) == 3 and int(skipped_state.notfinite_count) == 0
  # 8 attempts with 3 skipped are the first 5 steps of the clean run, bit for bit.
  p, s = params, tx.init(params)
  for i in range(5):
    p, s = step(p, s, i, False)
  assert_trees_equal(skipped, p)
  assert_trees_equal(skipped_state.inner_state, s.inner_state)
  assert max_residual(skipped, skipped_state) <= 1e-5
  assert int(clean_state.inner_state.count) == 8


# partition: CoLA on some leaves, adam on others.


def cola_and_adam_labels(params):
  return {"layer0": "cola", "layer1": "cola", "layer2": "adam"}


@pytest.mark.slow  # test_free.py runs cola_od and cola_ud inside optax.partition against free= (quick)
def test_partition_cola_with_adam_matches_separate_optimizers(mlp_problem):
  params, loss = mlp_problem
  # A callable spec: the partition hands the CoLA group the parameters with
  # optax.MaskedNode() at layer2, the reference below a dict without layer2.
  cola_tx = cola.cola_ud(
    0.3, friction=1.0, constraints=lambda p: {name: MIXED[name] for name in p}, temperature=1e-4, key=jax.random.key(5)
  )
  adam = optax.adam(1e-2)
  tx = optax.partition({"cola": cola_tx, "adam": adam}, cola_and_adam_labels)
  partitioned, state = run(tx, params, loss, 30)

  # The reference: the two optimizers on their own sub-trees, sharing the loss.
  def split(tree):
    return {"layer0": tree["layer0"], "layer1": tree["layer1"]}, {"layer2": tree["layer2"]}

  def step(carry, i):
    (cp, ap), (cs, as_) = carry
    cg, ag = split(jax.grad(loss)({**cp, **ap}, i))
    cu, cs = cola_tx.update(cg, cs, cp)
    au, as_ = adam.update(ag, as_, ap)
    return ((optax.apply_updates(cp, cu), optax.apply_updates(ap, au)), (cs, as_)), None

  cp, ap = split(params)
  ((cp, ap), (cs, _)), _ = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(30)))(
    ((cp, ap), (cola_tx.init(cp), adam.init(ap)))
  )
  assert_trees_close(partitioned["layer2"], ap["layer2"], rtol=1e-5, atol=1e-6)  # adam leaves = pure adam
  assert_trees_close({"layer0": partitioned["layer0"], "layer1": partitioned["layer1"]}, cp, rtol=1e-5, atol=1e-6)
  assert max_residual(cp, cs) <= 1e-5

  # The CoLA leaves are on their manifolds; residuals of a partition's CoLA state
  # are taken with the masked parameters (optax.MaskedNode where adam rules).
  masked = {"layer0": partitioned["layer0"], "layer1": partitioned["layer1"], "layer2": optax.MaskedNode()}
  residuals = cola.constraint_residuals(masked, state.inner_states["cola"])
  assert float(residuals["layer0"]["w"]) <= 1e-5 and float(residuals["layer1"]["w"]) <= 1e-5
  assert residuals["layer0"]["b"] is None
  assert float(jnp.max(jnp.abs(partitioned["layer0"]["w"]))) <= np.float32(0.3)


def test_constraint_residuals_of_a_partition_with_the_full_parameters(mlp_problem):
  params, loss = mlp_problem
  tx = optax.partition(
    {"cola": cola.c_cola_ud(0.3, friction=1.0, radius=0.3), "adam": optax.adam(1e-2)}, cola_and_adam_labels
  )
  new, state = run(tx, params, loss, 3)
  residuals = cola.constraint_residuals(new, state)
  assert residuals["layer2"]["w"] is None
  assert float(residuals["layer0"]["w"]) <= 1e-5


def test_partition_groups_need_different_keys_for_independent_noise():
  params = {"a": jnp.zeros((40, 50)), "b": jnp.zeros((40, 50))}
  zeros = jax.tree.map(jnp.zeros_like, params)

  @jax.jit  # one program for both pairs of keys
  def noise(key_a, key_b):
    tx = optax.partition(
      {"a": cola.cola_od(0.1, temperature=1.0, key=key_a), "b": cola.cola_od(0.1, temperature=1.0, key=key_b)},
      {"a": "a", "b": "b"},
    )
    updates, _ = tx.update(zeros, tx.init(params), params)
    return updates["a"].ravel(), updates["b"].ravel()

  # Each group splits its own key: the same key gives the same draws to
  # corresponding leaves of the two groups.
  a, b = noise(jax.random.key(0), jax.random.key(0))
  np.testing.assert_array_equal(a, b)
  a, b = (np.asarray(v) for v in noise(jax.random.key(0), jax.random.key(1)))
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.1  # n = 2000: > 4 standard errors
  np.testing.assert_allclose([a.std(), b.std()], np.sqrt(2 * 0.1), rtol=0.1)


# A transform after CoLA leaves the manifold (documented: CoLA goes last).


def test_a_transform_after_cola_moves_parameters_off_the_manifold(mlp_problem):
  params, loss = mlp_problem
  params = cola.project_params(params, MIXED)
  last, last_state = run(mixed_ud(), params, loss, 10)
  assert max_residual(last, last_state) <= 1e-5
  after, after_state = run(optax.chain(mixed_ud(), optax.scale(0.5)), params, loss, 10)
  residuals = cola.constraint_residuals(after, after_state)
  # Half of each update: the circle weights no longer match their slack (a
  # first-order error), and the orthonormal kernel, cut short on its curved
  # path, is off by a second-order error that is still far above rounding.
  assert float(residuals["layer0"]["w"]) > 1e-2, residuals
  assert float(residuals["layer1"]["w"]) > 5e-5, residuals
