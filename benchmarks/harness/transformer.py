"""A causal transformer language model in Flax linen, PyTorch's ``word_language_model`` ``TransformerModel``.

Embedding ``U(-0.1, 0.1)`` scaled by ``sqrt(d_model)``, sinusoidal positional
encoding, ``n_layers`` post-norm encoder layers (causal multi-head
self-attention, ReLU feed-forward, LayerNorm eps 1e-5) and a linear decoder
``U(-0.1, 0.1)`` with bias 0. Dropout after the positional encoding, on the
attention weights, after attention, inside and after the feed-forward network.
Initialisation as PyTorch's: ``nn.MultiheadAttention`` (Xavier-uniform
``in_proj``, ``out_proj`` ``U(+-1/sqrt(d))``, zero biases), ``nn.Linear`` and
``nn.LayerNorm``; the encoder layers are stacked on a leading axis of their
parameters and start identical, because ``nn.TransformerEncoder`` deep-copies
one layer. Parameter paths, for declaring constraints::

    embedding/embedding, decoder/{kernel,bias},
    layers/attention/{in_proj,out_proj}/{kernel,bias},
    layers/{linear1,linear2}/{kernel,bias}, layers/{norm1,norm2}/{scale,bias}

With ``scan_layers=False`` each layer is a module of its own, ``block_0`` to
``block_{n_layers-1}`` in place of ``layers`` (the layout of a model written
with a Python loop: one leaf per layer and kind, each initialised
independently).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from .models import torch_uniform


def positional_encoding(length: int, d: int) -> jax.Array:
  """``pe[t, 2i] = sin(t / 10000^(2i/d))``, ``pe[t, 2i+1] = cos(...)``."""
  pos = np.arange(length)[:, None]
  freq = np.exp(-math.log(10000.0) * np.arange(0, d, 2) / d)
  pe = np.zeros((length, d), np.float32)
  pe[:, 0::2], pe[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq)
  return jnp.asarray(pe)


def _uniform(bound: float):
  """``U(-bound, bound)``."""
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention on ``(batch, time, d)`` where position ``t`` sees ``0..t`` only."""

  n_heads: int
  dropout: float
  deterministic: bool

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    xavier = math.sqrt(6.0 / (d + 3 * d))  # PyTorch's in_proj_weight is (3d, d)
    qkv = nn.Dense(3 * d, kernel_init=_uniform(xavier), bias_init=nn.initializers.zeros, name="in_proj")(x)
    q, k, v = jnp.moveaxis(qkv.reshape(b, t, 3, self.n_heads, d // self.n_heads), 2, 0)
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // self.n_heads)
    weights = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf), axis=-1)
    weights = nn.Dropout(self.dropout)(weights, deterministic=self.deterministic)
    out = jnp.einsum("bhqk,bkhc->bqhc", weights, v).reshape(b, t, d)
    return nn.Dense(d, kernel_init=torch_uniform(d), bias_init=nn.initializers.zeros, name="out_proj")(out)


class EncoderLayer(nn.Module):
  """Post-norm: ``x = norm1(x + attention(x))``, ``x = norm2(x + linear2(relu(linear1(x))))``."""

  n_heads: int
  d_ff: int
  dropout: float
  deterministic: bool

  @nn.compact
  def __call__(self, x, _):
    d = x.shape[-1]
    drop = lambda y: nn.Dropout(self.dropout)(y, deterministic=self.deterministic)
    norm = lambda name: nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name=name)
    dense = lambda width, fan_in, name: nn.Dense(
      width, kernel_init=torch_uniform(fan_in), bias_init=torch_uniform(fan_in), name=name
    )
    x = norm("norm1")(
      x + drop(CausalSelfAttention(self.n_heads, self.dropout, self.deterministic, name="attention")(x))
    )
    hidden = drop(nn.relu(dense(self.d_ff, d, "linear1")(x)))
    return norm("norm2")(x + drop(dense(d, self.d_ff, "linear2")(hidden))), None


class TransformerLM(nn.Module):
  """Logits ``(batch, time, vocab_size)`` of tokens ``(batch, time)``; dropout (rng ``"dropout"``)
  unless ``deterministic``."""

  vocab_size: int
  d_model: int = 200
  n_heads: int = 2
  d_ff: int = 200
  n_layers: int = 2
  dropout: float = 0.2
  scan_layers: bool = True  # False: blocks block_0 ... block_{n-1}, each with its own parameters

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    if self.d_model % self.n_heads or self.d_model % 2:
      raise ValueError(f"d_model = {self.d_model} must be even and divisible by n_heads = {self.n_heads}")
    embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=_uniform(0.1), name="embedding")
    x = embed(tokens) * math.sqrt(self.d_model) + positional_encoding(tokens.shape[-1], self.d_model)
    x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
    if self.scan_layers:
      layers = nn.scan(
        EncoderLayer,
        variable_axes={"params": 0},
        split_rngs={"params": False, "dropout": True},
        length=self.n_layers,
      )(self.n_heads, self.d_ff, self.dropout, deterministic, name="layers")
      x, _ = layers(x, None)
    else:
      for i in range(self.n_layers):
        x, _ = EncoderLayer(self.n_heads, self.d_ff, self.dropout, deterministic, name=f"block_{i}")(x, None)
    return nn.Dense(self.vocab_size, kernel_init=_uniform(0.1), bias_init=nn.initializers.zeros, name="decoder")(x)
