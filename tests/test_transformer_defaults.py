"""What the defaults choose in a transformer as Flax and Equinox write one (issue 59's clients, ``tests/_clients.py``).

Embedding tables are free under every default rule (Flax's by their name,
``embedding``; Equinox's by their module, ``eqx.nn.Embedding``, whose table is
called ``weight`` like a Linear's). ``UnitNorm()`` and ``MaxNorm()`` without
``axis`` take each output unit's incoming weights in either layout: a column
of a Flax kernel ``(in, out)``, a row of an Equinox weight ``(out, in)``; a
matrix of no known layer is read as a Flax kernel and named in a warning.
``Orthogonal(blocks=(heads, 1))`` keeps each head's rows of an Equinox
attention projection ``(heads * head_dim, in)`` orthonormal, the heads not
orthogonal to each other: at temperature 0 the blocked leaf follows the
trajectory of its blocks given as separate leaves.
"""

import functools
import os
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import _clients
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax.constraints import from_tall_view, tall_view

eqx = pytest.importorskip("equinox")

DEFAULTS = {
  "c_cola_od": lambda: cola.c_cola_od(0.01, radius=0.05),
  "c_cola_ud": lambda: cola.c_cola_ud(0.01, friction=1.0, radius=0.05),
  "o_cola_od": lambda: cola.o_cola_od(0.01),
  "o_cola_ud": lambda: cola.o_cola_ud(0.01, friction=1.0),
  "hyperspherical_descent": lambda: cola.hyperspherical_descent(0.01),
  "manifold_muon": lambda: cola.manifold_muon(0.01),
}
QUICK = {"c_cola_od"}  # one rule for every entry: one quick case


def _defaults(quick):
  return [pytest.param(name, id=name, marks=() if name in quick else pytest.mark.slow) for name in DEFAULTS]


def _step(name, params, grads):
  """One jitted update of the default ``name`` (its warning naming the leaves it takes aside): new params, residuals."""
  tx = DEFAULTS[name]()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  return new, cola.constraint_residuals(new, state)


@functools.cache
def _equinox_gpt():
  """The Equinox client's arrays (built once: its eager initialisation is most of a quick test's time)."""
  return eqx.filter(_clients.equinox_gpt(depth=1), eqx.is_array)


def _tolerance(name):
  return 2e-5 if name == "manifold_muon" else 1e-5  # manifold Muon's retraction meets its own tolerance


@pytest.mark.parametrize("name", _defaults(QUICK))
def test_equinox_embedding_tables_are_free_under_every_default(name):
  """``wte``/``wpe`` tables (max ~3.9, norm ~98) stay as they are; every Linear weight is on the manifold."""
  params = _equinox_gpt()
  tables = lambda p: (p.wte.weight, p.wpe.weight)
  # A gradient on every leaf but the tables: a table the rule took would be projected by the update.
  grads = eqx.tree_at(tables, jax.tree.map(jnp.ones_like, params), [jnp.zeros_like(t) for t in tables(params)])
  new, residuals = _step(name, params, grads)
  for before, after, residual in zip(tables(params), tables(new), tables(residuals)):
    np.testing.assert_array_equal(after, before)
    assert residual is None
  block = residuals.blocks[0]
  linears = [block.attention.query_proj, block.attention.key_proj, block.attention.value_proj]
  linears += [block.attention.output_proj, block.up, block.down, residuals.lm_head]
  assert all(float(linear.weight) <= _tolerance(name) for linear in linears)
  assert block.norm1.weight is None and block.up.bias is None  # scales and biases free
  assert not np.allclose(new.lm_head.weight, params.lm_head.weight)


@pytest.mark.parametrize("name", _defaults(()))
def test_nnx_embedding_tables_are_free_under_every_default(name):
  from flax import nnx

  params = nnx.state(_clients.nnx_gpt(depth=1), nnx.Param).to_pure_dict()  # as nnx.Optimizer hands them over
  is_table = lambda path: "embedding" in jax.tree_util.keystr(path)
  grads = jax.tree_util.tree_map_with_path(
    lambda path, p: jnp.zeros_like(p) if is_table(path) else jnp.ones_like(p), params
  )
  new, residuals = _step(name, params, grads)
  for (path, before), after, residual in zip(
    jax.tree_util.tree_flatten_with_path(params)[0],
    jax.tree.leaves(new),
    jax.tree.leaves(residuals, is_leaf=lambda x: x is None),
  ):
    if is_table(path):
      np.testing.assert_array_equal(after, before)
      assert residual is None
    elif jax.tree_util.keystr(path) == "['output_layer']['kernel']":
      assert float(residual) <= _tolerance(name)


