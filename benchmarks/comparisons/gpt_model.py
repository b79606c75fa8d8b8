"""The GPT of ``gpt.py``: a causal language model of pre-norm Flax NNX blocks around ``nnx.MultiHeadAttention``,
and the functional face the harness's LM loop (:class:`benchmarks.harness.lm.LMRun`) trains: ``init`` and
``apply`` on the parameters as a plain dict (``blocks/0/attention/query/kernel``, ...)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  """``x + attention(norm(x))``, then ``x + down(gelu(up(norm(x))))``; attention kernels ``(width, heads,
  width / heads)`` (query, key, value) and ``(heads, width / heads, width)`` (out)."""

  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, width, decode=False, keep_rngs=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class GPT(nnx.Module):
  """Token and learned position embeddings, ``blocks`` blocks, a final LayerNorm and the output layer ``head``."""

  def __init__(self, vocab: int, length: int, width: int, heads: int, blocks: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.position_embed = nnx.Embed(length, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(blocks)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.position_embed(jnp.arange(tokens.shape[-1]))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


@dataclasses.dataclass(frozen=True)
class FunctionalGPT:
  """:class:`GPT` as the harness calls a Flax linen model: ``init({"params": key}, tokens)`` and
  ``apply({"params": params}, tokens, deterministic=..., rngs=...)`` (no dropout: both flags are unused)."""

  vocab: int
  length: int
  width: int = 128
  heads: int = 4
  blocks: int = 4

  def module(self, key) -> GPT:
    return GPT(self.vocab, self.length, self.width, self.heads, self.blocks, rngs=nnx.Rngs(key))

  @functools.cached_property
  def _skeleton(self):
    return nnx.split(nnx.eval_shape(lambda: self.module(jax.random.key(0))))

  def init(self, rngs, tokens) -> dict:
    del tokens  # the shapes follow from the configuration
    return {"params": nnx.to_pure_dict(nnx.state(self.module(rngs["params"]), nnx.Param))}

  def apply(self, variables, tokens, deterministic: bool = True, rngs=None):
    del deterministic, rngs
    graphdef, state = self._skeleton
    state = jax.tree.map(lambda x: x, state)  # a copy to fill, the skeleton kept abstract
    nnx.replace_by_pure_dict(state, variables["params"])
    return nnx.merge(graphdef, state)(tokens)
