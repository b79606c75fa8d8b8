"""Bad input: hyperparameters, trees that do not fit, states of other parameters.

Each case gets what ``optax.sgd`` does with it (empty trees and zero-size
leaves pass) or an error that names the argument and the leaf's path.
"""

import re
import warnings

import _rounding as rounding
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import quick_or_extended
from _constraints import CASES, VARIANTS

import cola_jax as cola

INF, NAN = float("inf"), float("nan")

# Every transform and alias, built with keyword overrides of its hyperparameters.
FACTORIES = {
  "cola_od": lambda **kw: cola.cola_od(kw.pop("learning_rate", 0.1), **kw),
  "cola_ud": lambda **kw: cola.cola_ud(kw.pop("learning_rate", 0.1), friction=kw.pop("friction", 1.0), **kw),
  "c_cola_od": lambda **kw: cola.c_cola_od(kw.pop("learning_rate", 0.1), radius=kw.pop("radius", 0.1), **kw),
  "c_cola_ud": lambda **kw: cola.c_cola_ud(
    kw.pop("learning_rate", 0.1), friction=kw.pop("friction", 1.0), radius=kw.pop("radius", 0.1), **kw
  ),
  "o_cola_od": lambda **kw: cola.o_cola_od(kw.pop("learning_rate", 0.1), **kw),
  "o_cola_ud": lambda **kw: cola.o_cola_ud(kw.pop("learning_rate", 0.1), friction=kw.pop("friction", 1.0), **kw),
}
UNDERDAMPED = ("cola_ud", "c_cola_ud", "o_cola_ud")


def _fewer(owners, quick, extended):
  """``owners`` as parameters: ``quick``'s quick, ``extended``'s extended, the others slow."""
  return quick_or_extended(
    [(o,) for o in owners], {(o,) for o in quick}, ids=lambda o: o, extended={(o,) for o in extended}
  )


ORTHOGONAL = ("o_cola_od", "o_cola_ud")


def _cases(argument, values, owners):
  return [pytest.param(owner, argument, v, id=f"{owner}-{argument}={v!r}") for owner in owners for v in values]


HYPERPARAMETER_CASES = (
  _cases("learning_rate", [INF, -INF, NAN, 0.0, -0.1, 1e400], FACTORIES)
  + _cases("temperature", [INF, NAN, -1e-3], FACTORIES)
  + _cases("friction", [INF, NAN, -1.0], UNDERDAMPED)
  + _cases("radius", [INF, NAN, 0.0, -1.0], ("c_cola_od", "c_cola_ud"))
  + _cases("tolerance", [INF, NAN, 0.0], ORTHOGONAL)
  + _cases("max_iterations", [INF, NAN, 0, 2.5, -3], ORTHOGONAL)
)


@pytest.mark.parametrize("owner, argument, value", HYPERPARAMETER_CASES)
def test_every_transform_refuses_a_bad_number_at_construction(owner, argument, value):
  key = jax.random.key(0) if argument == "temperature" else None
  extra = {} if key is None else {"key": key}
  with pytest.raises(ValueError, match=rf"{argument} must be (positive|non-negative|a positive integer)"):
    FACTORIES[owner](**{argument: value}, **extra)


CONSTRAINT_CASES = [
  (lambda v: cola.Circle(v), "Circle: radius", [INF, NAN, 0.0, -1.0]),
  (lambda v: cola.MaxNorm(v), "MaxNorm: radius", [INF, NAN, 0.0]),
  (lambda v: cola.Orthogonal(tolerance=v), "Orthogonal: tolerance", [INF, NAN, 0.0]),
  (lambda v: cola.Orthogonal(reproject_above=v), "Orthogonal: reproject_above", [INF, NAN, -1.0]),
  (lambda v: cola.Orthogonal(max_iterations=v), "Orthogonal: max_iterations", [INF, -INF, NAN, 0, 1.5]),
  (lambda v: cola.Implicit(equality=jnp.sum, tolerance=v), "Implicit: tolerance", [INF, NAN, 0.0]),
  (lambda v: cola.Implicit(equality=jnp.sum, max_iterations=v), "Implicit: max_iterations", [INF, NAN, 0]),
]


