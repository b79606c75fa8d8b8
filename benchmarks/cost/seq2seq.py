"""The LSTM addition model of Flax's seq2seq example, small: data, model and one jitted training step.

An encoder LSTM reads ``"123+45="`` one-hot, character by character; a decoder LSTM, started from the
encoder's final carry, reads the answer with teacher forcing (``"=168"``: the first character is ``=``)
and a Dense layer predicts each next character. With hidden size 512 the two ``nn.LSTMCell`` hold eight
square ``512 x 512`` kernels (``hi``, ``hf``, ``hg``, ``ho``: hidden to gate), the leaves that
``--constraints`` makes orthonormal; the input kernels (``ii`` ...) and biases stay free.

Used by ``benchmarks.cost.retractions`` (the step under ``optax.adam`` and under
``constrained(optax.adam, Orthogonal(retraction=...))``).
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola

VOCABULARY = "0123456789+= "  # the last is padding
HIDDEN_KERNELS = r"/h[ifgo]/kernel$"  # the square hidden-to-gate kernels of every LSTMCell


def addition_batch(seed: int, batch: int, digits: int) -> tuple[np.ndarray, np.ndarray]:
  """One-hot queries ``"a+b="`` and answers ``"=c"`` (padded), ``a, b < 10**digits``."""
  rng = np.random.default_rng(seed)
  a, b = rng.integers(0, 10**digits, size=(2, batch))
  query_length, answer_length = 2 * digits + 2, digits + 2

  def encode(texts, length):
    codes = [[VOCABULARY.index(c) for c in text.ljust(length)] for text in texts]
    return np.eye(len(VOCABULARY), dtype=np.float32)[np.array(codes)]

  queries = encode([f"{x}+{y}=" for x, y in zip(a, b)], query_length)
  answers = encode([f"={x + y}" for x, y in zip(a, b)], answer_length)
  return queries, answers


class Seq2seq(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, queries, answers):
    encoder = nn.RNN(nn.LSTMCell(self.hidden), return_carry=True, name="encoder")
    carry, _ = encoder(queries)
    decoded = nn.RNN(nn.LSTMCell(self.hidden), name="decoder")(answers[:, :-1], initial_carry=carry)
    return nn.Dense(len(VOCABULARY), name="logits")(decoded)


def model_and_params(hidden: int, batch: int, digits: int):
  """The model, its parameters (the hidden kernels orthonormal) and one batch."""
  model = Seq2seq(hidden)
  queries, answers = addition_batch(0, batch, digits)
  params = model.init(jax.random.key(0), queries, answers)["params"]
  constraints = cola.path_constraints([(HIDDEN_KERNELS, cola.Orthogonal())])
  return model, cola.project_params(params, constraints), (jnp.asarray(queries), jnp.asarray(answers))


def hidden_kernels(params) -> list:
  """The leaves whose ``/``-joined key path matches ``HIDDEN_KERNELS``."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in leaves]
  return [leaf for path, (_, leaf) in zip(paths, leaves) if re.search(HIDDEN_KERNELS, path)]


def loss_fn(model, params, batch):
  queries, answers = batch
  logits = model.apply({"params": params}, queries, answers)
  return optax.softmax_cross_entropy(logits, answers[:, 1:]).mean()


def training_step(model, tx: optax.GradientTransformation):
  """``step(params, state, batch) -> (params, state, loss)``, jitted, the parameters and state donated."""

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def update_only(tx: optax.GradientTransformation):
  """``update(params, state, grads) -> (params, state)``: the optimizer alone, jitted, donated."""

  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(update, donate_argnums=(0, 1))
