"""benchmarks/harness text.py, transformer.py, lm.py, perplexity.py: corpora, the Flax transformer
language model, its training loop and its results."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks.harness import lm, perplexity, text, transformer

pytestmark = pytest.mark.integration

TINY = transformer.TransformerLM(23, d_model=16, n_heads=2, d_ff=12, n_layers=2)


@pytest.fixture(scope="module")
def tiny():
  """The tiny model's parameters and its jitted logits (dropout with a key, none without)."""
  params = jax.tree.map(lambda a: a[0], lm.init_params(TINY, (3,), 9))

  @jax.jit
  def apply(params, tokens, key):
    plain = TINY.apply({"params": params}, tokens)
    return plain, TINY.apply({"params": params}, tokens, deterministic=False, rngs={"dropout": key})

  return params, apply


def test_causal_mask_and_dropout(tiny):
  # The logits at position t depend on tokens 0..t only: changing the tokens from t on changes
  # nothing before t and changes position t. Dropout acts only when asked, with the key's masks.
  params, apply = tiny
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 23, (3, 9)), jnp.int32)
  changed = jnp.stack([tokens.at[:, t:].set((tokens[:, t:] + 1 + t) % 23) for t in range(9)])
  keys = jax.random.split(jax.random.key(0), 2)
  batch = jnp.concatenate([tokens[None], changed, tokens[None]]).reshape(-1, 9)
  plain, dropped = apply(params, batch, keys[0])
  base, plain = plain[:3], plain[3:-3].reshape(9, 3, 9, 23)
  for t in range(9):
    np.testing.assert_allclose(plain[t, :, :t], base[:, :t], rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(plain[t, :, t] - base[:, t]))) > 1e-3
  np.testing.assert_array_equal(dropped[:3], apply(params, batch, keys[0])[1][:3])
  assert float(jnp.max(jnp.abs(dropped[:3] - apply(params, batch, keys[1])[1][:3]))) > 1e-3
  assert float(jnp.max(jnp.abs(dropped[:3] - base))) > 1e-3
  np.testing.assert_array_equal(dropped[:3][:, :0], base[:, :0])


def test_pytorch_initialisation(tiny):
  # Both encoder layers start identical (nn.TransformerEncoder deep-copies one layer); the bounds
  # are PyTorch's: U(-0.1, 0.1) embedding and decoder, Xavier in_proj, 1/sqrt(fan_in) elsewhere.
  params, _ = tiny
  for leaf in jax.tree.leaves(params["layers"]):
    np.testing.assert_array_equal(leaf[0], leaf[1])
  layers, d = params["layers"], 16
  bounds = {
    "embedding": (params["embedding"]["embedding"], 0.1),
    "decoder": (params["decoder"]["kernel"], 0.1),
    "in_proj": (layers["attention"]["in_proj"]["kernel"], math.sqrt(6 / (4 * d))),
    "out_proj": (layers["attention"]["out_proj"]["kernel"], 1 / math.sqrt(d)),
    "linear1": (layers["linear1"]["kernel"], 1 / math.sqrt(d)),
    "linear2 bias": (layers["linear2"]["bias"], 1 / math.sqrt(12)),
  }
  for name, (w, bound) in bounds.items():
    assert 0.6 * bound < float(jnp.max(jnp.abs(w))) <= bound, name
  zeros = [params["decoder"]["bias"], layers["attention"]["in_proj"]["bias"], layers["norm1"]["bias"]]
  assert all(float(jnp.max(jnp.abs(z))) == 0 for z in zeros)
  np.testing.assert_array_equal(layers["norm2"]["scale"], 1.0)


def test_loss_at_init_is_about_log_vocab():
  # Decoder weights U(-0.1, 0.1) on LayerNorm outputs of unit variance: logits of variance about
  # d 0.01 / 3 = 0.67 at d = 200, so the loss is log V + ~0.33 (the log-normal correction).
  vocab = 1000
  model = transformer.TransformerLM(vocab)
  tokens, targets = (jax.random.randint(jax.random.key(i), (4, 35), 0, vocab) for i in (1, 2))

  params = jax.tree.map(lambda a: a[0], lm.init_params(model, (0,), 35))
  logits = jax.jit(model.apply)({"params": params}, tokens)
  loss = float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets)))
  assert math.log(vocab) < loss < math.log(vocab) + 0.6