@pytest.mark.parametrize(
  "make, message, value",
  [pytest.param(make, message, v, id=f"{message}={v!r}") for make, message, vs in CONSTRAINT_CASES for v in vs],
)
def test_every_constraint_refuses_a_bad_number_at_construction(make, message, value):
  with pytest.raises(ValueError, match=message):
    make(value)


@pytest.mark.parametrize(
  "argument, value", [("beta", v) for v in (1.0, 2.0, INF, NAN, -0.1)] + [("gap_tolerance", v) for v in (INF, NAN, 0.0)]
)
def test_manifold_muon_refuses_a_bad_beta_or_gap_tolerance_at_construction(argument, value):
  """``beta``, optax.contrib.muon's decay rate of the average, is in [0, 1); ``gap_tolerance`` is a positive gap."""
  with pytest.raises(ValueError, match=rf"^manifold_muon: {argument} must be (in \[0, 1\)|non-negative|positive)"):
    cola.manifold_muon(0.1, **{argument: value})


def test_hyperparameters_that_are_not_real_scalars_are_type_or_value_errors():
  with pytest.raises(TypeError, match="cola_od: learning_rate must be a number, got '0.1'"):
    cola.cola_od("0.1")
  with pytest.raises(TypeError, match="cola_ud: friction must be a number, got '1.0'"):
    cola.cola_ud(0.1, friction="1.0")
  with pytest.raises(TypeError, match="learning_rate must be a real number"):
    cola.cola_od(0.1 + 0.1j)
  with pytest.raises(ValueError, match=re.escape("learning_rate must be a scalar, got shape (2,)")):
    cola.cola_od(jnp.array([0.1, 0.2]))
  with pytest.raises(TypeError, match="max_iterations must be a number, not a schedule"):
    cola.Orthogonal(max_iterations=lambda count: 20)
  with pytest.raises(TypeError, match="manifold_muon: beta must be a number, not a schedule"):
    cola.manifold_muon(0.1, beta=lambda count: 0.9)


def test_radius_tree_is_checked_at_construction_naming_its_path():
  with pytest.raises(ValueError, match=re.escape("c_cola_ud: radius['b']['w'] must be positive and finite, got inf")):
    cola.c_cola_ud(0.1, friction=1.0, radius={"a": 0.1, "b": {"w": INF}})


def test_sgd_momentum_maps_refuse_infinite_numbers():
  with pytest.raises(ValueError, match="learning_rate"):
    cola.sgd_momentum_to_langevin(INF, 0.9)
  with pytest.raises(ValueError, match="friction"):
    cola.langevin_to_sgd_momentum(0.1, INF)


def test_traced_hyperparameters_pass_construction():
  """Under jit (and inject_hyperparams) values are unknown: checked where they are known."""

  def first_update(lr, radius, params):
    tx = cola.c_cola_od(lr, radius=radius)
    return tx.update(params, tx.init(params), params)[0]

  params = {"w": jnp.full((2, 2), 0.05)}
  # The update is new - old of entries of 0.05, each put back on its circle and stepped: the two programs
  # round it differently by up to stepped(2) of 0.05 (not relative to the small update itself).
  np.testing.assert_allclose(
    jax.jit(first_update)(0.1, 0.1, params)["w"],
    first_update(0.1, 0.1, params)["w"],
    rtol=0,
    atol=rounding.stepped(2) * 0.05,
  )


# Schedules that reach or cross zero.


@pytest.mark.parametrize("owner", _fewer(FACTORIES, {"cola_ud"}, {"cola_od"}))  # the presets' steps are these
def test_schedule_ending_at_zero_or_rounding_below_it_moves_nothing(owner):
  """A learning rate of 0 (cosine decay's end) or just below (linear_schedule's rounding) moves nothing."""
  params = {"w": jnp.linspace(-0.3, 0.3, 6).reshape(3, 2) * 0.2, "b": jnp.ones(2)}
  for value in (0.0, -1.5e-9):
    schedule = lambda count, value=value: jnp.where(count < 1, 0.05, value)
    tx = FACTORIES[owner](learning_rate=schedule, temperature=lambda count: jnp.asarray(1e-3), key=jax.random.key(0))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)

    @jax.jit
    def step(params, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params_1, state = step(params, state)  # h = 0.05: moves
    params_2, state = step(params_1, state)  # h = value: moves nothing
    params_3, _ = step(params_2, state)  # nor does it leave a NaN momentum behind
    for leaf_1, leaf_3 in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_3)):
      assert np.all(np.isfinite(leaf_3)), (owner, value)
      np.testing.assert_allclose(leaf_3, leaf_1, atol=2e-6, err_msg=f"{owner} h={value}")


