"""benchmarks/harness: constraint declaration by path, the shared flags, and vmapped runs."""

import argparse

import jax
import numpy as np
import optax
import pytest

import cola_jax as cola
from benchmarks.harness import cli, data, models, train

pytestmark = pytest.mark.integration


def test_mlp_paths_declare_constraints_first_rule_first():
  params = models.MLP((4, 4, 1)).init(jax.random.key(0), np.zeros((1, 3)))["params"]
  rules = cola.path_constraints([("^layer1/kernel$", cola.Orthogonal()), ("kernel", cola.Circle(0.5))])
  tree = rules(params)
  assert isinstance(tree["layer1"]["kernel"], cola.Orthogonal)
  assert tree["layer0"]["kernel"] == tree["layer2"]["kernel"] == cola.Circle(0.5)
  assert tree["layer0"]["bias"] is None and tree["layer1"]["bias"] is None
  # The declaration drives the optimizer: layer1's kernel ends orthonormal, the others in the box.
  tx = cola.cola_od(0.1, constraints=rules)
  grads = jax.tree.map(np.ones_like, params)
  params = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
  w = np.asarray(params["layer1"]["kernel"], np.float64)
  np.testing.assert_allclose(w.T @ w, np.eye(4), atol=1e-5)
  assert np.max(np.abs(params["layer0"]["kernel"])) <= 0.5 + 1e-6


def test_torch_init_bounds():
  params = models.MLP((50, 2)).init(jax.random.key(1), np.zeros((1, 16)))["params"]
  assert params["layer0"]["kernel"].shape == (16, 50)
  assert 0.2 < np.max(np.abs(params["layer0"]["kernel"])) <= 0.25  # 1 / sqrt(16)
  assert np.max(np.abs(params["layer1"]["bias"])) <= 1 / np.sqrt(50)


def test_flag_parsers():
  assert cli.int_list("1-3,8,2") == [1, 2, 3, 8]
  with pytest.raises(argparse.ArgumentTypeError, match="positive"):
    cli.int_list("0-2")
  with pytest.raises(argparse.ArgumentTypeError, match="choose from a, b"):
    cli.choices(("a", "b"))("a,c")
  assert cli.choices(("a", "b"))("b,a") == ("a", "b")


def test_member_equals_its_run_alone():
  # Seed 1 trained beside seed 0 (vmapped members) equals seed 1 trained alone, and a
  # last minibatch of 6 (70 = 4 x 16 + 6) is kept.
  dataset = data.spiral(70, 40, seed=3)
  model = models.MLP((8, 1))

  def run(seeds):
    r = train.Run(
      init_params=lambda key, member: model.init(key, dataset.x_train[:1])["params"],
      apply_fn=lambda p, x: model.apply({"params": p}, x),
      make_tx=lambda member, key: optax.sgd(0.1, momentum=0.9),
      objective=train.BINARY,
      data=dataset,
      members={"seed": np.array(seeds)},
      batch_size=16,
      eval_every=2,
    )
    train.train({"run": r}, 4)
    return r

  both, alone = run([0, 1]), run([1])
  assert both.steps_per_epoch == 5 and both.last_batch_size == 6
  np.testing.assert_allclose(both.rows([1])["train_loss"], alone.rows([0])["train_loss"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a[1], b[0], rtol=1e-5, atol=1e-6), both.params, alone.params)
  assert both.history["epoch"] == [2, 4]


def test_param_path_is_the_path_path_constraints_matches():
  params = models.MLP((4, 1)).init(jax.random.key(0), np.zeros((1, 3)))["params"]
  paths = [models.param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert paths == ["layer0/bias", "layer0/kernel", "layer1/bias", "layer1/kernel"]
  tree = cola.path_constraints([("^layer1/kernel$", cola.Circle(0.5))])(params)
  assert jax.tree.leaves(tree) == [cola.Circle(0.5)]
