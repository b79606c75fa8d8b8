r"""Constraints on parts of a leaf: ``Orthogonal(row_axes, column_axes)`` and ``Implicit(axis)``.

A leaf with batch axes under ``Orthogonal`` is a stack of independent
matrices, and ``Implicit(axis=...)`` a collection of independent units; each
part is the whole-leaf geometry of a smaller leaf. So at temperature 0 a
batched leaf follows the same trajectory as its parts given as separate
leaves (the per-part solvers stop on their own tolerance, as the separate
leaves do), and a per-unit ``Implicit`` follows the dense whole-leaf
``Implicit`` whose functions stack the units' components (its Jacobian is
block diagonal, so Newton's step is the units' steps; only the stopping rule
is global there, which moves the point by less than the tolerance).

With noise, each matrix of a batched leaf draws its own: after one step from
identical matrices without force, the displacements of neighbouring matrices
are uncorrelated, and the mean squared displacement is ``2 tau h`` times the
dimension of the Stiefel manifold ``V(r, s)``, ``r s - s (s + 1) / 2``, up to
the step's ``O((tau h)^2)`` normal part.
"""

import os
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax.constraints.orthogonal import from_tall_view, tall_view


def _force(w):
  """An elementwise force, so that a part's gradient depends on that part alone."""
  return 0.5 * jnp.cos(3.0 * w) + 0.3 * w


def _run(tx, params, steps, force=_force):
  def body(carry, _):
    p, s = carry
    updates, s = tx.update(jax.tree.map(force, p), s, p)
    return (optax.apply_updates(p, updates), s), None

  return jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, length=steps)[0])(params)


def _make(method, h, constraints, **noise):
  if method == "od":
    return cola.cola_od(h, constraints=constraints, **noise)
  return cola.cola_ud(h, friction=1.0, constraints=constraints, **noise)


# --------------------------------------------------------------------------------------
# Orthogonal(row_axes, column_axes)


def test_orthogonal_axes_construction_errors():
  with pytest.raises(ValueError, match="give both row_axes and column_axes"):
    cola.Orthogonal(row_axes=2)
  with pytest.raises(ValueError, match="give both row_axes and column_axes"):
    cola.Orthogonal(column_axes=(3,))
  with pytest.raises(TypeError, match="row_axes must be None, an int or a tuple of ints"):
    cola.Orthogonal(row_axes=True, column_axes=3)
  with pytest.raises(TypeError, match="column_axes must be None, an int or a tuple of ints"):
    cola.Orthogonal(row_axes=2, column_axes="out")
  with pytest.raises(ValueError, match="row_axes must name at least one axis"):
    cola.Orthogonal(row_axes=(), column_axes=3)
  with pytest.raises(ValueError, match=r"column_axes \(1, 1\) repeats an axis"):
    cola.Orthogonal(row_axes=0, column_axes=(1, 1))
  with pytest.raises(ValueError, match="share an axis"):
    cola.Orthogonal(row_axes=(0, 2), column_axes=(2, 3))
  # Lists become tuples: the constraint stays hashable and equal to its tuple form.
  c = cola.Orthogonal(row_axes=[2], column_axes=3)
  assert c == cola.Orthogonal(row_axes=(2,), column_axes=(3,)) and hash(c)


@pytest.mark.parametrize(
  "constraint, message",
  [
    (cola.Orthogonal(row_axes=2, column_axes=4), r"column_axes=\(4,\) is out of range .* rank 4"),
    (cola.Orthogonal(row_axes=-5, column_axes=3), r"row_axes=\(-5,\) is out of range"),
    (cola.Orthogonal(row_axes=2, column_axes=-2), r"axis 2 is named twice"),
  ],
)
def test_orthogonal_axes_validation_names_the_leaf(constraint, message):
  params = {"conv": {"kernel": jnp.ones((3, 3, 2, 4)), "bias": jnp.zeros(4)}}
  tx = cola.cola_od(0.1, constraints={"conv": {"kernel": constraint, "bias": None}})
  with pytest.raises(ValueError, match=r"\['conv'\]\['kernel'\].*" + message):
    tx.init(params)