def test_inject_hyperparams_accepts_a_schedule_value_of_zero():
  """inject_hyperparams passes a schedule's value as an array: zero is valid there."""
  params = {"w": jnp.full((3, 2), 0.05)}
  tx = optax.inject_hyperparams(cola.c_cola_od)(learning_rate=optax.cosine_decay_schedule(0.1, 1), radius=0.1)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(grads, state, params)
  updates, _ = tx.update(grads, state, params)  # eagerly, at h = 0 exactly
  np.testing.assert_array_equal(updates["w"], jnp.zeros((3, 2)))


# Trees that do not fit.


PARAMS = {"dense": {"kernel": jnp.full((3, 2), 0.05), "bias": jnp.zeros(2)}}


@pytest.mark.parametrize("owner", FACTORIES)
@pytest.mark.parametrize("shape", [(2, 3), (), (1, 2), (3, 2, 1), (6,)])
def test_gradient_of_another_shape_is_an_error_naming_grads_and_the_leaf(owner, shape):
  tx = FACTORIES[owner]()
  grads = {"dense": {"kernel": jnp.ones(shape), "bias": jnp.zeros(2)}}
  message = re.escape(f"grads['dense']['kernel'] has shape {shape}, but params['dense']['kernel'] has shape (3, 2)")
  with pytest.raises(ValueError, match=message):
    tx.update(grads, tx.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match=message):  # a static check: the same under jit
    jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("owner", FACTORIES)
def test_none_gradient_for_an_array_is_an_error_naming_the_leaf(owner):
  tx = FACTORIES[owner]()
  grads = {"dense": {"kernel": None, "bias": jnp.zeros(2)}}
  with pytest.raises(
    TypeError, match=re.escape("grads['dense']['kernel'] is None, but params['dense']['kernel'] is an array")
  ):
    tx.update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_gradient_that_is_not_real_floating_point_is_an_error(dtype):
  tx = cola.c_cola_od(0.1, radius=0.1)
  grads = {"dense": {"kernel": jnp.ones((3, 2), dtype), "bias": jnp.zeros(2)}}
  with pytest.raises(TypeError, match=re.escape(f"grads['dense']['kernel'] has dtype {jnp.dtype(dtype)}")):
    tx.update(grads, tx.init(PARAMS), PARAMS)


def test_gradients_of_another_structure_are_an_error():
  tx = cola.c_cola_od(0.1, radius=0.1)
  with pytest.raises(ValueError, match="grads does not have the structure of the parameters"):
    tx.update({"dense": {"kernel": jnp.ones((3, 2))}}, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("owner", _fewer(FACTORIES, {"cola_od", "cola_ud"}, {"o_cola_ud"}))  # and a preset's default
def test_python_and_numpy_scalar_leaves_are_used_as_optax_uses_them(owner):
  params = {"scale": 0.5, "offset": np.float32(0.25), "dense": {"kernel": jnp.full((3, 2), 0.05)}}
  tx = FACTORIES[owner]()
  grads = {"scale": 1.0, "offset": np.float32(1.0), "dense": {"kernel": jnp.ones((3, 2))}}
  updates, _ = tx.update(grads, tx.init(params), params)
  sgd_like = optax.apply_updates(params, updates)
  assert jnp.shape(sgd_like["scale"]) == () and jnp.shape(sgd_like["offset"]) == ()
  assert float(sgd_like["scale"]) < 0.5 and float(sgd_like["offset"]) < 0.25  # free leaves descend
  if owner == "cola_od":  # plain SGD
    reference = optax.apply_updates(params, optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params))[0])
    for a, b in zip(jax.tree.leaves(sgd_like), jax.tree.leaves(reference)):
      np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_leaf_that_is_not_a_number_is_an_error_naming_params_and_the_leaf():
  with pytest.raises(TypeError, match=re.escape("cola_od: params['name'] is 'layer'")):
    cola.cola_od(0.1).init({"name": "layer", "w": jnp.ones(2)})
  with pytest.raises(TypeError, match=re.escape("dtype int32; parameters must be floating point (params['step'])")):
    cola.cola_od(0.1).init({"step": jnp.zeros((), jnp.int32)})