@pytest.mark.parametrize("name", _defaults(()))
def test_linen_embedding_tables_are_free_under_every_default(name):
  from flax import linen as nn

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      return nn.Dense(16, name="head")(nn.Dense(8, name="hidden")(nn.Embed(16, 8, name="wte")(tokens)))

  params = LM().init(jax.random.key(0), jnp.zeros((4,), jnp.int32))["params"]
  grads = jax.tree.map(jnp.ones_like, params)
  grads["wte"]["embedding"] = jnp.zeros_like(params["wte"]["embedding"])
  new, residuals = _step(name, params, grads)
  np.testing.assert_array_equal(new["wte"]["embedding"], params["wte"]["embedding"])
  assert residuals["wte"]["embedding"] is None
  assert max(float(residuals[layer]["kernel"]) for layer in ("hidden", "head")) <= _tolerance(name)


# --------------------------------------------------------------------------------------
# UnitNorm() and MaxNorm(): each output unit's incoming weights, in either layout


def test_per_unit_defaults_take_the_rows_of_an_equinox_weight_and_the_columns_of_a_flax_kernel():
  linear = eqx.filter(eqx.nn.Linear(5, 3, use_bias=False, key=jax.random.key(0)), eqx.is_array)  # (out, in)
  dense = {"Dense_0": {"kernel": 2.0 * linear.weight.T}}  # the same layer, (in, out)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # both layouts are known: nothing to say
    rows = cola.project_params(linear, cola.UnitNorm()).weight
    columns = cola.project_params(dense, cola.UnitNorm())["Dense_0"]["kernel"]
    bounded = cola.project_params(linear, cola.MaxNorm(0.1)).weight
  np.testing.assert_allclose(jnp.linalg.norm(rows, axis=1), 1.0, rtol=1e-6)  # one unit per output, a row
  np.testing.assert_allclose(jnp.linalg.norm(columns, axis=0), 1.0, rtol=1e-6)  # one unit per output, a column
  np.testing.assert_allclose(rows, columns.T, atol=1e-6)  # the same units
  np.testing.assert_allclose(jnp.linalg.norm(bounded, axis=1), 0.099, rtol=1e-5)  # each row to 0.99 of the bound
  assert not np.allclose(jnp.linalg.norm(rows, axis=0), 1.0)


@pytest.mark.extended  # quick: test_per_unit_defaults_take_..., a Flax kernel's columns
@pytest.mark.parametrize(
  ("default", "explicit"),
  [
    pytest.param(cola.UnitNorm(), cola.UnitNorm(axis=0), id="unit_norm"),
    pytest.param(cola.MaxNorm(0.5), cola.MaxNorm(0.5, axis=0), id="max_norm", marks=pytest.mark.slow),
  ],
)
def test_the_flax_default_is_the_column_reading_bit_for_bit(default, explicit):
  """A Flax kernel's default is ``axis=0`` as it was: the same program, the same bits, under a transform too."""
  w = jax.random.normal(jax.random.key(1), (6, 4))
  params = {"Dense_0": {"kernel": w}}
  grads = {"Dense_0": {"kernel": jnp.cos(w)}}
  runs = []
  for constraint in (default, explicit):
    tx = cola.cola_od(0.1, constraints=constraint)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    runs.append((cola.project_params(params, constraint), updates, cola.constraint_residuals(params, state)))
  jax.tree.map(np.testing.assert_array_equal, *runs)


@pytest.mark.slow
def test_an_equinox_conv_weight_has_one_unit_per_output_filter_and_jit_agrees():
  conv = eqx.filter(eqx.nn.Conv2d(2, 3, 3, use_bias=False, key=jax.random.key(2)), eqx.is_array)  # (out, in, kh, kw)
  tx = cola.cola_od(0.1, constraints=cola.UnitNorm(0.5))
  grads = jax.tree.map(jnp.cos, conv)
  state = tx.init(conv)
  eager, _ = tx.update(grads, state, conv)
  jitted, _ = jax.jit(tx.update)(grads, state, conv)
  np.testing.assert_allclose(eager.weight, jitted.weight, atol=1e-6)
  weight = optax.apply_updates(conv, eager).weight
  np.testing.assert_allclose(jnp.linalg.norm(weight.reshape(3, -1), axis=1), 0.5, rtol=1e-6)
  assert state.constraint_states.weight.axes == (1, 2, 3)