@pytest.mark.parametrize(
  "shape, rows, columns, stack",
  [
    ((2, 3, 5, 4), (2,), (3,), (6, 5, 4)),  # tall
    pytest.param((2, 3, 5, 4), (3,), (2,), (6, 5, 4), marks=pytest.mark.extended),  # the transpose: the same ones
    pytest.param((3, 5, 2), 0, 1, (2, 5, 3), marks=pytest.mark.extended),  # wide, batch axis last: stored transposed
    ((4, 2, 4), -1, 0, (2, 4, 4)),  # square, batch axis in the middle
    pytest.param((2, 3, 4), (0, 2), 1, (8, 3), marks=pytest.mark.extended),  # no batch axis, rows from two axes
  ],
)
def test_batched_view_round_trips(shape, rows, columns, stack):
  w = jax.random.normal(jax.random.key(0), shape)
  q = tall_view(w, rows, columns)
  assert q.shape == stack
  np.testing.assert_array_equal(from_tall_view(q, w, rows, columns), w)


def _matrices(w, rows, columns):
  """The leaf's matrices, each with its row axes first, as separate arrays (numpy indexing)."""
  w = np.asarray(w)
  rows, columns = np.atleast_1d(rows) % w.ndim, np.atleast_1d(columns) % w.ndim
  batch = [a for a in range(w.ndim) if a not in rows and a not in columns]
  moved = np.transpose(w, batch + list(rows) + list(columns))
  r, c = np.prod([w.shape[a] for a in rows]), np.prod([w.shape[a] for a in columns])
  return list(moved.reshape(-1, r, c))


# A conv kernel as (kh kw) tall matrices, a wide leaf batched along its last axis
# and square matrices whose rows are the last axis and columns the first.
BATCHED = {"conv": ((2, 2, 5, 3), 2, 3), "wide": ((3, 5, 2), 0, 1), "square": ((4, 2, 4), -1, 0)}


@pytest.mark.parametrize(
  "method, projection",
  [
    pytest.param("od", "quasi_newton", marks=pytest.mark.slow),  # quick: one batched run, ud for the momenta
    pytest.param("ud", "square_root", marks=pytest.mark.extended),  # quick: test_batched_noise_is_drawn_per_matrix
    pytest.param("ud", "newton", marks=pytest.mark.slow),
    pytest.param("ud", "quasi_newton", marks=pytest.mark.slow),
    pytest.param("od", "newton", marks=pytest.mark.slow),
    pytest.param("od", "square_root", marks=pytest.mark.slow),
  ],
)
def test_batched_trajectory_equals_separate_leaves(method, projection):
  keys = jax.random.split(jax.random.key(1), len(BATCHED))
  params = {
    name: 0.5 * jax.random.normal(k, shape)  # not orthonormal: the first update projects
    for k, (name, (shape, _, _)) in zip(keys, BATCHED.items())
  }
  batched = {
    name: cola.Orthogonal(projection=projection, row_axes=rows, column_axes=columns)
    for name, (_, rows, columns) in BATCHED.items()
  }
  separate_params = {
    f"{name}{i}": jnp.asarray(m)
    for name, (_, rows, columns) in BATCHED.items()
    for i, m in enumerate(_matrices(params[name], rows, columns))
  }
  h = 0.05 if method == "od" else 0.2
  got, state = _run(_make(method, h, batched), params, 15)
  expected, separate_state = _run(_make(method, h, cola.Orthogonal(projection=projection)), separate_params, 15)

  residuals = cola.constraint_residuals(got, state)
  for name, (_, rows, columns) in BATCHED.items():
    parts = _matrices(got[name], rows, columns)
    infos = [separate_state.constraint_states[f"{name}{i}"] for i in range(len(parts))]
    moved = max(
      float(np.max(np.abs(expected[f"{name}{i}"] - separate_params[f"{name}{i}"]))) for i in range(len(parts))
    )
    error = max(float(np.max(np.abs(part - expected[f"{name}{i}"]))) for i, part in enumerate(parts))
    print(f"\n{name} {method} {projection}: moved {moved:.2f}, max |batched - separate| = {error:.1e}")
    assert moved > 0.1 and error <= 1e-6
    info = state.constraint_states[name]
    assert int(info.iterations) == max(int(i.iterations) for i in infos) >= 1
    assert bool(info.converged) and all(bool(i.converged) for i in infos)
    assert float(residuals[name]) <= 1e-6
    if method == "ud":  # stored shaped like the leaf, each matrix's momentum in place
      momenta = _matrices(state.momentum[name], rows, columns)
      for i, p in enumerate(momenta):
        np.testing.assert_allclose(p, separate_state.momentum[f"{name}{i}"], atol=1e-5)


