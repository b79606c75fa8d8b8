"""Smoke test of benchmarks/transformer_lm.py, the transformer language model (paper Table 1).

Runs without Debian's ``bible-kjv``: ``--smoke`` trains on a tiny synthetic
corpus. Besides the JSON schema it checks the mathematics of the script: the
causal mask, the loss at initialisation, the circle constraints per layer
kind, the batching of the token stream and the tokenizer.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def lm(load_benchmark):
  return load_benchmark("transformer_lm")


@pytest.fixture(scope="module")
def smoke_run(lm, tmp_path_factory):
  out = tmp_path_factory.mktemp("transformer_lm")
  returned = lm.main(["--smoke", "--out", str(out), "--quiet"])
  return out, returned


@pytest.fixture(scope="module")
def tiny(lm):
  """A small model of the same architecture (2 layers, 2 heads), its parameters, and jitted logits."""
  config = lm.Config(d_model=16, d_ff=12, n_heads=2, n_layers=2)
  apply = jax.jit(lambda params, tokens, key=None: lm.transformer(params, tokens, config, key))
  return config, lm.init_transformer(jax.random.key(3), 23, config), apply


def test_json_schema(lm, smoke_run):
  out, returned = smoke_run
  data = json.loads((out / "transformer_lm.json").read_text())
  assert data == json.loads(json.dumps(returned))
  for key in (
    "schema_version",
    "status",
    "config",
    "data",
    "methods",
    "seeds",
    "results",
    "summary",
    "published",
    "command",
    "argv",
    "date",
    "machine",
    "versions",
    "wall_time_s",
  ):
    assert key in data, key
  assert data["status"] == "complete" and data["argv"][0] == "--smoke"
  assert data["data"]["synthetic"] is True and data["config"]["corpus_used"] == "synthetic"
  assert data["published"]["min_valid_loss"]["ptb"]["ccola_ud"] == 4.81
  assert data["published"]["min_valid_loss"]["wikitext2"]["sgdm_h0.1_m0.8"] == 5.13
  n_seeds, epochs = lm.SMOKE["seeds"], lm.SMOKE["epochs"]
  assert data["seeds"] == list(range(n_seeds))
  config = data["config"]
  assert config["epochs_completed"] == epochs and config["batch_size"] == lm.SMOKE["batch_size"]
  assert list(data["results"]) == list(lm.DEFAULT_METHODS)
  schedule = lm.eval_schedule(epochs * config["steps_per_epoch"], config["eval_every_steps"])

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
    assert history["step"] == list(np.cumsum(schedule)) and history["epoch"][-1] == epochs
    for key in ("valid_loss", "test_loss", "train_loss"):
      assert np.shape(history[key]) == (len(schedule), n_seeds)
    valid = np.array(history["valid_loss"])
    assert history["train_loss"][0] == [None] * n_seeds  # nothing trained at the first evaluation
    assert entry["min_valid_loss"] == list(np.min(valid[1:], axis=0))
    assert all(m <= f for m, f in zip(entry["min_valid_loss"], entry["final_valid_loss"]))
    assert data["summary"][method]["min_valid_loss_mean"] == pytest.approx(np.mean(entry["min_valid_loss"]))
    # The synthetic corpus is learnable: well below the loss at initialisation after 3 epochs.
    assert np.mean(entry["min_valid_loss"]) < np.mean(entry["valid_loss_at_init"]) - 1.0
  # Both methods start from the same parameters (paired seeds).
  inits = [entry["valid_loss_at_init"] for entry in data["results"].values()]
  assert inits[0] == inits[1]


def test_png_written(smoke_run):
  out, _ = smoke_run
  png = out / "transformer_lm.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_ccola_weights_within_their_radii(lm, smoke_run):
  # Every constrained leaf of c-CoLA-ud satisfies |w| <= r of its layer kind, for every seed;
  # the LayerNorm gains start at the pole w = r_N = 1 of their circle, where the projected
  # gradient is zero, so at tau = 0 they stay exactly 1. SGD-m moves them.
  _, data = smoke_run
  for kind, values in data["results"]["ccola_ud"]["max_abs_weight"].items():
    assert all(v <= lm.RADII[kind] * (1 + 1e-6) for v in values), kind
  params = lm.LAST_RUN_PARAMS["ccola_ud"]
  checked = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    kind = lm.layer_kind(path)
    if kind is not None:
      assert float(jnp.max(jnp.abs(leaf))) <= lm.RADII[kind] * (1 + 1e-6), jax.tree_util.keystr(path)
      checked += 1
  assert checked == 8  # embedding, decoder; attention in/out, linear1, linear2, 2 norms (layers stacked)
  np.testing.assert_array_equal(np.asarray(params["layers"]["norm1"]["scale"]), 1.0)
  np.testing.assert_array_equal(np.asarray(params["layers"]["norm2"]["scale"]), 1.0)
  assert float(jnp.max(jnp.abs(lm.LAST_RUN_PARAMS["sgdm_h0.1_m0.8"]["layers"]["norm1"]["scale"] - 1))) > 1e-4


def test_radius_assignment(lm, tiny):
  _, params, _ = tiny
  radii = lm.radius_tree(params, lm.RADII)
  assert radii["embedding"]["weight"] == radii["decoder"]["kernel"] == 0.5
  assert radii["decoder"]["bias"] is None
  layers = radii["layers"]
  assert layers["attention"]["in_kernel"] == layers["attention"]["out_kernel"] == 1.0
  assert layers["attention"]["in_bias"] is None and layers["attention"]["out_bias"] is None
  assert layers["linear1"]["kernel"] == layers["linear2"]["kernel"] == 0.1
  assert layers["linear1"]["bias"] is None and layers["norm1"]["bias"] is None
  assert layers["norm1"]["scale"] == layers["norm2"]["scale"] == 1.0
  # At the paper's size PyTorch's initialisation lies inside every interval (1/sqrt(200) < r_L),
  # so nothing is clipped at the start.
  full = lm.init_transformer(jax.random.key(0), 50, lm.Config())
  for path, leaf in jax.tree_util.tree_flatten_with_path(full)[0]:
    if lm.layer_kind(path) is not None:
      assert float(jnp.max(jnp.abs(leaf))) <= lm.RADII[lm.layer_kind(path)], jax.tree_util.keystr(path)
  # The two encoder layers start identical (nn.TransformerEncoder deep-copies one layer).
  for leaf in jax.tree.leaves(params["layers"]):
    np.testing.assert_array_equal(leaf[0], leaf[1])


def test_causal_mask(tiny):
  # The logits at position t depend on tokens 0..t only: changing the tokens after t changes
  # nothing before t + 1, and the Jacobian of the logits at t with respect to the input
  # embeddings of later positions is zero; position t does depend on token t.
  _, params, apply = tiny
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 23, (3, 9)), jnp.int32)
  base = apply(params, tokens)
  for t in range(9):
    changed = tokens.at[:, t:].set((tokens[:, t:] + 1 + t) % 23)
    logits = apply(params, changed)
    np.testing.assert_allclose(logits[:, :t], base[:, :t], rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(logits[:, t] - base[:, t]))) > 1e-3

  def logits_at(embedding, t):
    p = {**params, "embedding": {"weight": embedding}}
    return jnp.sum(apply(p, tokens)[:, t])

  grad = jax.jit(jax.grad(logits_at), static_argnums=1)(params["embedding"]["weight"], 4)
  later = np.unique(np.asarray(tokens[:, 5:]))
  earlier = np.unique(np.asarray(tokens[:, :5]))
  only_later = np.setdiff1d(later, earlier)
  assert only_later.size > 0
  np.testing.assert_array_equal(np.asarray(grad)[only_later], 0.0)
  assert float(jnp.max(jnp.abs(grad[earlier]))) > 0


def test_dropout_only_with_a_key(tiny):
  _, params, apply = tiny
  tokens = jnp.arange(18, dtype=jnp.int32).reshape(2, 9) % 23
  plain = apply(params, tokens)
  np.testing.assert_array_equal(plain, apply(params, tokens))
  a = apply(params, tokens, jax.random.key(0))
  b = apply(params, tokens, jax.random.key(1))
  assert float(jnp.max(jnp.abs(a - b))) > 1e-3 and float(jnp.max(jnp.abs(a - plain))) > 1e-3


def test_loss_at_init_is_about_log_vocab(lm):
  # Decoder weights U(-0.1, 0.1) on LayerNorm outputs of unit variance: logits of variance
  # about d 0.01 / 3 = 0.67 at d = 200, so the loss is log V + ~0.33 (the log-normal correction).
  config = lm.Config()
  vocab = 1000
  params = lm.init_transformer(jax.random.key(0), vocab, config)
  tokens = jax.random.randint(jax.random.key(1), (4, 35), 0, vocab)
  targets = jax.random.randint(jax.random.key(2), (4, 35), 0, vocab)
  loss = float(jnp.mean(jax.jit(lambda p: lm.token_losses(p, tokens, targets, config))(params)))
  assert math.log(vocab) < loss < math.log(vocab) + 0.6


def test_windows_follow_batchify(lm):
  # 2 columns of a 23-token stream: rows = 11, windows of 4 -> 3 windows (4, 4, 2 real rows).
  ids = np.arange(23, dtype=np.int32)
  inputs, targets, weights = (np.asarray(a) for a in lm.windows(ids, 2, 4))
  assert inputs.shape == targets.shape == weights.shape == (3, 2, 4)
  np.testing.assert_array_equal(inputs[0], [[0, 1, 2, 3], [11, 12, 13, 14]])
  np.testing.assert_array_equal(targets[0], [[1, 2, 3, 4], [12, 13, 14, 15]])
  np.testing.assert_array_equal(inputs[2][:, :2], [[8, 9], [19, 20]])
  np.testing.assert_array_equal(targets[2][:, :2], [[9, 10], [20, 21]])
  np.testing.assert_array_equal(weights[:, 0], [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
  assert weights.sum() == 2 * 10  # every token of each column but its last is predicted once
  assert lm.eval_schedule(10, 4) == [0, 4, 4, 2]


def test_tokenizer_and_vocab_round_trip(lm):
  line = "And the LORD's word came unto Abram, saying: Fear not; (I am thy shield.) 'Tis the fathers' land?"
  tokens = lm.tokenize(line)
  assert tokens == [
    "and",
    "the",
    "lord",
    "'s",
    "word",
    "came",
    "unto",
    "abram",
    ",",
    "saying",
    ":",
    "fear",
    "not",
    ";",
    "(",
    "i",
    "am",
    "thy",
    "shield",
    ".",
    ")",
    "'",
    "tis",
    "the",
    "fathers",
    "'",
    "land",
    "?",
  ]
  assert lm.tokenize(" ".join(tokens)) == tokens  # idempotent: the tokens are the corpus's words
  assert "".join(tokens) == "".join(line.lower().split())  # nothing dropped but spaces
  vocab = lm.Vocab.from_tokens([tokens, ["the", "the", "unto"]], cap=6)
  assert vocab.words[:2] == ["<eos>", "<unk>"] and len(vocab) == 6 and vocab.words[2] == "the"
  ids = vocab.encode([tokens])
  assert ids[-1] == vocab.index["<eos>"] and len(ids) == len(tokens) + 1
  decoded = vocab.decode(ids[:-1])
  assert [t if t in vocab.index else "<unk>" for t in tokens] == decoded
  full = lm.Vocab.from_tokens([tokens])
  assert full.decode(full.encode([tokens])[:-1]) == tokens


def test_kjv_split_and_missing_corpus(lm, tmp_path):
  verses = [f"verse {i}" for i in range(4000)]
  train, valid, test = lm.split_kjv(verses)
  assert (len(train), len(valid), len(test)) == (3600, 200, 200)
  assert valid[:2] == ["verse 1800", "verse 1801"] and test[0] == "verse 1900" and train[1800] == "verse 2000"
  (tmp_path / "kjv.txt").write_text(
    "Ge1:1 In the beginning God created the heaven and the earth.\nGe1:2 And the earth was without form, and void.\n"
  )
  assert lm.kjv_verses(str(tmp_path)) == [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
  ]
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="apt-get install bible-kjv"):
    lm.make_corpus("kjv", str(empty))
  with pytest.raises(FileNotFoundError, match="ptb.train.txt"):
    lm.make_corpus("ptb", str(empty))
  with pytest.raises(SystemExit, match="wiki.train.tokens"):
    lm.main(["--corpus", "wikitext2", "--data-dir", str(empty), "--out", str(tmp_path), "--quiet"])


def test_ptb_files(lm, tmp_path):
  # PTB-format files: whitespace tokens, <eos> per line, vocabulary from the training file,
  # unseen validation words become <unk>.
  (tmp_path / "ptb.train.txt").write_text(" a b <unk> c\n b a\n")
  (tmp_path / "ptb.valid.txt").write_text(" a z\n")
  (tmp_path / "ptb.test.txt").write_text(" c\n")
  train, valid, test, vocab, info = lm.make_corpus("ptb", str(tmp_path))
  assert vocab.decode(train) == ["a", "b", "<unk>", "c", "<eos>", "b", "a", "<eos>"]
  assert vocab.decode(valid) == ["a", "<unk>", "<eos>"] and vocab.decode(test) == ["c", "<eos>"]
  assert info["tokens"] == {"train": 8, "valid": 3, "test": 2} and info["vocab_size"] == 5


def test_settings_per_corpus(lm):
  _, ptb = lm.parse_args(["--corpus", "ptb"])
  _, wiki = lm.parse_args(["--corpus", "wikitext2"])
  _, kjv = lm.parse_args([])
  assert (ptb.batch_size, ptb.friction) == (1024, 0.5) and (wiki.batch_size, wiki.friction) == (128, 1.0)
  assert kjv.eval_every == min(1.0, lm.DEFAULT_EPOCHS / 8) and kjv.clip == 0.25
  _, grid = lm.parse_args(["--grid"])
  assert grid.methods == lm.DEFAULT_METHODS + tuple(m for m in lm.GRID_METHODS if m not in lm.DEFAULT_METHODS)
  with pytest.raises(SystemExit):
    lm.parse_args(["--methods", "adam"])
