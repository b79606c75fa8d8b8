"""Smoke test of benchmarks/paper/transformer_lm.py, the transformer language model (paper Table 1).

Runs without Debian's ``bible-kjv``: ``--smoke`` trains a smaller model of the same architecture on a
tiny synthetic corpus. Besides the JSON schema it checks the protocol the script declares: the
constraints per layer kind (declared on parameter paths), the settings per corpus, the merge of
runs of different methods. The corpus, model and training loop are tested in test_harness_lm.py.
"""

import json
import math

import _smoke as smoke
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cola_jax as cola

# The transformer's modules, corpus and loop are checked quickly in test_harness_lm.py; the
# script's smoke run (about 25 s of compilation) is in the slow profile.
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def lm(load_benchmark):
  return load_benchmark("paper.transformer_lm")


@pytest.fixture(scope="module")
def smoke_run(lm, tmp_path_factory):
  return smoke.run(lm, "transformer_lm", tmp_path_factory)


def test_json_schema(lm, smoke_run):
  data = smoke.report(*smoke_run, "transformer_lm", "status", "data", "published")
  assert data["status"] == "complete"
  assert data["data"]["synthetic"] is True and data["config"]["corpus_used"] == "synthetic"
  assert data["published"]["min_valid_loss"]["ptb"]["ccola_ud"] == 4.81
  assert data["published"]["min_valid_loss"]["wikitext2"]["sgdm_h0.1_m0.8"] == 5.13
  n_seeds, epochs = lm.SMOKE["seeds"], lm.SMOKE["epochs"]
  assert data["seeds"] == list(range(n_seeds))
  config = data["config"]
  assert config["epochs_completed"] == epochs and config["batch_size"] == lm.SMOKE["batch_size"]
  assert config["d_model"] == lm.SMOKE["model"]["d_model"] and config["n_layers"] == lm.MODEL["n_layers"]
  assert list(data["results"]) == list(lm.DEFAULT_METHODS)
  n_evals = 1 + math.ceil(epochs * config["steps_per_epoch"] / config["eval_every_steps"])

  for method, entry in data["results"].items():
    for key in (
      "min_valid_loss",
      "final_valid_loss",
      "test_loss_at_min_valid",
      "final_test_loss",
      "final_train_loss",
      "valid_loss_at_init",
      "min_valid_loss_epoch",
    ):
      values = entry[key]
      assert isinstance(values, list) and len(values) == n_seeds, (method, key)
      assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in values), (method, key)
    history = entry["history"]
    assert len(history["step"]) == n_evals and history["step"][-1] == epochs * config["steps_per_epoch"]
    assert history["epoch"][-1] == epochs
    for key in ("valid_loss", "test_loss", "train_loss"):
      assert np.shape(history[key]) == (n_evals, n_seeds)
    valid = np.array(history["valid_loss"])
    assert history["train_loss"][0] == [None] * n_seeds  # nothing trained at the first evaluation
    assert entry["min_valid_loss"] == list(np.min(valid[1:], axis=0))
    assert all(m <= f for m, f in zip(entry["min_valid_loss"], entry["final_valid_loss"]))
    assert data["summary"][method]["min_valid_loss_mean"] == pytest.approx(np.mean(entry["min_valid_loss"]))
    # The synthetic corpus is learnable: well below the loss at initialisation after 3 epochs.
    assert np.mean(entry["min_valid_loss"]) < np.mean(entry["valid_loss_at_init"]) - 1.0
  assert data["results"]["ccola_ud"]["hyperparameters"]["sgd_momentum_equivalent"]["learning_rate"] == pytest.approx(
    0.16
  )
  # Both methods start from the same parameters (paired seeds).
  inits = [entry["valid_loss_at_init"] for entry in data["results"].values()]
  assert inits[0] == inits[1]


def test_png_written(smoke_run):
  out, _ = smoke_run
  png = out / "transformer_lm.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_constraints_declared_by_layer_kind(lm):
  # The radii of the paper's caption on the paper-sized model: r = 0.5 for the embedding and
  # decoder, r_A = 1 for the attention kernels, r_L = 0.1 for the feed-forward kernels, r_N = 1
  # for the LayerNorm gains; biases free.
  model = lm.transformer.TransformerLM(50, **lm.MODEL)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 5), jnp.int32))["params"])
  c = lm.CONSTRAINTS(shapes)
  assert c["embedding"]["embedding"] == c["decoder"]["kernel"] == cola.Circle(0.5) and c["decoder"]["bias"] is None
  layers = c["layers"]
  assert layers["attention"]["in_proj"]["kernel"] == layers["attention"]["out_proj"]["kernel"] == cola.Circle(1.0)
  assert layers["linear1"]["kernel"] == layers["linear2"]["kernel"] == cola.Circle(0.1)
  assert layers["norm1"]["scale"] == layers["norm2"]["scale"] == cola.Circle(1.0)
  free = [b for layer in ("linear1", "linear2", "norm1", "norm2") for b in [layers[layer]["bias"]]]
  assert free == [None] * 4 and layers["attention"]["in_proj"]["bias"] is None
  assert len([x for x in jax.tree.leaves(c) if x is not None]) == 8