@pytest.mark.parametrize("owner", FACTORIES)
def test_empty_parameter_tree_is_a_no_op_as_in_optax(owner):
  tx = FACTORIES[owner]()
  for empty in ({}, [], {"a": {}, "b": None}):
    state = tx.init(empty)
    updates, state = tx.update(empty, state, empty)
    assert updates == empty
    assert int(state.count) == 1
    assert cola.constraint_residuals(empty, state) == empty


@pytest.mark.parametrize("owner", FACTORIES)
def test_masked_and_partition_groups_that_select_nothing_are_no_ops(owner):
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  masked = optax.masked(FACTORIES[owner](), jax.tree.map(lambda _: False, PARAMS))
  updates, _ = masked.update(grads, masked.init(PARAMS), PARAMS)
  assert jax.tree.all(jax.tree.map(lambda u, g: bool(jnp.all(u == g)), updates, grads))  # masked out: unchanged
  partition = optax.partition(
    {"cola": FACTORIES[owner](), "sgd": optax.sgd(0.1)}, jax.tree.map(lambda _: "sgd", PARAMS)
  )
  updates, _ = partition.update(grads, partition.init(PARAMS), PARAMS)
  reference, _ = optax.sgd(0.1).update(grads, optax.sgd(0.1).init(PARAMS))
  assert jax.tree.all(jax.tree.map(lambda u, r: bool(jnp.all(u == r)), updates, reference))


def _zero_size(cases):
  """Per case, its leaf without entries along each axis in turn (an equality of ``Implicit`` has no point there: the
  test below), and a leaf with entries; their constraints."""
  leaves, constraints = {"kept": jnp.full((3, 2), 0.05)}, {"kept": cola.Circle(0.1)}
  for name, constraint, shape in cases:
    if getattr(constraint, "equality", None) is None:
      for axis in range(len(shape)):
        key = f"{name}_axis{axis}"
        leaves[key], constraints[key] = jnp.zeros((*shape[:axis], 0, *shape[axis + 1 :])), constraint
  return leaves, constraints


TRANSFORMS_OF = {
  "cola_od": lambda c: cola.cola_od(0.1, constraints=c),
  "cola_ud_baoab": lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, splitting="BAOAB"),
  "cola_ud_noisy": lambda c: cola.cola_ud(0.1, friction=1.0, constraints=c, temperature=1e-3, key=jax.random.key(0)),
}


@pytest.mark.parametrize("cases", [CASES, pytest.param(VARIANTS, marks=pytest.mark.slow)], ids=["cases", "variants"])
@pytest.mark.parametrize(
  "make",
  [
    TRANSFORMS_OF["cola_od"],
    pytest.param(TRANSFORMS_OF["cola_ud_baoab"], marks=pytest.mark.extended),  # quick: cola_od
    pytest.param(TRANSFORMS_OF["cola_ud_noisy"], marks=pytest.mark.extended),
  ],
  ids=list(TRANSFORMS_OF),
)
def test_zero_size_leaves_pass_as_in_optax(make, cases):
  leaves, constraints = _zero_size(cases)
  tx = make(constraints)
  grads = jax.tree.map(jnp.ones_like, leaves)
  updates, state = jax.jit(tx.update)(grads, tx.init(leaves), leaves)
  for name, leaf in leaves.items():
    assert updates[name].shape == leaf.shape and updates[name].dtype == leaf.dtype
  new = optax.apply_updates(leaves, updates)
  residuals = cola.constraint_residuals(new, state)
  assert [name for name, r in residuals.items() if name != "kept" and r is not None] == []  # nothing to constrain
  assert float(residuals["kept"]) < 1e-6
  projected = cola.project_params(leaves, constraints)
  assert jax.tree.map(jnp.shape, projected) == jax.tree.map(jnp.shape, leaves)


def test_implicit_constraint_on_a_zero_size_leaf_has_no_point_and_says_so():
  """sum(w**2) = 1 has no solution without entries: an error, not a pass."""
  tx = cola.cola_od(0.1, constraints=cola.Implicit(equality=lambda w: jnp.sum(w**2) - 1))
  with pytest.raises(ValueError, match=re.escape("leaf at ['w'], of shape (0, 3): 1 constraint components for 0")):
    tx.init({"w": jnp.zeros((0, 3))})


