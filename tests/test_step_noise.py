"""Each leaf's noise comes from its own key, whatever the grouping; on XLA:CPU with one device, same-shape
leaves are drawn together: one generator per group, independent normals."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax import _numerics, _step_noise, langevin
from cola_jax.constraints import Euclidean

pytestmark = pytest.mark.skipif(not _numerics.on_one_cpu_device(), reason="draws are grouped on one CPU device")


def free_noise(n_leaves: int, shape=(64, 32)) -> list[np.ndarray]:
  """The noise of one CoLA-od step of free leaves at zero gradient: update / sqrt(2 tau h)."""
  h, tau = 0.5, 2.0
  params = {f"w{i}": jnp.zeros(shape) for i in range(n_leaves)}
  tx = cola.cola_od(h, temperature=tau, key=jax.random.key(3))
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  return [np.asarray(updates[f"w{i}"]) / np.sqrt(2 * tau * h) for i in range(n_leaves)]


def test_members_get_independent_standard_normal_noise():
  noise = free_noise(5)
  n = noise[0].size
  for z in noise:
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.var() - 1) < 5 * np.sqrt(2 / n)
  # Every member its own numbers (a slice given twice would correlate perfectly).
  flat = np.stack([z.ravel() for z in noise])
  correlation = np.corrcoef(flat)
  assert np.max(np.abs(correlation - np.eye(len(noise)))) < 5 / np.sqrt(n)
  np.testing.assert_array_equal(np.stack(free_noise(5)), np.stack(noise))  # a fixed key: the same run


def test_a_free_leaf_reads_the_draw_of_its_own_key():
  # The documented stream: the state's key split once per step, the step key split once per leaf.
  key = jax.random.key(3)  # free_noise's
  noise = free_noise(3)
  _, step_key = jax.random.split(key)
  for leaf_key, z in zip(jax.random.split(step_key, 3), noise):
    want = langevin.draw_noise(Euclidean(), leaf_key, jnp.zeros((64, 32)), "overdamped")
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-6)


def one_noisy_step(make, params):
  tx = make()
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  return updates, getattr(state, "momentum", None)


def implicit_zero_sum():
  return cola.Implicit(equality=lambda u: jnp.stack([jnp.sum(u), jnp.sum(u * u) - 1]), axis=0)


@pytest.mark.parametrize(
  "make, constraint",
  [
    pytest.param(
      lambda c: cola.cola_od(0.1, constraints=c, temperature=1e-2, key=jax.random.key(0)), cola.Circle(0.5), id="od"
    ),
    pytest.param(
      lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, temperature=1e-2, key=jax.random.key(0)),
      cola.MaxNorm(1.0),
      id="ud-oba",
    ),
    pytest.param(
      lambda c: cola.cola_ud(
        0.1, friction=1.0, constraints=c, temperature=1e-2, key=jax.random.key(0), splitting="BAOAB"
      ),
      cola.Orthogonal(),
      id="ud-baoab",
    ),
    pytest.param(
      lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, temperature=1e-2, key=jax.random.key(0)),
      implicit_zero_sum(),
      id="ud-implicit",
    ),
  ],
)
def test_a_seed_gives_the_same_numbers_however_the_draws_are_grouped(make, constraint, monkeypatch):
  # One program per group, a pass per member, or leaf by leaf as on accelerators: the same numbers.
  params = {f"w{i}": jax.random.normal(jax.random.key(i), (16, 8)) for i in range(3)}
  params = cola.project_params(params, constraint)
  grouped = one_noisy_step(lambda: make(constraint), params)
  monkeypatch.setattr(_step_noise, "_ONE_PASS_BYTES", 0)
  per_member = one_noisy_step(lambda: make(constraint), params)
  monkeypatch.setattr(_step_noise, "on_one_cpu_device", lambda: False)
  leaf_by_leaf = one_noisy_step(lambda: make(constraint), params)
  for other in (per_member, leaf_by_leaf):
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(other)):
      np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-7)


def shift_lefts(n_leaves: int) -> int:
  """Shift-left operations (the hash's rotations) in the compiled noisy update of ``n_leaves`` circle leaves."""
  params = {f"w{i}": jnp.full((16, 8), 0.1) for i in range(n_leaves)}
  tx = cola.c_cola_ud(0.1, friction=1.0, radius=0.5, mask=True, temperature=1e-4, key=jax.random.key(0))

  def step(p, s):
    updates, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p)
    return optax.apply_updates(p, updates), s

  return jax.jit(step).lower(params, tx.init(params)).compile().as_text().count("shift-left(")


ROTATIONS = 20  # Threefry-2x32's rounds: one rotation (a shift-left among others) each