def test_ccola_weights_within_their_radii(lm, smoke_run):
  # Every constrained leaf of c-CoLA-ud satisfies |w| <= r, for every seed. The LayerNorm gains
  # start at the pole w = r_N = 1 of their circle, where the projected gradient is zero; the first
  # step puts them at 0.99 (a weight starting at its bound starts 1 % inside), from where they move
  # inside the circle and do not come back to the pole. SGD-m moves them too.
  _, data = smoke_run
  for kind, values in data["results"]["ccola_ud"]["max_abs_weight"].items():
    assert all(v <= lm.RADII[kind] * (1 + 1e-6) for v in values), kind
  assert sorted(data["results"]["ccola_ud"]["max_abs_weight"]) == sorted(lm.RADII)
  params = lm.LAST_RUN_PARAMS["ccola_ud"]
  constraints = lm.CONSTRAINTS(params)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  circles = jax.tree.leaves(constraints, is_leaf=lambda c: c is None)
  for (path, leaf), circle in zip(leaves, circles, strict=True):
    if circle is not None:
      assert float(jnp.max(jnp.abs(leaf))) <= circle.radius * (1 + 1e-6), jax.tree_util.keystr(path)
  for norm in ("norm1", "norm2"):
    gains = np.asarray(params["layers"][norm]["scale"])
    assert np.all(np.abs(gains) < 1.0) and np.std(gains) > 0, norm
  assert float(jnp.max(jnp.abs(lm.LAST_RUN_PARAMS["sgdm_h0.1_m0.8"]["layers"]["norm1"]["scale"] - 1))) > 1e-4


def test_merge_and_replot(lm, smoke_run, tmp_path):
  # A run split by method (as two processes on a GPU) merges back into the same results.
  _, data = smoke_run
  paths = []
  for m in data["results"]:
    part = {**data, "config": {**data["config"], "methods": [m]}, "argv": data["argv"] + ["--methods", m]}
    part.update({k: {m: data[k][m]} for k in ("methods", "results", "summary")})
    paths.append(tmp_path / f"{m}.json")
    paths[-1].write_text(json.dumps(part))
  merged = lm.main(["--merge", *map(str, paths), "--out", str(tmp_path / "merged")])
  assert json.loads((tmp_path / "merged" / "transformer_lm.json").read_text()) == merged
  assert merged["results"] == data["results"] and merged["config"] == data["config"]
  assert merged["argv"] == [data["argv"] + ["--methods", m] for m in data["results"]]
  assert (tmp_path / "merged" / "transformer_lm.png").stat().st_size > 10_000
  other = {**json.loads(paths[1].read_text()), "config": {**data["config"], "methods": ["x"], "clip": 0.0}}
  paths[1].write_text(json.dumps(other))
  with pytest.raises(ValueError, match="clip"):
    lm.main(["--merge", *map(str, paths), "--out", str(tmp_path / "bad")])
  with pytest.raises(SystemExit):
    lm.parse_args(["--merge", str(paths[0])])  # --merge needs --out
  assert lm.main(["--replot", str(tmp_path / "merged" / "transformer_lm.json")]) == merged


def test_settings_per_corpus(lm, tmp_path):
  ptb, wiki, kjv = lm.parse_args(["--corpus", "ptb"]), lm.parse_args(["--corpus", "wikitext2"]), lm.parse_args([])
  assert (ptb.batch_size, ptb.friction) == (1024, 0.5) and (wiki.batch_size, wiki.friction) == (128, 1.0)
  assert (kjv.batch_size, kjv.friction, kjv.eval_every, kjv.clip) == (128, 1.0, min(1.0, lm.DEFAULT_EPOCHS / 8), 0.25)
  assert kjv.model == lm.MODEL and kjv.out is None
  grid = lm.parse_args(["--grid"])
  assert grid.methods == lm.DEFAULT_METHODS + tuple(m for m in lm.GRID_METHODS if m not in lm.DEFAULT_METHODS)
  assert lm.PUBLISHED["ptb"]["sgdm_h0.2_m0.9"] == 4.83 and lm.PUBLISHED["wikitext2"]["sgdm_h0.2_m0.8"] == 5.14
  for bad in (["--methods", "adam"], ["--methods", "sgdm_hx_m0.8"], ["--eval-every", "0"], ["--bptt", "0"]):
    with pytest.raises(SystemExit):
      lm.parse_args(bad)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(SystemExit, match="wiki.train.tokens"):
    lm.main(["--corpus", "wikitext2", "--data-dir", str(empty), "--out", str(tmp_path), "--quiet"])
  with pytest.raises(SystemExit, match="apt-get install bible-kjv"):
    lm.main(["--data-dir", str(empty), "--out", str(tmp_path), "--quiet"])