@pytest.mark.extended  # quick: the next test's warning; test_equinox.py warns for a bare (3, 5) weight
def test_a_matrix_of_no_known_layer_is_read_as_a_flax_kernel_and_named_once():
  w = jax.random.normal(jax.random.key(3), (3, 5))
  tx = cola.cola_od(0.1, constraints=cola.UnitNorm())
  with pytest.warns(UserWarning) as caught:
    state = tx.init({"w": w})
    _, state = tx.update({"w": jnp.cos(w)}, state, {"w": w})
    updates, state = jax.jit(tx.update)({"w": jnp.cos(w)}, state, {"w": w})
  (message,) = [str(m.message) for m in caught if "no layer whose layout is known" in str(m.message)]
  assert message.startswith("UnitNorm constraint on the leaf at ['w'], of shape (3, 5): a matrix in no layer")
  assert "One unit per row (an (out, in) weight, a token's embedding): UnitNorm(1.0, axis=-1)" in message
  assert "UnitNorm(1.0, axis=0) keeps this reading and silences this." in message
  np.testing.assert_allclose(jnp.linalg.norm(w + updates["w"], axis=0), 1.0, rtol=1e-6)  # the columns
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    cola.project_params({"w": w}, cola.UnitNorm(axis=0))


def test_matrices_of_no_known_layer_are_named_in_one_warning():
  params = {name: jnp.ones((3, 5)) for name in ("a", "b", "c", "d")}
  with pytest.warns(UserWarning) as caught:
    cola.cola_od(0.1, constraints=cola.MaxNorm(2.0)).init(params)
  (message,) = [str(m.message) for m in caught if "no layer whose layout is known" in str(m.message)]
  assert message.startswith("MaxNorm constraint on 4 leaves, ['a'], ['b'], ['c'] and 1 more, of shape (3, 5): ")
  assert caught[0].filename == __file__