def test_the_program_holds_one_generator_per_group_whatever_the_depth(monkeypatch):
  assert shift_lefts(6) - shift_lefts(2) < ROTATIONS  # four more leaves, not one more hash
  monkeypatch.setattr(_step_noise, "on_one_cpu_device", lambda: False)
  assert shift_lefts(6) - shift_lefts(2) >= 4 * ROTATIONS  # leaf by leaf: a hash each


def test_the_passes_of_grouped_draws_of_one_shape_compile_to_one_loop(monkeypatch):
  # XLA's CPU backend emits a loop once for all fusions of one body. Every member's pass must hash
  # the same way from a key of its own: one kernel per group's shape, not one per member.
  monkeypatch.setattr(_step_noise, "_ONE_PASS_BYTES", 0)  # a pass per member
  params = {f"{name}{i}": jnp.full(shape, 0.1) for name, shape in (("a", (16, 8)), ("b", (8, 16))) for i in range(3)}
  tx = cola.cola_od(0.1, constraints=cola.Circle(0.5), temperature=1e-4, key=jax.random.key(0))
  text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  computations = [block for block in re.split(r"\n(?=%)", text) if block.startswith("%")]
  passes = [c for c in computations if c.count("shift-left(") >= ROTATIONS]
  unnamed = {re.sub(r"metadata=\{[^}]*\}|%?[\w\-]+\.\d+|stack_frame_id=\d+", "", c) for c in passes}
  assert len(passes) == 6
  assert len(unnamed) == 2


def distinct_fused_computations(text: str) -> int:
  """The fused computations of compiled HLO ``text`` that differ once their names are dropped."""
  bodies = re.findall(r"\n(%fused[^\n]*\{\n.*?\n\})", text, flags=re.S)
  return len({re.sub(r"metadata=\{[^}]*\}|%?[\w\-]+\.\d+|stack_frame_id=\d+", "", b.split("\n", 1)[1]) for b in bodies})


@pytest.mark.skipif(not _numerics.on_one_cpu_device(), reason="grouped draws are written on one CPU device only")
def test_leaves_of_one_shape_share_their_update_loops_however_many(monkeypatch):
  # A group's small draws are written once and each member reads its row; at a constant offset, each
  # member's update loops differed by it and were compiled once per member (the 12-block model's CoLA-od
  # MaxNorm step: 552 distinct fused computations, 168 before the noise was made explicit). Read at an
  # index that is an operand, and each group's keys taken in one gather, the count does not grow with
  # the number of leaves.
  def distinct(n_leaves):
    params = {f"w{i}": jnp.full((24, 16), 0.05) for i in range(n_leaves)}
    tx = cola.cola_od(0.1, constraints=cola.MaxNorm(1.0), temperature=1e-4, key=jax.random.key(0))
    return distinct_fused_computations(jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text())

  assert distinct(6) == distinct(3)


def temporaries_in_leaves(dynamics: str, constraint, temperature: float) -> float:
  """XLA's temporary bytes of a jitted, donated training step of six 512 x 512 layers, in layers' bytes.

  At a batch of 2048 the forward activations dominate: the temporaries peak in the backward pass.
  """
  keys = jax.random.split(jax.random.key(0), 6)
  params = cola.project_params(
    {f"w{i}": 0.05 * jax.random.normal(k, (512, 512)) for i, k in enumerate(keys)}, constraint
  )
  x = jax.random.normal(jax.random.key(1), (2048, 512))

  def loss(p):
    h = x
    for i in range(6):
      h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h**2)

  noise = {"temperature": temperature, "key": jax.random.key(2)} if temperature > 0 else {}
  if dynamics == "od":
    tx = cola.cola_od(0.01, constraints=constraint, **noise)
  else:
    tx = cola.cola_ud(0.1, friction=1.0, constraints=constraint, **noise)

  def step(p, s):
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / (512 * 512 * 4)


@pytest.mark.parametrize(
  "dynamics, constraint, arrays_per_member",
  [
    pytest.param("od", cola.Circle(0.5), 2, id="circle-od"),
    pytest.param("ud", cola.UnitNorm(1.0), 1, id="unit_norm-ud"),
  ],
)
def test_the_groups_noise_is_drawn_after_the_gradients_not_held_through_the_backward_pass(
  dynamics, constraint, arrays_per_member
):
  # Drawn from the key alone, the whole group's noise (6 members' arrays) was drawn first and held. At most
  # two members' draws are alive at once (jax 0.10.2: 2.0 layers for both), and the keys (bytes).
  extra = temporaries_in_leaves(dynamics, constraint, 1e-4) - temporaries_in_leaves(dynamics, constraint, 0.0)
  assert extra < 2 * arrays_per_member + 0.01