@pytest.mark.parametrize("method", [pytest.param("od", marks=pytest.mark.extended), "ud"])  # quick: ud, its momenta
def test_batched_noise_is_drawn_per_matrix(method):
  """One noisy step from 512 copies of one orthonormal (4, 3) matrix, no force."""
  batch, tau, h = 512, 1e-4, 0.1
  q = cola.Orthogonal().nearest(jax.random.normal(jax.random.key(2), (4, 3)))
  w = jnp.broadcast_to(q, (batch, 4, 3))
  constraint = cola.Orthogonal(row_axes=1, column_axes=2)
  tx = _make(method, h, constraint, temperature=tau, key=jax.random.key(3))
  state = tx.init(w)
  zero = jnp.zeros_like(w)
  for _ in range(1 if method == "od" else 40):  # ud: the momentum at equilibrium (to e^-8)
    updates, state = jax.jit(tx.update)(zero, state, w)
    w_new = optax.apply_updates(w, updates)
    if method == "ud":
      w = w_new
  gram = np.einsum("bij,bik->bjk", np.asarray(w_new, np.float64), np.asarray(w_new, np.float64))
  assert np.max(np.abs(gram - np.eye(3))) <= 1e-5  # every matrix on its own manifold
  assert float(cola.constraint_residuals(w_new, state)) <= 1e-5
  d = np.asarray(updates, np.float64).reshape(batch, -1)
  # Neighbouring matrices: uncorrelated displacements (n = 511 * 12, sd about 0.013).
  correlation = np.corrcoef(d[:-1].ravel(), d[1:].ravel())[0, 1]
  dimension = 4 * 3 - 3 * 4 / 2
  # od: E|D|^2 = 2 tau h dim; ud: |h p|^2 with E|p|^2 = tau dim at equilibrium.
  expected = (2 * tau * h if method == "od" else tau * h * h) * dimension
  ratio = np.mean(np.sum(d * d, axis=1)) / expected
  print(f"\n{method}: correlation of neighbours {correlation:.3f}, E|D|^2 / expected {ratio:.3f}")
  assert abs(correlation) < 0.06
  assert abs(ratio - 1) < 0.12  # chi^2 with 6 dof over 512 matrices: sd 0.026 (od)


def test_batched_project_params_and_residuals():
  w = jax.random.normal(jax.random.key(4), (3, 3, 4, 2))
  constraint = cola.Orthogonal(row_axes=2, column_axes=3)
  projected = cola.project_params({"k": w, "b": jnp.ones(2)}, {"k": constraint, "b": None})
  polar = jax.jit(jax.vmap(cola.Orthogonal().nearest))(jnp.stack(_matrices(w, 2, 3)))
  np.testing.assert_allclose(np.stack(_matrices(projected["k"], 2, 3)), polar, atol=2e-6)
  state = cola.cola_od(0.1, constraints={"k": constraint, "b": None}).init(projected)
  residuals = cola.constraint_residuals(projected, state)
  assert residuals["b"] is None and float(residuals["k"]) <= 1e-6
  # The residual uses the leaf's view: the default one (a (36, 2) matrix) is far off.
  default = cola.cola_od(0.1, constraints=cola.Orthogonal()).init(projected["k"])
  assert float(cola.constraint_residuals(projected["k"], default)) > 1.0
  one_off = projected["k"].at[1, 2].multiply(1.5)  # one matrix moved off its manifold
  assert float(cola.constraint_residuals({"k": one_off, "b": jnp.ones(2)}, state)["k"]) > 1.0


# --------------------------------------------------------------------------------------
# Implicit(axis)


def _unit_norm_and_zero_sum(u):
  return jnp.stack([jnp.sum(u), jnp.sum(u * u) - 1])


def _columns_norm_and_zero_sum(w):
  """The same components for every column of a (rows, cols) leaf, stacked: one dense g."""
  return jnp.concatenate([jnp.sum(w, axis=0), jnp.sum(w * w, axis=0) - 1])


def _unit_ball(u):
  return jnp.sum(u * u) - 0.25  # |u| <= 0.5, with the sphere's slack xi (not xi / r)


def _columns_ball(w):
  return jnp.sum(w * w, axis=0) - 0.25


def _fibres_norm(u):
  return jnp.sum(u * u) - 1  # u: one (d0, d2) unit of a (d0, d1, d2) leaf


def _fibres_norm_dense(w):
  return jnp.sum(w * w, axis=(0, 2)) - 1