def test_a_declared_flax_kernel_is_a_kernel_through_its_boxes():
  """A kernel boxed twice (``nn.with_partitioning``, ``cola.with_constraint``) has the path
  ``['kernel'].value.raw_value``: still a Flax kernel, read by columns without a word."""
  from flax import linen as nn

  init = cola.with_constraint(nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")), cola.MaxNorm(0.1))
  params = nn.Dense(3, kernel_init=init).init(jax.random.key(7), jnp.ones((1, 4)))["params"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = cola.cola_od(0.1, constraints=cola.constraints_from(params)).init(params)
  slack, _ = jax.tree.leaves(state.constraint_states["kernel"])  # the MaxNormState, inside the boxes
  assert slack.shape == (1, 3)  # one slack per column


# --------------------------------------------------------------------------------------
# Orthogonal(blocks=...): per-head Stiefel matrices on a 2-D attention weight

HEADS, HEAD_DIM, WIDTH = 4, 8, 32


def _per_head_defect(w):
  blocks = w.reshape(HEADS, HEAD_DIM, WIDTH)
  return float(jnp.max(jnp.abs(blocks @ blocks.transpose(0, 2, 1) - jnp.eye(HEAD_DIM))))


def _between_heads(w):
  """The largest entry of ``B_0 B_1^T``: zero if heads 0 and 1 were orthogonal to each other."""
  return float(jnp.max(jnp.abs(w[:HEAD_DIM] @ w[HEAD_DIM : 2 * HEAD_DIM].T)))


def test_blocks_make_each_head_orthonormal_and_not_the_heads_to_each_other():
  w = jax.random.normal(jax.random.key(4), (HEADS * HEAD_DIM, WIDTH))
  per_head = cola.project_params(w, cola.Orthogonal(blocks=(HEADS, 1)))
  assert _per_head_defect(per_head) < 1e-5
  assert _between_heads(per_head) > 0.1
  columns = cola.project_params(w.T, cola.Orthogonal(blocks=(1, HEADS)))  # Flax's (in, heads * head_dim)
  np.testing.assert_allclose(columns, per_head.T, atol=1e-5)


def test_the_blocks_are_a_batched_view_that_round_trips():
  w = jnp.arange(HEADS * HEAD_DIM * WIDTH, dtype=jnp.float32).reshape(HEADS * HEAD_DIM, WIDTH)
  stacked = jnp.stack([w, -w])  # a batch axis and blocks together: the batch index outermost

  @jax.jit
  def views(w, stacked):
    view = tall_view(w, blocks=(HEADS, 1))  # each head's (8, 32) rows, as their tall transpose
    grid = tall_view(w, blocks=(2, 4))  # a 2 x 4 grid of (16, 8) blocks, row-major
    per_layer = tall_view(stacked, row_axes=1, column_axes=2, blocks=(HEADS, 1))
    back = (
      from_tall_view(view, w, blocks=(HEADS, 1)),
      from_tall_view(grid, w, blocks=(2, 4)),
      from_tall_view(per_layer, stacked, row_axes=1, column_axes=2, blocks=(HEADS, 1)),
    )
    return view, grid, per_layer, back

  view, grid, per_layer, back = views(w, stacked)
  np.testing.assert_array_equal(view, w.reshape(HEADS, HEAD_DIM, WIDTH).transpose(0, 2, 1))
  np.testing.assert_array_equal(grid[5], w[16:, 8:16])
  np.testing.assert_array_equal(per_layer[HEADS:], -view)
  jax.tree.map(np.testing.assert_array_equal, back, (w, w, stacked))


def _loss(w, x, y):
  return 0.5 * jnp.sum((x @ w.T - y) ** 2)


def _train(tx, params, split, steps=5):
  """``steps`` jitted steps on the loss of the joined weight (each head's rows give their own outputs)."""
  keys = jax.random.split(jax.random.key(5), 2)
  x, y = jax.random.normal(keys[0], (16, WIDTH)), jax.random.normal(keys[1], (16, HEADS * HEAD_DIM))

  @jax.jit
  def run(params):
    def body(carry, _):
      p, s = carry
      updates, s = tx.update(jax.grad(lambda p: _loss(split(p), x, y))(p), s, p)
      return (optax.apply_updates(p, updates), s), None

    return jax.lax.scan(body, (params, tx.init(params)), None, length=steps)[0]

  return run(params)


@pytest.mark.extended  # quick: test_blocks_make_each_head_orthonormal_and_not_the_heads_to_each_other
@pytest.mark.parametrize(
  "make",
  [
    pytest.param(lambda c: cola.cola_ud(0.05, friction=1.0, constraints=c), id="cola_ud", marks=pytest.mark.slow),
    pytest.param(lambda c: cola.constrained(optax.adam(1e-2), constraints=c), id="constrained_adam"),
  ],
)
def test_a_blocked_leaf_trains_as_its_heads_given_as_separate_leaves(make):
  w = cola.project_params(
    jax.random.normal(jax.random.key(6), (HEADS * HEAD_DIM, WIDTH)), cola.Orthogonal(blocks=(HEADS, 1))
  )
  blocked, state = _train(make(cola.Orthogonal(blocks=(HEADS, 1))), {"w": w}, lambda p: p["w"])
  heads = {f"h{i}": w[i * HEAD_DIM : (i + 1) * HEAD_DIM] for i in range(HEADS)}
  separate, _ = _train(make(cola.Orthogonal()), heads, lambda p: jnp.concatenate([p[f"h{i}"] for i in range(HEADS)]))
  trained = blocked["w"]
  np.testing.assert_allclose(trained, jnp.concatenate([separate[f"h{i}"] for i in range(HEADS)]), atol=2e-6)
  assert _per_head_defect(trained) < 1e-5 and _between_heads(trained) > 0.1
  assert float(jnp.max(jnp.abs(trained - w))) > 1e-3  # it moved
  assert float(cola.constraint_residuals(blocked, state)["w"]) < 1e-5


@pytest.mark.parametrize(
  ("blocks", "error", "message"),
  [
    (
      4,
      TypeError,
      r"Orthogonal: blocks must be None or a pair of ints \(row blocks, column blocks\), such as \(heads, 1\), got 4",
    ),
    ((True, 1), TypeError, "got \\(True, 1\\)"),
    ((2.0, 1), TypeError, "got \\(2.0, 1\\)"),
    ((4,), ValueError, r"Orthogonal: blocks must be two positive ints \(row blocks, column blocks\).*got \(4,\)"),
    ((4, 1, 1), ValueError, "got \\(4, 1, 1\\)"),
    ((0, 1), ValueError, "two positive ints"),
  ],
)
def test_blocks_construction_errors(blocks, error, message):
  with pytest.raises(error, match=message):
    cola.Orthogonal(blocks=blocks)


@pytest.mark.parametrize(
  ("constraint", "shape", "message"),
  [
    (
      cola.Orthogonal(blocks=(3, 1)),
      (32, 16),
      r"Orthogonal constraint on the leaf at \['attention'\]\['w'\], of shape \(32, 16\): "
      r"blocks=\(3, 1\) splits the 32 rows of its \(32, 16\) matrix into 3 blocks, and 32 is not a multiple of 3\.",
    ),
    (
      cola.Orthogonal(row_axes=0, column_axes=(1, 2), blocks=[1, 3]),
      (32, 4, 4),
      r"of shape \(32, 4, 4\): blocks=\(1, 3\) splits the 16 columns of its \(32, 16\) matrix into 3 blocks",
    ),
  ],
  ids=["rows", "columns"],
)
def test_blocks_that_do_not_split_the_leaf_name_it(constraint, shape, message):
  with pytest.raises(ValueError, match=message):
    cola.cola_od(0.1, constraints=constraint).init({"attention": {"w": jnp.zeros(shape)}})