# States that do not fit.


@pytest.mark.parametrize("owner", FACTORIES)
def test_state_initialised_for_parameters_of_other_shapes_is_an_error(owner):
  tx = FACTORIES[owner]()
  other = {"dense": {"kernel": jnp.full((2, 3), 0.05), "bias": jnp.zeros(2)}}
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  state = tx.init(other)
  if owner in ("cola_od", "o_cola_od"):
    # Nothing in these states is shaped like a parameter: the state fits any shapes.
    tx.update(grads, state, PARAMS)
    return
  with pytest.raises(
    ValueError,
    match=re.escape(
      "state for params['dense']['kernel'] holds an array of shape (2, 3) where a parameter "
      "of shape (3, 2) needs (3, 2)"
    ),
  ):
    tx.update(grads, state, PARAMS)


def test_state_for_a_different_number_of_leaves_is_an_error():
  tx = cola.c_cola_ud(0.1, friction=1.0, radius=0.1)
  state = tx.init({"dense": {"kernel": jnp.ones((3, 2))}})
  with pytest.raises(ValueError, match="state.constraint_states does not have the structure of the parameters"):
    tx.update(jax.tree.map(jnp.ones_like, PARAMS), state, PARAMS)


def test_residuals_of_python_scalar_leaves():
  params = {"s": 0.05, "w": jnp.full((2, 2), 0.05)}
  tx = cola.cola_od(0.1, constraints=cola.Circle(0.1))
  residuals = cola.constraint_residuals(params, tx.init(params))
  assert float(residuals["s"]) < 1e-6 and float(residuals["w"]) < 1e-6


@pytest.mark.parametrize(
  "name, make",
  [
    ("c_cola_od", lambda lr: cola.c_cola_od(lr, radius=0.1)),
    ("c_cola_ud", lambda lr: cola.c_cola_ud(lr, friction=1.0, radius=0.1)),
    ("o_cola_od", lambda lr: cola.o_cola_od(lr)),
    ("o_cola_ud", lambda lr: cola.o_cola_ud(lr, friction=1.0)),
  ],
)
def test_errors_name_the_function_the_user_called(name, make):
  """At construction and when init or update runs, and not for a cola_od/cola_ud built afterwards."""
  with pytest.raises(ValueError, match=f"^{name}: learning_rate must be positive"):
    make(INF)
  with pytest.raises(TypeError, match=re.escape(f"{name}: params['name'] is 'layer'")):
    make(0.1).init({"name": "layer", "w": jnp.ones(2)})
  with pytest.raises(ValueError, match="^cola_od: learning_rate"):
    cola.cola_od(INF)


def test_the_constraint_builders_name_the_preset_or_themselves():
  """One mechanism names the caller: the presets' names reach their constraint builders, no argument carries them."""
  with pytest.raises(ValueError, match=re.escape("c_cola_ud: radius['w'] must be positive")):
    cola.c_cola_ud(0.1, friction=1.0, radius={"w": -1.0, "b": None})
  with pytest.raises(ValueError, match=re.escape("circle_constraints: radius['w'] must be positive")):
    cola.circle_constraints({"w": -1.0, "b": None})
  with pytest.raises(TypeError, match="^orthogonal_constraints: mask must be booleans"):
    cola.orthogonal_constraints(mask="w")
  with pytest.raises(TypeError, match="^o_cola_od: mask must be booleans"):
    cola.o_cola_od(0.1, mask="w")


@pytest.mark.parametrize("owner", ["c_cola_od", "c_cola_ud", "o_cola_od", "o_cola_ud"])
@pytest.mark.parametrize(
  "mask, where",
  [
    (cola.Orthogonal(), r"mask is Orthogonal\("),
    ("kernel", "mask is 'kernel'"),
    (1, "mask is 1"),
    ({"w": 1.0, "b": True}, r"mask\['w'\] is 1.0"),
  ],
  ids=["constraint", "string", "number", "number-leaf"],
)
def test_a_mask_that_is_not_booleans_is_a_type_error_pointing_to_constraints(owner, mask, where):
  with pytest.raises(TypeError, match=rf"{owner}: mask must be booleans.*{where}.*constraints="):
    FACTORIES[owner](mask=mask)