def test_implicit_axis_construction_errors():
  with pytest.raises(TypeError, match="axis must be None, an int or a tuple of ints"):
    cola.Implicit(equality=jnp.sum, axis=True)
  with pytest.raises(TypeError, match="axis must be None, an int or a tuple of ints"):
    cola.Implicit(equality=jnp.sum, axis=0.5)
  with pytest.raises(ValueError, match="axis must name at least one axis"):
    cola.Implicit(equality=jnp.sum, axis=())
  with pytest.raises(ValueError, match=r"axis \(0, 0\) repeats an axis"):
    cola.Implicit(equality=jnp.sum, axis=(0, 0))
  assert cola.Implicit(equality=jnp.sum, axis=[0]) == cola.Implicit(equality=jnp.sum, axis=0)


@pytest.mark.parametrize(
  "constraint, message",
  [
    (cola.Implicit(equality=jnp.sum, axis=2), r"axis=\(2,\) is out of range .* rank 2"),
    (cola.Implicit(equality=jnp.sum, axis=(0, -2)), r"axis 0 is named twice"),
    (
      cola.Implicit(equality=lambda u: u @ jnp.ones(4), axis=0),
      r"per unit of shape \(3,\) \(axis=\(0,\)\): equality\(x\) fails",
    ),
    (
      cola.Implicit(equality=lambda u: jnp.concatenate([u, u]), axis=0),
      r"per unit of shape \(3,\).*6 constraint components for 3 coordinates",
    ),
  ],
)
def test_implicit_axis_validation_names_the_leaf(constraint, message):
  params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}}
  for tx in (
    cola.cola_od(0.1, constraints={"dense": {"kernel": constraint, "bias": None}}),
    cola.cola_ud(0.1, friction=1.0, constraints={"dense": {"kernel": constraint, "bias": None}}),
  ):
    with pytest.raises(ValueError, match=r"\['dense'\]\['kernel'\].*" + message):
      tx.init(params)


PER_UNIT = {
  "pair": cola.Implicit(equality=_unit_norm_and_zero_sum, axis=0),
  "ball": cola.Implicit(inequality=_unit_ball, axis=0),
  "fibres": cola.Implicit(equality=_fibres_norm, axis=(0, -1)),
}
DENSE = {
  "pair": cola.Implicit(equality=_columns_norm_and_zero_sum),
  "ball": cola.Implicit(inequality=_columns_ball),
  "fibres": cola.Implicit(equality=_fibres_norm_dense),
}
UNIT_START = {
  "pair": jax.random.normal(jax.random.key(5), (4, 3)),  # off the manifold
  "ball": 0.4 * jax.random.uniform(jax.random.key(6), (4, 3), minval=-0.5, maxval=0.5),
  "fibres": 0.5 * jax.random.normal(jax.random.key(7), (2, 3, 2)),
}


@pytest.mark.parametrize(
  "method, h, temperature",
  [
    pytest.param("od", 0.05, 0.0, marks=pytest.mark.slow),
    pytest.param("od", 0.05, 1e-3, marks=pytest.mark.slow),
    pytest.param("ud", 0.2, 0.0, marks=pytest.mark.slow),
    pytest.param("ud", 0.2, 1e-3, marks=pytest.mark.extended),  # quick: test_per_unit_ball_agrees_with_max_norm
  ],
)
def test_per_unit_trajectory_equals_dense(method, h, temperature):
  """The same ambient layout (the leaf's entries, then the slacks): the same noise draws too."""
  noise = {"temperature": temperature, "key": jax.random.key(2)} if temperature else {}
  got, state = _run(_make(method, h, PER_UNIT, **noise), UNIT_START, 25)
  expected, dense_state = _run(_make(method, h, DENSE, **noise), UNIT_START, 25)
  residuals = cola.constraint_residuals(got, state)
  for name in PER_UNIT:
    moved = float(jnp.max(jnp.abs(expected[name] - UNIT_START[name])))
    error = float(jnp.max(jnp.abs(got[name] - expected[name])))
    print(f"\n{name} {method}: moved {moved:.2f}, max |per unit - dense| = {error:.1e}")
    assert moved > 0.05 and error <= 1e-5
    assert bool(state.constraint_states[name].converged)
    assert float(residuals[name]) <= 1e-6
    # One slack per unit (the other axes' shape), none without inequalities.
    assert state.constraint_states[name].slack.shape == {"ball": (3,)}.get(name, (3, 0))
    np.testing.assert_allclose(
      np.ravel(state.constraint_states[name].slack), np.ravel(dense_state.constraint_states[name].slack), atol=1e-5
    )
    if method == "ud":
      p = state.momentum[name]
      assert p.shape == (UNIT_START[name].size + 3 * (name == "ball"),)
      np.testing.assert_allclose(p, dense_state.momentum[name], atol=1e-5)


