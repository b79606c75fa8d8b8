"""Same-shape leaves draw their noise once per group (XLA:CPU, one device): one generator, independent normals."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cola_jax as cola
from cola_jax import _shared_noise, transforms

pytestmark = pytest.mark.skipif(not transforms._sharing_noise_pays(), reason="groups share noise on one CPU device")


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


def shift_lefts(n_leaves: int) -> int:
  """Shift-left operations (the hash's rotations) in the compiled noisy update of ``n_leaves`` circle leaves."""
  params = {f"w{i}": jnp.full((16, 8), 0.1) for i in range(n_leaves)}
  tx = cola.c_cola_ud(0.1, friction=1.0, radius=0.5, temperature=1e-4, key=jax.random.key(0))

  def step(p, s):
    updates, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p)
    return optax.apply_updates(p, updates), s

  return jax.jit(step).lower(params, tx.init(params)).compile().as_text().count("shift-left(")


ROTATIONS = 20  # Threefry-2x32's rounds: one rotation (a shift-left among others) each


def test_the_program_holds_one_generator_per_group_whatever_the_depth(monkeypatch):
  assert shift_lefts(6) - shift_lefts(2) < ROTATIONS  # four more leaves, not one more hash
  monkeypatch.setattr(transforms, "_sharing_noise_pays", lambda: False)
  assert shift_lefts(6) - shift_lefts(2) >= 4 * ROTATIONS  # leaf by leaf: a hash each


def test_the_passes_of_grouped_draws_of_one_shape_compile_to_one_loop(monkeypatch):
  # XLA's CPU backend emits a loop once for all fusions of one body. Every pass of a group must hash
  # the same way from a key of its own: one kernel per group's shape, not one per pass.
  monkeypatch.setattr(_shared_noise, "_ONE_PASS_BYTES", 0)  # circle-od: a pass per member
  params = {f"{name}{i}": jnp.full(shape, 0.1) for name, shape in (("a", (16, 8)), ("b", (8, 16))) for i in range(3)}
  tx = cola.cola_od(0.1, constraints=cola.Circle(0.5), temperature=1e-4, key=jax.random.key(0))
  text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  computations = [block for block in re.split(r"\n(?=%)", text) if block.startswith("%")]
  passes = [c for c in computations if c.count("shift-left(") >= ROTATIONS and "-> (f32[128], f32[128])" in c]
  unnamed = {re.sub(r"metadata=\{[^}]*\}|%?[\w\-]+\.\d+|stack_frame_id=\d+", "", c) for c in passes}
  assert len(passes) == 6
  assert len(unnamed) == 2


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
  # Drawn from the key alone, the whole group's noise (6 members' arrays) was drawn first and held.
  extra = temporaries_in_leaves(dynamics, constraint, 1e-4) - temporaries_in_leaves(dynamics, constraint, 0.0)
  assert extra <= 2 * arrays_per_member


def test_grouped_implicit_leaves_read_their_groups_draw(monkeypatch):
  # On XLA:CPU an Implicit leaf's own draw is written to memory through a conditional; a member of a
  # group reads the group's draw, already in memory, and must not draw again in another branch.
  def conditionals() -> int:
    constraint = cola.Implicit(equality=lambda u: jnp.stack([jnp.sum(u), jnp.sum(u * u) - 1]), axis=0)
    params = {f"w{i}": jax.random.normal(jax.random.key(i), (16, 8)) for i in range(3)}
    params = cola.project_params(params, constraint)
    tx = cola.cola_ud(0.1, friction=1.0, constraints=constraint, temperature=1e-2, key=jax.random.key(0))
    return jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text().count(" conditional(")

  assert conditionals() == 0
  monkeypatch.setattr(transforms, "_sharing_noise_pays", lambda: False)
  assert conditionals() == 3  # leaf by leaf: each writes its own draw once
