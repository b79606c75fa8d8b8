"""bfloat16 parameters: what the optimizer state keeps in float32, and ``accumulator_dtype``.

The geometry runs in float32 for bfloat16 or float16 parameters, and the state
keeps what it works with in float32: slack variables and, for ``cola_ud``,
the momenta. ``cola_ud(accumulator_dtype=jnp.bfloat16)`` stores the momenta in
bfloat16 between steps; the slacks stay in float32. See
``docs/guides/mixed_precision.md``.
"""

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _constraints import case, params

import cola_jax as cola

IN, OUT = 64, 32
WEIGHTS = IN * OUT
F32, BF16 = 4, 2  # bytes per entry

# Per registry case (tests/_constraints.py): the float32 entries of the slack variables of one (IN, OUT) kernel (the
# scalars of the state, radius and centre, aside), and whether cola_ud's momentum holds them too.
SLACK_ENTRIES = {
  "circle": (WEIGHTS, False),  # one per weight
  "box": (WEIGHTS, False),
  "non_negative": (WEIGHTS, False),
  "max_norm": (OUT, False),  # one per unit (column)
  "max_norm_all": (1, False),
  "unit_norm": (0, False),
  "unit_norm_all": (0, False),
  "orthogonal": (0, False),
  "orthogonal_scaled_wide": (0, False),
  "orthogonal_per_head": (0, False),
  "orthogonal_newton": (0, False),
  "orthogonal_square_root": (0, False),
  "max_spectral_norm": (OUT * OUT, True),  # S of the stacked [W; S], whose momentum is the stack's
  "implicit": (0, True),  # the momentum of the Implicit geometry is one flat vector: weights, then slacks
  "implicit_inequality": (1, True),
  "implicit_quasi_newton": (0, True),
  "implicit_per_unit": (0, True),
}
# Every case of the registry whose constraint takes a matrix (the per-matrix views need a stack of them); the quick
# suite keeps three kinds of state (a slack per weight, ProjectionInfo, the Implicit flat momentum), the extended
# tier these seven, the slow tier the others (MaxSpectralNorm among them).
QUICK = {"circle", "box", "non_negative", "max_norm", "implicit", "unit_norm", "orthogonal"}
FEW = {"circle", "orthogonal", "implicit"}
MATRIX_CASES = [
  p if p.marks or p.values[0] in FEW else pytest.param(*p.values, id=p.id, marks=pytest.mark.extended)
  for p in params(names=True, quick=QUICK)
  if len(p.values[2]) <= 2
]


def bf16_params():
  kernel = 0.01 * jax.random.normal(jax.random.key(0), (IN, OUT))
  return {"kernel": kernel.astype(jnp.bfloat16), "bias": jnp.zeros(OUT, jnp.bfloat16)}


def transform(method, constraint, accumulator_dtype=None):
  constraints = {"kernel": constraint, "bias": None}
  if method == "od":
    return cola.cola_od(0.1, constraints=constraints, temperature=1e-5, key=jax.random.key(1))
  return cola.cola_ud(
    0.1,
    friction=1.0,
    constraints=constraints,
    temperature=1e-5,
    key=jax.random.key(1),
    accumulator_dtype=accumulator_dtype,
  )


def arrays(state) -> list:
  """The state's arrays of one entry or more per weight, unit or bias (no scalars, no key)."""
  leaves = jax.tree.leaves(state.constraint_states) + jax.tree.leaves(getattr(state, "momentum", []))
  return [leaf for leaf in leaves if leaf.ndim > 0]


def nbytes(leaves) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def init_and_stepped(tx, params):
  """The shapes and dtypes of the initial state and of the state after one update (traced, not run)."""
  state = jax.eval_shape(tx.init, params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, stepped = jax.eval_shape(tx.update, grads, state, params)
  assert jax.tree.map(lambda a: a.dtype, updates) == jax.tree.map(lambda a: a.dtype, params)
  return state, stepped


def entries(name):
  """The case's slack entries, and the entries of cola_ud's momenta (kernel, slacks it holds, bias)."""
  slacks, carried = SLACK_ENTRIES[name]
  return slacks, WEIGHTS + OUT + (slacks if carried else 0)


@pytest.mark.parametrize("name, constraint, shape", MATRIX_CASES)
@pytest.mark.parametrize("method", ["od", "ud"])
def test_bfloat16_parameters_keep_float32_slacks_and_momenta(method, name, constraint, shape):
  slacks, momenta = entries(name)
  momentum_entries = 0 if method == "od" else momenta
  for state in init_and_stepped(transform(method, constraint), bf16_params()):  # the step keeps every dtype
    assert all(leaf.dtype == jnp.float32 for leaf in arrays(state)), jax.tree.map(lambda a: a.dtype, state)
    assert nbytes(arrays(state)) == F32 * (slacks + momentum_entries)


@pytest.mark.parametrize("name, constraint, shape", MATRIX_CASES)
def test_bfloat16_momenta_halve_the_momenta_and_keep_the_slacks(name, constraint, shape):
  slacks, momentum_entries = entries(name)
  for state in init_and_stepped(transform("ud", constraint, accumulator_dtype=jnp.bfloat16), bf16_params()):
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state.momentum))
    assert all(leaf.dtype == jnp.float32 for leaf in arrays(state._replace(momentum=None)))
    assert nbytes(arrays(state)) == F32 * slacks + BF16 * momentum_entries


X = jax.random.normal(jax.random.key(2), (128, IN))
Y = jnp.tanh(X @ jax.random.normal(jax.random.key(3), (IN, OUT)) / 8)