@pytest.mark.parametrize(
  "method, h, steps, atol", [("od", 0.01, 200, 5e-6), pytest.param("ud", 0.02, 100, 1e-4, marks=pytest.mark.extended)]
)
def test_per_unit_ball_agrees_with_max_norm(method, h, steps, atol):
  """MaxNorm(0.5) and the per-unit slack form of the same ball (as in test_implicit.py).

  The potential's minimum lies inside the ball: pressed on its boundary, where
  the slacks vanish, SHAKE's projection and the radial one part at O(h) per step.
  """
  start = jnp.linspace(-0.4, 0.35, 12).reshape(3, 4)
  implicit = cola.Implicit(inequality=_unit_ball, axis=0)
  force = lambda w: 3.0 * (w - 0.2) + jnp.sin(5.0 * w)
  p_closed, _ = _run(_make(method, h, cola.MaxNorm(0.5)), start, steps, force)
  p_implicit, state = _run(_make(method, h, implicit), start, steps, force)
  error = float(jnp.max(jnp.abs(p_implicit - p_closed)))
  print(f"\n{method}: moved {float(jnp.max(jnp.abs(p_closed - start))):.2f}, max |implicit - sphere| = {error:.1e}")
  assert float(jnp.max(jnp.abs(p_closed - start))) > 0.05 and error <= atol
  assert state.constraint_states.slack.shape == (4,)
  assert bool(state.constraint_states.converged)


@pytest.mark.extended  # quick: test_per_unit_ball_agrees_with_max_norm (per-unit projections onto a ball)
def test_per_unit_norm_projects_radially():
  """Newton along each iterate's normal ``2 q`` scales each unit: the nearest point is radial."""
  w = jax.random.normal(jax.random.key(8), (5, 6, 2))
  unit_norm = cola.Implicit(equality=lambda u: jnp.sum(u * u) - 1, axis=1)
  np.testing.assert_allclose(
    cola.project_params(w, unit_norm), w / jnp.linalg.norm(w, axis=1, keepdims=True), atol=1e-6
  )


def test_a_failing_unit_is_rejected_alone():
  """A tangential step longer than the radius has no SHAKE solution: that unit alone stays."""
  constraint = cola.Implicit(equality=lambda u: jnp.sum(u * u) - 1, axis=0)
  w = jnp.eye(3, 4)  # units: the columns e_0, e_1, e_2 and 0 (off: projected by point)
  w = w.at[:, 3].set(jnp.array([0.0, 0.6, 0.8]))
  # Stored flat in the leaf's layout: unit 1 (e_1) moving by 3 e_0, every unit by 0.1 e_1.
  momentum = jnp.zeros((3, 4)).at[1, :].set(0.1).at[0, 1].set(3.0).ravel()

  @jax.jit
  def a_step(w, momentum):
    point = constraint.point(w, constraint.init(w))
    momentum = constraint.cotangent(point, momentum)
    return point, momentum, constraint.a_step(point, momentum, 1.0)

  point, momentum, (new, new_momentum) = a_step(w, momentum)
  assert bool(jnp.all(point.converged)) and point.x.shape == (3, 4)
  np.testing.assert_array_equal(new.converged, [True, False, True, True])
  np.testing.assert_array_equal(new.x[:, 1], point.x[:, 1])
  np.testing.assert_array_equal(new_momentum.reshape(3, 4)[:, 1], -momentum.reshape(3, 4)[:, 1])
  assert all(float(jnp.max(jnp.abs(new.x[:, j] - point.x[:, j]))) > 0.05 for j in (0, 2, 3))
  x, state = constraint.unpack(new, w)
  assert not bool(state.converged) and float(state.residual(x)) <= 1e-6
  # The same in an update: the other columns move, the failing one stays.
  tx = cola.cola_od(1.0, constraints=constraint)
  grads = jnp.zeros((3, 4)).at[0, 1].set(-3.0).at[1, :].add(-0.1)
  updates, state = jax.jit(tx.update)(grads, tx.init(x), x)
  assert not bool(state.constraint_states.converged)
  np.testing.assert_array_equal(updates[:, 1], 0)
  assert float(jnp.min(jnp.max(jnp.abs(updates[:, (0, 2, 3)]), axis=0))) > 0.05