def test_windows_follow_batchify():
  # 2 columns of a 23-token stream: rows = 11, windows of 4 -> 3 windows (4, 4, 2 real rows).
  inputs, targets, weights = (np.asarray(a) for a in text.windows(np.arange(23, dtype=np.int32), 2, 4))
  assert inputs.shape == targets.shape == weights.shape == (3, 2, 4)
  np.testing.assert_array_equal(inputs[0], [[0, 1, 2, 3], [11, 12, 13, 14]])
  np.testing.assert_array_equal(targets[0], [[1, 2, 3, 4], [12, 13, 14, 15]])
  np.testing.assert_array_equal(inputs[2][:, :2], [[8, 9], [19, 20]])
  np.testing.assert_array_equal(targets[2][:, :2], [[9, 10], [20, 21]])
  np.testing.assert_array_equal(weights[:, 0], [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
  assert weights.sum() == 2 * 10  # every token of each column but its last is predicted once
  assert lm.eval_schedule(10, 4) == [0, 4, 4, 2]
  with pytest.raises(ValueError, match="too few"):
    text.windows(np.arange(3), 2, 4)


def test_tokenizer_and_vocab_round_trip():
  line = "And the LORD's word came unto Abram, saying: Fear not; (I am thy shield.) 'Tis the fathers' land?"
  tokens = text.tokenize(line)
  assert tokens[:11] == ["and", "the", "lord", "'s", "word", "came", "unto", "abram", ",", "saying", ":"]
  assert tokens[14:] == ["(", "i", "am", "thy", "shield", ".", ")", "'", "tis", "the", "fathers", "'", "land", "?"]
  assert text.tokenize(" ".join(tokens)) == tokens  # idempotent: the tokens are the corpus's words
  assert "".join(tokens) == "".join(line.lower().split())  # nothing dropped but spaces
  vocab = text.Vocab.from_tokens([tokens, ["the", "the", "unto"]], cap=6)
  assert vocab.words[:2] == ["<eos>", "<unk>"] and len(vocab) == 6 and vocab.words[2] == "the"
  ids = vocab.encode([tokens])
  assert ids[-1] == vocab.index["<eos>"] and len(ids) == len(tokens) + 1
  assert [t if t in vocab.index else "<unk>" for t in tokens] == vocab.decode(ids[:-1])
  full = text.Vocab.from_tokens([tokens])
  assert full.decode(full.encode([tokens])[:-1]) == tokens
  with pytest.raises(ValueError, match="duplicate"):
    text.Vocab(["a", "a"])


def test_kjv_split_and_files(tmp_path):
  train, valid, test = text.split_kjv([f"verse {i}" for i in range(4000)])
  assert (len(train), len(valid), len(test)) == (3600, 200, 200)
  assert valid[:2] == ["verse 1800", "verse 1801"] and test[0] == "verse 1900" and train[1800] == "verse 2000"
  (tmp_path / "kjv.txt").write_text(
    "Ge1:1 In the beginning God created the heaven and the earth.\nGe1:2 And the earth was without form, and void.\n"
  )
  assert text.kjv_verses(str(tmp_path)) == [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
  ]
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="apt-get install bible-kjv"):
    text.corpus("kjv", str(empty))
  with pytest.raises(FileNotFoundError, match="ptb.train.txt"):
    text.corpus("ptb", str(empty))
  with pytest.raises(ValueError, match="corpus must be one of"):
    text.corpus("imdb", str(empty))


def test_ptb_files(tmp_path):
  # PTB-format files: whitespace tokens, <eos> per line, vocabulary from the training file,
  # unseen validation words become <unk>.
  (tmp_path / "ptb.train.txt").write_text(" a b <unk> c\n b a\n")
  (tmp_path / "ptb.valid.txt").write_text(" a z\n")
  (tmp_path / "ptb.test.txt").write_text(" c\n")
  train, valid, test, vocab, info = text.corpus("ptb", str(tmp_path))
  assert vocab.decode(train) == ["a", "b", "<unk>", "c", "<eos>", "b", "a", "<eos>"]
  assert vocab.decode(valid) == ["a", "<unk>", "<eos>"] and vocab.decode(test) == ["c", "<eos>"]
  assert info["tokens"] == {"train": 8, "valid": 3, "test": 2} and info["vocab_size"] == 5
  assert info["unk_fraction"]["valid"] == pytest.approx(1 / 3)


def test_run_losses_and_entry():
  # Two seeds of SGD on a 1-layer model: the held-out losses at initialisation are the token means
  # over the windows (padding excluded), the seeds differ, and the entry takes each seed's minimum
  # over the evaluations after the first.
  corpus = text.corpus("kjv", synthetic=True)
  data = (text.windows(corpus.train[:400], 4, 7), *(text.windows(ids, 3, 7) for ids in (corpus.valid, corpus.test)))
  model = transformer.TransformerLM(len(corpus.vocab), d_model=8, n_heads=2, d_ff=8, n_layers=1, dropout=0.1)
  run = lm.LMRun(model=model, tx=optax.sgd(0.5), data=data, seeds=[0, 1], probes=perplexity.max_abs({"d": "decoder"}))
  run.compile(lm.QUICK_COMPILE)
  for n in lm.eval_schedule(2 * run.steps_per_epoch, run.steps_per_epoch):
    run.advance(n)
  assert run.steps == [0, run.steps_per_epoch, 2 * run.steps_per_epoch]
  valid = np.stack(run.history["valid_loss"])
  params = jax.tree.map(lambda a: a[0], lm.init_params(model, (0, 1), 7))
  x, y, w = data[1]
  logits = jax.jit(jax.vmap(lambda xb: model.apply({"params": params}, xb)))(x)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  assert valid[0, 0] == pytest.approx(float(jnp.sum(losses * w) / jnp.sum(w)), rel=1e-5)
  assert valid[0, 0] != valid[0, 1] and np.all(valid[-1] < valid[0] - 0.1)
  entry = perplexity.entry(run)
  assert entry["min_valid_loss"] == pytest.approx(list(valid[1:].min(axis=0)))
  assert entry["history"]["epoch"] == [0, 1, 2] and entry["history"]["train_loss"][0] == [None, None]
  decoder = run.params["decoder"]["kernel"]
  assert entry["max_abs_weight"]["d"] == pytest.approx([float(jnp.max(jnp.abs(k))) for k in decoder])
  assert set(perplexity.summary(entry)) == {f"{k}_{s}" for k in perplexity.KEYS for s in ("mean", "std")}