def test_a_callable_mask_returning_constraints_is_a_type_error_at_init():
  # A Constraint tree built by path is truthy leaf by leaf: it used to pass for a mask of Trues.
  tx = cola.o_cola_ud(0.1, friction=1.0, mask=cola.path_constraints([("kernel", cola.Orthogonal())]))
  message = r"o_cola_ud: mask must be booleans.*mask\(params\)\['dense'\]\['kernel'\] is Orthogonal\("
  with pytest.raises(TypeError, match=message):
    tx.init(PARAMS)


@pytest.mark.parametrize("owner", ["c_cola_od", "c_cola_ud", "o_cola_od", "o_cola_ud"])
def test_masks_of_booleans_and_callables_returning_them_choose_the_constrained_leaves(owner):
  params = {"w": jnp.full((3, 3), 0.3), "v": jnp.full((3, 3), 0.3)}
  for mask in ({"w": True, "v": np.bool_(False)}, lambda p: {"w": True, "v": False}):
    state = FACTORIES[owner](mask=mask).init(params)
    residuals = cola.constraint_residuals(params, state)
    assert residuals["v"] is None and residuals["w"] is not None


@pytest.mark.parametrize(
  "owner",
  [
    pytest.param("c_cola_od", marks=pytest.mark.extended),  # quick: a c- and an o- preset
    "c_cola_ud",
    "o_cola_od",
    pytest.param("o_cola_ud", marks=pytest.mark.extended),
  ],
)
def test_every_preset_accepts_constraints_as_cola_od_does(owner):
  """One vocabulary: constraints= on the presets too, instead of their radius or mask."""
  params = {"Dense_0": {"kernel": jnp.full((3, 3), 0.3)}, "Dense_1": {"kernel": jnp.full((3, 3), 0.3)}}
  rules = cola.path_constraints([("Dense_1/kernel", cola.Orthogonal())])
  kw = {} if owner.startswith("o") else {"radius": None}
  tx = FACTORIES[owner](constraints=rules, **kw)
  state = tx.init(params)
  updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  residuals = cola.constraint_residuals(optax.apply_updates(params, updates), state)
  assert residuals["Dense_0"]["kernel"] is None and float(residuals["Dense_1"]["kernel"]) < 1e-5
  with pytest.raises(ValueError, match=f"^{owner}: constraints= chooses every leaf's constraint; mask="):
    FACTORIES[owner](constraints=rules, mask={"Dense_0": True, "Dense_1": True}, **kw)


def test_circle_presets_need_radius_or_constraints():
  with pytest.raises(TypeError, match=r"^c_cola_ud: give radius= .* or constraints="):
    cola.c_cola_ud(0.1, friction=1.0)
  with pytest.raises(ValueError, match="^c_cola_od: constraints= chooses every leaf's constraint; radius="):
    cola.c_cola_od(0.1, radius=0.1, constraints=cola.Circle(0.1))


DEFAULTS = {  # every entry that picks the leaves it constrains when not told, as FACTORIES builds it
  **{name: FACTORIES[name] for name in ("c_cola_od", "c_cola_ud", "o_cola_od", "o_cola_ud")},
  "hyperspherical_descent": lambda **kw: cola.hyperspherical_descent(0.1, **kw),
  "manifold_muon": lambda **kw: cola.manifold_muon(0.1, **kw),
}
SPELLED = {  # each entry's constraint, as its warning writes it
  "c_cola_od": "cola.Circle(0.1)",
  "c_cola_ud": "cola.Circle(0.1)",
  "o_cola_od": "cola.Orthogonal()",
  "o_cola_ud": "cola.Orthogonal()",
  "hyperspherical_descent": 'cola.UnitNorm(axis="all")',
  "manifold_muon": "cola.Orthogonal()",
}


def _small_transformer():
  """The leaves of a transformer: an embedding table, a 2-D attention bias, a norm's scale, kernels."""
  return {
    "embed": {"embedding": jnp.full((6, 4), 0.5)},
    "attention": {"kernel": jnp.eye(4), "bias": jnp.full((2, 2), 0.5)},
    "norm": {"scale": jnp.full(4, 0.5)},
    "head": {"kernel": jnp.eye(4), "bias": jnp.full(4, 0.5)},
  }


# Extended: a c- and an o- preset (each family's rule and message) and hyperspherical descent's UnitNorm; the quick
# suite keeps one of them per test (c_cola_ud where the test has a branch for the presets).
QUICK_DEFAULTS = {"c_cola_ud", "o_cola_ud", "hyperspherical_descent"}