ATTENTION = {  # Flax's multi-head attention kernels (nnx.MultiHeadAttention, linen's too): 8 features, 2 heads of 4
  "query": {"kernel": jnp.zeros((8, 2, 4)), "bias": jnp.zeros((2, 4))},
  "out": {"kernel": jnp.zeros((2, 4, 8)), "bias": jnp.zeros(8)},
}


@pytest.mark.parametrize(
  ("constraint", "per_head", "per_layer"),
  [
    (
      cola.Orthogonal(),
      "Per head: Orthogonal(row_axes=0, column_axes=2)",
      "Orthogonal(row_axes=0, column_axes=(1, 2))",
    ),
    (cola.UnitNorm(), "Per head: UnitNorm(1.0, axis=(0, 2))", "per layer: UnitNorm(1.0, axis=0)"),
    (cola.MaxNorm(2.0), "Per head: MaxNorm(2.0, axis=(0, 2))", "per layer: MaxNorm(2.0, axis=0)"),
  ],
)
def test_an_attention_kernel_under_a_default_view_is_named_with_its_per_head_and_per_layer_axes(
  constraint, per_head, per_layer
):
  """(features, heads, head_dim) flattened to one (features * heads, head_dim) matrix is no matrix the user meant;
  the output kernel (heads, head_dim, features) flattened to (heads * head_dim, features) is the layer's."""
  name = type(constraint).__name__
  rules = cola.path_constraints([("kernel$", constraint)])
  with pytest.warns(UserWarning) as caught:
    cola.cola_od(0.1, constraints=rules).init(ATTENTION)
  (message,) = [str(w.message) for w in caught]
  assert message.startswith(
    f"{name} constraint with its default axes on one Flax attention kernel (features, heads, head_dim): "
    "['query']['kernel']. It "
  )
  assert per_head in message and per_layer in message


def test_a_3d_leaf_under_the_default_view_warns_unless_its_path_says_conv():
  """A 1-D conv kernel (width, in, out) is the default's own reading; any other 3-D leaf may be a stack or heads."""
  params = {"Conv_0": {"kernel": jnp.zeros((3, 4, 5))}, "layers": {"kernel": jnp.zeros((3, 4, 5))}}
  with pytest.warns(UserWarning) as caught:
    cola.cola_od(0.1, constraints=cola.Orthogonal()).init(params)
  (message,) = {str(w.message) for w in caught}
  assert message.startswith(
    "Orthogonal constraint with its default axes on one 3-D leaf: ['layers']['kernel']. It views each as one (12, 5) "
  )
  assert "e.g. one matrix per index of axis 0: Orthogonal(row_axes=1, column_axes=2)" in message
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    cola.cola_od(0.1, constraints=cola.Orthogonal(row_axes=(0, 1), column_axes=2)).init(params)  # axes given
    cola.cola_od(0.1, constraints=cola.UnitNorm(axis=(0, 1))).init(params)
    cola.cola_od(0.1, constraints=cola.Orthogonal()).init({"conv": {"kernel": jnp.zeros((3, 3, 4, 5))}})  # 2-D conv


# Extended; quick: per-matrix views in test_batched_view_round_trips and test_batched_noise_is_drawn_per_matrix.
@pytest.mark.extended
def test_the_per_head_rules_keep_every_head_orthonormal():
  """The attention rules of the declared-constraints guide: each head's (features, head_dim) and (head_dim, features)
  matrix orthonormal, which the flattened default leaves far from it."""
  key_q, key_o = jax.random.split(jax.random.key(0))
  params = {
    "query": {"kernel": jax.random.normal(key_q, (8, 2, 4))},
    "out": {"kernel": jax.random.normal(key_o, (2, 4, 8))},
  }
  per_head = cola.path_constraints(
    [
      (r"(query|key|value)/kernel$", cola.Orthogonal(row_axes=0, column_axes=2)),
      (r"out/kernel$", cola.Orthogonal(row_axes=1, column_axes=2)),
    ]
  )
  tx = cola.constrained(optax.adam(1e-2), constraints=per_head)
  params, _ = _run(tx, params, 3)
  for h in range(2):
    q, o = params["query"]["kernel"][:, h, :], params["out"]["kernel"][h]
    np.testing.assert_allclose(q.T @ q, jnp.eye(4), atol=1e-5)
    np.testing.assert_allclose(o @ o.T, jnp.eye(4), atol=1e-5)