def loss(params):
  params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  return jnp.mean((jnp.tanh(X @ params["kernel"] + params["bias"]) - Y) ** 2)


def train(params, constraint, accumulator_dtype, steps=50):
  tx = cola.cola_ud(
    0.1,
    friction=1.0,
    constraints={"kernel": constraint, "bias": None},
    temperature=1e-5,
    key=jax.random.key(4),
    accumulator_dtype=accumulator_dtype,
  )

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


# The extended tier runs the circle; the per-unit tangent and RATTLE geometries run with slow.
@pytest.mark.parametrize(
  "family",
  [
    pytest.param("circle", marks=pytest.mark.extended),
    pytest.param("unit_norm", marks=pytest.mark.slow),
    pytest.param("orthogonal", marks=pytest.mark.slow),
  ],
)
def test_bfloat16_momenta_cost_less_than_bfloat16_parameters(family):
  """Rounding the momenta to bfloat16 moves a trajectory less than rounding the parameters does.

  Circle (elementwise, exact A step), UnitNorm (a tangent vector per unit,
  exact great-circle flow) and Orthogonal (RATTLE); 50 noisy steps, fixed keys.
  """
  params = jax.tree.map(lambda p: 4 * p.astype(jnp.float32), bf16_params())
  constraint = case(family)[0]
  reference, _ = train(params, constraint, None)  # float32 parameters and momenta
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  rounded_params, _ = train(bf16, constraint, None)
  rounded_both, state = train(bf16, constraint, jnp.bfloat16)
  kernel = lambda p: np.asarray(p["kernel"], np.float32)
  momenta_cost = np.max(np.abs(kernel(rounded_both) - kernel(rounded_params)))
  parameters_cost = np.max(np.abs(kernel(rounded_params) - kernel(reference)))
  assert 0 < momenta_cost < parameters_cost, (momenta_cost, parameters_cost)
  # The constraint holds as closely as with float32 momenta (the bound of the
  # low-precision tests in tests/test_transforms.py).
  residual = max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(rounded_both, state)))
  assert residual <= 8 * float(jnp.finfo(jnp.bfloat16).eps), residual
  # With float32 parameters, bfloat16 momenta change the trajectory but not how
  # closely the constraint holds: to float32 rounding.
  residual = max(float(r) for r in jax.tree.leaves(cola.constraint_residuals(*train(params, constraint, jnp.bfloat16))))
  # A circle's residual is a few roundings; a column of IN entries is renormalised (its squared norm: twice that)
  # and the residual sums IN products in float32, in an order that depends on the CPU.
  bound = rounding.roundings(16) if family == "circle" else 2 * rounding.renormalised(IN) + rounding.roundings(IN)
  assert residual <= bound, residual


@pytest.mark.parametrize("bad", [jnp.int32, "float33", 3.0])
def test_accumulator_dtype_must_be_a_floating_dtype(bad):
  with pytest.raises(TypeError, match="cola_ud: accumulator_dtype must be a floating point dtype"):
    cola.cola_ud(0.1, friction=1.0, accumulator_dtype=bad)


def test_aliases_pass_the_accumulator_dtype_on():
  params = bf16_params()
  for tx in (
    cola.c_cola_ud(0.1, friction=1.0, radius=0.2, accumulator_dtype=jnp.bfloat16),
    cola.o_cola_ud(0.1, friction=1.0, accumulator_dtype=jnp.bfloat16),
  ):
    assert {m.dtype for m in jax.tree.leaves(tx.init(params).momentum)} == {jnp.dtype(jnp.bfloat16)}
  with pytest.raises(TypeError, match="cola_ud: accumulator_dtype"):
    cola.c_cola_ud(0.1, friction=1.0, radius=0.2, accumulator_dtype=jnp.int8)


@pytest.mark.slow
def test_state_bytes_script_counts_four_bytes_per_slack_and_momentum(load_benchmark, tmp_path):
  script = load_benchmark("cost.mixed_precision_state")
  report = script.main(["--out", str(tmp_path)])
  bf16 = next(entry for entry in report["results"] if entry["param_dtype"] == "bfloat16")
  rows = {row["method"]: row for row in bf16["rows"]}
  entries = bf16["param_bytes"] // BF16
  # The layer kernels: attention in (d, 3d) and out (d, d), feed-forward (d, f) and (f, d), in every layer.
  d, f = script.MODEL["d_model"], script.MODEL["d_ff"]
  kernels = script.MODEL["n_layers"] * (3 * d * d + d * d + 2 * d * f)
  radii = F32 * 4  # a float32 radius per kernel leaf (the layers are stacked: four leaves)
  # Circle: a float32 slack per kernel weight; cola_ud adds a momentum per parameter.
  assert rows["cola_od, Circle(0.2)"]["float32_bytes"] == F32 * kernels + radii
  assert rows["cola_ud, Circle(0.2)"]["float32_bytes"] == F32 * (kernels + entries) + radii
  key = rows["cola_ud, Circle(0.2)"]["state_bytes"] - rows["cola_ud, Circle(0.2)"]["float32_bytes"] - 4  # - count
  assert key == 8  # threefry key data: two uint32
  with_bf16_momenta = rows["cola_ud, Circle(0.2), accumulator_dtype=bfloat16"]["state_bytes"]
  assert with_bf16_momenta == F32 * kernels + radii + BF16 * entries + key + 4
  assert rows["optax.sgd(0.01, momentum=0.9)"]["state_bytes"] == bf16["param_bytes"]
