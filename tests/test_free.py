"""``free=``: the unconstrained leaves of every CoLA method on an optax optimizer of the user's choice.

Given ``free``, the free leaves move exactly as ``optax.partition`` routing
them to ``free`` moves them (same numbers, same state), and the constrained
leaves exactly as without ``free`` (with noise too: the same keys). Without
``free``, nothing changes (the rest of the suite).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended

import cola_jax as cola

CONSTRAINTS = {"layer0": {"w": cola.Circle(0.5), "b": None}, "layer1": {"w": cola.Orthogonal(), "b": None}}
LABELS = {"layer0": {"w": "cola", "b": "free"}, "layer1": {"w": "cola", "b": "free"}}
HIDDEN = {"layer0": {"w": True, "b": False}, "layer1": {"w": True, "b": False}}  # the presets' mask

METHODS = {  # each method with its constraints on the two weights, the biases free
  "cola_od": lambda **kw: cola.cola_od(0.05, constraints=CONSTRAINTS, **kw),
  "cola_ud": lambda **kw: cola.cola_ud(0.3, friction=1.0, constraints=CONSTRAINTS, **kw),
  "c_cola_od": lambda **kw: cola.c_cola_od(0.05, radius=0.5, mask=HIDDEN, **kw),
  "c_cola_ud": lambda **kw: cola.c_cola_ud(0.01, momentum=0.9, radius=0.5, mask=HIDDEN, **kw),
  "o_cola_od": lambda **kw: cola.o_cola_od(0.05, mask=HIDDEN, **kw),
  "o_cola_ud": lambda **kw: cola.o_cola_ud(0.3, friction=1.0, mask=HIDDEN, splitting="BAOAB", **kw),
}


@pytest.fixture
def problem():
  """(params, loss): a tall 5x8 and a square 8x8 layer with biases, the kernels on their manifolds."""
  k = jax.random.split(jax.random.key(0), 4)
  params = {
    "layer0": {"w": jax.random.uniform(k[0], (5, 8), minval=-0.4, maxval=0.4), "b": jnp.full(8, 0.1)},
    "layer1": {"w": jnp.linalg.qr(jax.random.normal(k[1], (8, 8)))[0], "b": jnp.zeros(8)},
  }
  x, y = jax.random.normal(k[2], (16, 5)), jax.random.normal(k[3], (16, 8))

  def loss(p):
    h = jnp.tanh(x @ p["layer0"]["w"] + p["layer0"]["b"])
    return jnp.mean((h @ p["layer1"]["w"] + p["layer1"]["b"] - y) ** 2)

  return params, loss


def _free():
  """AdamW (its weight decay reads params) then reduce_on_plateau (it reads the extra argument value=)."""
  return optax.chain(optax.adamw(1e-2, weight_decay=0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))


def _run(tx, params, loss, steps=4, jit=True):
  def step(carry, _):
    p, s = carry
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = tx.update(grads, s, p, value=value)
    return (optax.apply_updates(p, updates), s), None

  if jit:
    return jax.jit(lambda params: jax.lax.scan(step, (params, tx.init(params)), None, length=steps)[0])(params)
  carry = (params, tx.init(params))
  for _ in range(steps):  # call by call, as a user without jit
    carry, _ = step(carry, None)
  return carry


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _weights(params):
  return {name: layer["w"] for name, layer in params.items()}


def _biases(params):
  return {name: layer["b"] for name, layer in params.items()}


@pytest.mark.parametrize(
  "name, temperature",
  quick_or_extended(
    [(name, t) for name in sorted(METHODS) for t in (0.0, 1e-3)],
    {("cola_od", 0.0)},  # the presets build on cola_od and cola_ud: the rest under slow
    extended={("cola_ud", 1e-3)},
  ),
)
def test_free_leaves_move_exactly_as_optax_partition_moves_them(name, temperature, problem):
  """Bit for bit: the free leaves and ``free``'s state; at temperature 0 the constrained leaves too.

  With noise the constrained leaves take the keys they take without ``free``
  (one per leaf of the whole tree; see the next test), not those of a CoLA
  method that sees only its own leaves in ``optax.partition``: the weights
  then differ, and so do the next gradients of the biases. One step from the
  same point compares the free leaves there.
  """
  params, loss = problem
  noise, steps = {"temperature": temperature, "key": jax.random.key(7)}, 4 if temperature == 0 else 1
  ours, state = _run(METHODS[name](free=_free(), **noise), params, loss, steps)
  partition = optax.partition({"cola": METHODS[name](**noise), "free": _free()}, LABELS)
  reference, reference_state = _run(partition, params, loss, steps)
  _assert_equal(_biases(ours), _biases(reference))
  _assert_equal(state.free_state, reference_state.inner_states["free"].inner_state)
  if temperature == 0:
    _assert_equal(ours, reference)
  residuals = cola.constraint_residuals(ours, state)
  assert _biases(residuals) == {"layer0": None, "layer1": None}
  assert max(float(r) for r in jax.tree.leaves(_weights(residuals))) < 1e-5


@pytest.mark.extended  # quick: test_free_leaves_move_exactly_as_optax_partition_moves_them compares the weights too
@pytest.mark.parametrize(
  "name, temperature",
  quick_or_extended(
    [(n, t) for n in ("cola_od", "cola_ud") for t in (0.0, 1e-3)], {("cola_ud", 1e-3)}, extended={("cola_od", 0.0)}
  ),
)
def test_constrained_leaves_are_the_same_with_and_without_free(name, temperature, problem):
  """The weights, their constraint states, momenta and the key: identical bits, noise drawn from a fixed key.

  The weights' gradients do not depend on the biases here (each bias has a
  loss of its own), so that the biases, which move otherwise with ``free``,
  do not change the weights' gradients.
  """
  params, loss = problem
  start = _biases(params)
  separate = lambda p: (
    loss(jax.tree.map(lambda w, b: {"w": w, "b": b}, _weights(p), start))
    + sum(jnp.sum(jnp.sin(b)) for b in jax.tree.leaves(_biases(p)))
  )
  noise = {"temperature": temperature, "key": jax.random.key(7)}
  with_free, state = _run(METHODS[name](free=optax.adam(1e-2), **noise), params, separate)
  without, plain_state = _run(METHODS[name](**noise), params, separate)
  assert not np.array_equal(with_free["layer0"]["b"], without["layer0"]["b"])
  _assert_equal(_weights(with_free), _weights(without))
  _assert_equal((state.count, state.key, state.constraint_states), plain_state[:3])
  if name == "cola_ud":
    _assert_equal(_weights(state.momentum), _weights(plain_state.momentum))
    assert _biases(state.momentum) == {"layer0": optax.MaskedNode(), "layer1": optax.MaskedNode()}


def test_free_leaves_draw_no_noise(problem):
  """``free=optax.sgd(h)`` at a temperature above 0 is the noiseless SGD step on the free leaves."""
  params, loss = problem
  tx = cola.cola_od(0.05, constraints=CONSTRAINTS, temperature=1.0, key=jax.random.key(0), free=optax.sgd(0.05))
  grads = jax.grad(loss)(params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  _assert_equal(_biases(updates), jax.tree.map(lambda g: -0.05 * g, _biases(grads)))


@pytest.mark.slow  # eager equals jit for every method is test_eager_equals_jit's (quick); free is optax's
def test_free_is_the_same_eager_and_under_jit(problem):
  params, loss = problem
  tx = METHODS["c_cola_ud"](free=_free(), temperature=1e-3, key=jax.random.key(7))
  compiled, state = _run(tx, params, loss, steps=2)
  eager, eager_state = _run(tx, params, loss, steps=2, jit=False)
  for a, b in ((compiled, eager), (state.free_state, eager_state.free_state)):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("bad", [optax.adam, "adam", optax.adam(1e-3).update])
def test_free_that_is_not_a_gradient_transformation_is_a_type_error_at_construction(name, bad):
  with pytest.raises(TypeError, match=rf"^{name}: free must be an optax.GradientTransformation"):
    METHODS[name](free=bad)


def test_map_params_reaches_free_state_and_the_momenta(problem):
  """The parameter-shaped fields: cola_ud's momenta at the constrained leaves, ``free``'s moments at the free ones."""
  params, _ = problem
  tx = cola.cola_ud(0.3, friction=1.0, constraints=CONSTRAINTS, free=optax.adam(1e-2))
  state = tx.init(params)
  _assert_equal(optax.tree.map_params(tx, lambda v: v, state), state)
  specs = jax.tree_util.tree_map_with_path(lambda path, _: jax.tree_util.keystr(path), params)
  mapped = optax.tree.map_params(
    tx,
    lambda p, s: None if isinstance(p, optax.MaskedNode) else s,
    state,
    specs,
    is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    transform_non_params=lambda _: None,
  )
  constrained_only = {layer: {"w": f"['{layer}']['w']", "b": None} for layer in params}
  free_only = {layer: {"w": None, "b": f"['{layer}']['b']"} for layer in params}
  assert mapped.momentum == constrained_only
  (adam, _) = mapped.free_state
  assert (adam.mu, adam.nu) == (free_only, free_only)
  assert (mapped.count, mapped.key, mapped.constraint_states) == (None, None, None)


@pytest.mark.extended  # quick: inject_hyperparams in test_transforms.py and test_optax_contract.py
def test_inject_hyperparams_around_the_method_and_inside_free(problem):
  """A method wrapped in inject_hyperparams takes ``free`` as it is; ``free``'s own injected rate can be set."""
  params, loss = problem
  injected = optax.inject_hyperparams(cola.cola_ud)(0.3, friction=1.0, constraints=CONSTRAINTS, free=optax.adam(1e-2))
  a, _ = _run(injected, params, loss)
  b, _ = _run(METHODS["cola_ud"](free=optax.adam(1e-2)), params, loss)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)

  tx = METHODS["cola_od"](free=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
  state = optax.tree.set(tx.init(params), learning_rate=jnp.asarray(0.5))
  grads = jax.grad(loss)(params)
  updates, _ = tx.update(grads, state, params)
  np.testing.assert_allclose(updates["layer1"]["b"], -0.5 * grads["layer1"]["b"], rtol=1e-6)
