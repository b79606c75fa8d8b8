"""Two transformer clients written as their frameworks' examples write them, for the tests of the defaults.

``nnx_gpt``: the JAX AI Stack's miniGPT in Flax NNX (``nnx.Embed`` for tokens and positions,
``nnx.MultiHeadAttention``, ``nnx.LayerNorm``, ``nnx.Linear``). ``equinox_gpt``: a character GPT as
Equinox's examples write one (``eqx.nn.Embedding`` called ``wte``/``wpe``, ``eqx.nn.MultiheadAttention``,
``eqx.nn.LayerNorm``, ``eqx.nn.Linear``). Both at any depth; construction only costs milliseconds, so the
warnings' tests can build 24 blocks.
"""

import jax
import jax.numpy as jnp


def nnx_gpt(depth: int = 2, width: int = 32, heads: int = 4, vocab: int = 64, length: int = 16, seed: int = 0):
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False, rngs=rngs)
      self.norm1 = nnx.LayerNorm(width, rngs=rngs)
      self.up = nnx.Linear(width, 4 * width, rngs=rngs)
      self.down = nnx.Linear(4 * width, width, rngs=rngs)
      self.norm2 = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x, mask):
      x = self.norm1(x + self.attention(x, mask=mask))
      return self.norm2(x + self.down(jax.nn.gelu(self.up(x))))

  class MiniGPT(nnx.Module):
    def __init__(self, rngs):
      self.token_embedding = nnx.Embed(vocab, width, rngs=rngs)
      self.position_embedding = nnx.Embed(length, width, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
      self.output_layer = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
      x = self.token_embedding(tokens) + self.position_embedding(jnp.arange(tokens.shape[-1]))
      mask = nnx.make_causal_mask(tokens)
      for block in self.blocks:
        x = block(x, mask)
      return self.output_layer(x)

  return MiniGPT(nnx.Rngs(seed))


def equinox_gpt(depth: int = 2, width: int = 32, heads: int = 4, vocab: int = 64, length: int = 16, seed: int = 0):
  import equinox as eqx

  class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm

    def __init__(self, key):
      k1, k2, k3 = jax.random.split(key, 3)
      self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
      self.norm1 = eqx.nn.LayerNorm(width)
      self.up = eqx.nn.Linear(width, 4 * width, key=k2)
      self.down = eqx.nn.Linear(4 * width, width, key=k3)
      self.norm2 = eqx.nn.LayerNorm(width)

    def __call__(self, x):
      mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
      x = jax.vmap(self.norm1)(x + self.attention(x, x, x, mask=mask))
      return jax.vmap(self.norm2)(x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x))))

  class GPT(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    blocks: list
    lm_head: eqx.nn.Linear

    def __init__(self, key):
      keys = jax.random.split(key, depth + 3)
      self.wte = eqx.nn.Embedding(vocab, width, key=keys[0])
      self.wpe = eqx.nn.Embedding(length, width, key=keys[1])
      self.blocks = [Block(k) for k in keys[2:-1]]
      self.lm_head = eqx.nn.Linear(width, vocab, use_bias=False, key=keys[-1])

    def __call__(self, tokens):
      x = jax.vmap(self.wte)(tokens) + jax.vmap(self.wpe)(jnp.arange(tokens.shape[0]))
      for block in self.blocks:
        x = block(x)
      return jax.vmap(self.lm_head)(x)

  return GPT(jax.random.key(seed))