@pytest.mark.parametrize("owner", _fewer(DEFAULTS, {"hyperspherical_descent"}, QUICK_DEFAULTS))
def test_every_default_takes_the_weight_matrices_and_names_them(owner):
  """One rule: leaves of ndim >= 2 but biases, scales and embedding tables; a warning lists them and the fix.

  Before, the c-CoLA default took the embedding table and the 2-D bias (and clipped them to the radius) without
  a word, and hyperspherical descent and manifold Muon put every leaf on their manifolds.
  """
  params = _small_transformer()
  fix = f"constraints=cola.path_constraints([(r'attention/kernel$', {SPELLED[owner]})])"
  with pytest.warns(UserWarning, match=f"^{owner}: not told which leaves to constrain") as caught:
    tx = DEFAULTS[owner]()
    state = tx.init(params)
    updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  message = str(caught[0].message)
  assert "it constrains these 2: attention/kernel, head/kernel." in message and fix in message
  new = optax.apply_updates(params, updates)
  residuals = cola.constraint_residuals(new, state)
  assert float(residuals["attention"]["kernel"]) < 1e-5 and float(residuals["head"]["kernel"]) < 1e-5
  for layer, name in [("embed", "embedding"), ("attention", "bias"), ("norm", "scale"), ("head", "bias")]:
    assert residuals[layer][name] is None, (layer, name)
    np.testing.assert_array_equal(new[layer][name], params[layer][name])  # free, with a zero gradient: still


@pytest.mark.parametrize("owner", _fewer(DEFAULTS, {"hyperspherical_descent"}, QUICK_DEFAULTS))
def test_a_default_is_resolved_and_warned_about_once_over_init_a_jit_trace_and_eager_updates(owner):
  """The driver resolves the constraint spec once per tree structure, at init: before, the default's rule ran (and
  warned) again at every jit trace and every eager update."""
  params = _small_transformer()
  grads = jax.tree.map(jnp.zeros_like, params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = DEFAULTS[owner]()
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    for _ in range(2):
      updates, state = tx.update(grads, state, params)
  told = [w for w in caught if "not told which leaves to constrain" in str(w.message)]
  assert len(told) == 1, [str(w.message)[:80] for w in caught]


@pytest.mark.parametrize("owner", _fewer(DEFAULTS, {"c_cola_ud"}, QUICK_DEFAULTS))
def test_a_default_is_quiet_when_told_or_when_there_is_one_matrix(owner):
  """A mask, a radius per layer, optax.partition's labels (which route 2-D leaves whatever their names), one
  matrix, one array."""
  params = _small_transformer()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    if owner.startswith(("c_", "o_")):
      DEFAULTS[owner](mask=jax.tree.map(lambda x: x.shape == (4, 4), params)).init(params)
    if owner.startswith("c_"):  # a radius per layer names the layers; the rule frees their biases quietly
      DEFAULTS[owner](radius={"embed": None, "attention": 0.1, "norm": None, "head": 0.1}).init(params)
    labels = jax.tree.map(lambda x: "matrices" if x.ndim == 2 else "rest", params)
    tx = optax.partition({"matrices": DEFAULTS[owner](), "rest": optax.adam(1e-3)}, labels)
    state = tx.init(params)
    DEFAULTS[owner]().init({"kernel": jnp.eye(3), "bias": jnp.zeros(3)})  # one matrix: nothing else it could mean
    DEFAULTS[owner]().init(jnp.eye(3))  # parameters that are one array: that array
  updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  residuals = cola.constraint_residuals(optax.apply_updates(params, updates), state)
  assert residuals["embed"]["embedding"] is not None and residuals["attention"]["bias"] is not None  # as labelled
  assert residuals["norm"]["scale"] is None


@pytest.mark.parametrize("owner", DEFAULTS)
def test_a_default_that_takes_nothing_is_an_error_showing_the_fix(owner):
  fix = re.escape(f"constraints=cola.path_constraints([(r'layer/bias$', {SPELLED[owner]})])")
  with pytest.raises(ValueError, match=f"^{owner}: not told which leaves .* have none: layer/bias. .*{fix}"):
    DEFAULTS[owner]().init({"layer": {"bias": jnp.zeros((2, 3))}})
