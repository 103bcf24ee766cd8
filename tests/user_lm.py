"""A language model as a user writes it for ``shardax train --model user_lm:factory``: plain Flax
NNX, attention of its own (no shardax blocks), tokens in, logits out. Beside it, the same model
reading packed rows (segments and positions), and factories that go wrong in the ways
``shardax train`` refuses in one line."""

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    """Pre-norm causal self-attention and an MLP, each with a residual."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, allowed: jax.Array) -> jax.Array:  # allowed: (B, T, T)
        batch, length, width = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (t.reshape(batch, length, self.heads, width // self.heads) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        scores = jnp.where(allowed[:, None], scores, jnp.finfo(scores.dtype).min)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.out(mixed.reshape(batch, length, width))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
    """Two blocks over token and learned position embeddings: ``(B, T)`` tokens -> ``(B, T, V)``."""

    def __init__(self, vocab_size: int, seq_len: int, rngs: nnx.Rngs, width: int = 32, heads: int = 2):
        self.embed = nnx.Embed(vocab_size, width, rngs=rngs)
        self.position = nnx.Embed(seq_len, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab_size, rngs=rngs)

    def logits(self, tokens: jax.Array, allowed: jax.Array, positions: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(self.norm(x))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))[None]
        return self.logits(tokens, causal, jnp.broadcast_to(jnp.arange(length), tokens.shape))


class PackedLM(TinyLM):
    """``TinyLM`` that keeps the documents of a packed row apart: each token attends to earlier
    tokens of its own document, at positions that restart with each document."""

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        if segments is None:
            return super().__call__(tokens)
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))[None]
        allowed = causal & (segments[:, :, None] == segments[:, None, :])
        return self.logits(tokens, allowed, positions)


def factory(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> TinyLM:
    return TinyLM(vocab_size, seq_len, rngs)


def packed_factory(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> PackedLM:
    return PackedLM(vocab_size, seq_len, rngs)


def failing(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> TinyLM:
    raise ValueError("width 30 does not split into 4 heads")


def not_a_module(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> dict:
    return {"embedding": jnp.zeros((vocab_size, 8))}


def wrong_shape(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> TinyLM:
    return TinyLM(vocab_size + 1, seq_len, rngs)  # one logit too many
