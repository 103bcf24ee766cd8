"""Decoder LMs written the ways open model zoos write them (our own code, in their styles), tiny.

- ``LlamaStyle``: separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and ``gate_proj``/``up_proj``/
  ``down_proj`` (``nnx.Linear``), grouped-query attention (4 query heads, 2 kv heads), RMSNorm,
  rotary positions, SwiGLU, an untied ``lm_head``, optional q/k/v biases (Qwen2), no annotations.
- ``GemmaStyle``: einsum weights (``[heads, d_model, head_dim]`` queries, ``[2, kv_heads, d_model,
  head_dim]`` keys and values in one array, ``[2, d_model, hidden]`` gate and up), one embedding
  table used for the lookup and for the logits (tied), no annotations.
- ``SwitchStyle``: attention from one ``[3, d_model, heads, head_dim]`` einsum weight, then a mixture
  of experts as GShard and Switch write it: a router, one-hot dispatch and combine tensors with a
  capacity per expert, and stacked expert weights ``[experts, d_model, hidden]`` applied by einsum.
- ``MeshAnnotated``: weights declared with mesh-style names (``("fsdp", "tp")``) and activations
  constrained to ``P("fsdp", None, "tp")``, as models written for one mesh do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

VOCAB, LENGTH, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 64, 16, 32, 4, 2, 8, 64, 2
EXPERTS, TOP_K = 4, 2


def rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps) * scale).astype(x.dtype)


def rope(x, theta=10000.0):  # x: (B, T, N, H)
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # (T, H/2)
    sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def causal_attention(q, k, v):  # q: (B, T, N, H), k/v: (B, T, K, H) with N a multiple of K
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights, v)


class RMSNorm(nnx.Module):
    def __init__(self, features):
        self.weight = nnx.Param(jnp.ones((features,)))

    def __call__(self, x):
        return rms_norm(x, self.weight[...])


class LlamaAttention(nnx.Module):
    def __init__(self, rngs, bias):
        self.q_proj = nnx.Linear(D_MODEL, HEADS * HEAD_DIM, use_bias=bias, rngs=rngs)
        self.k_proj = nnx.Linear(D_MODEL, KV_HEADS * HEAD_DIM, use_bias=bias, rngs=rngs)
        self.v_proj = nnx.Linear(D_MODEL, KV_HEADS * HEAD_DIM, use_bias=bias, rngs=rngs)
        self.o_proj = nnx.Linear(HEADS * HEAD_DIM, D_MODEL, use_bias=False, rngs=rngs)

    def __call__(self, x):
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, HEADS, HEAD_DIM)
        k = self.k_proj(x).reshape(batch, length, KV_HEADS, HEAD_DIM)
        v = self.v_proj(x).reshape(batch, length, KV_HEADS, HEAD_DIM)
        out = causal_attention(rope(q), rope(k), v)
        return self.o_proj(out.reshape(batch, length, HEADS * HEAD_DIM))


class LlamaMLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(D_MODEL, HIDDEN, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(D_MODEL, HIDDEN, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(HIDDEN, D_MODEL, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
    def __init__(self, rngs, bias):
        self.input_layernorm = RMSNorm(D_MODEL)
        self.self_attn = LlamaAttention(rngs, bias)
        self.post_attention_layernorm = RMSNorm(D_MODEL)
        self.mlp = LlamaMLP(rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStyle(nnx.Module):
    def __init__(self, rngs, bias=False):
        self.embed_tokens = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.layers = nnx.List([LlamaLayer(rngs, bias) for _ in range(LAYERS)])
        self.norm = RMSNorm(D_MODEL)
        self.lm_head = nnx.Linear(D_MODEL, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class QwenStyle(LlamaStyle):
    """Qwen2: the Llama layout with biases on the query, key and value projections."""

    def __init__(self, rngs):
        super().__init__(rngs, bias=True)


def _normal(rngs, shape, fan_in):
    return nnx.Param(jax.random.normal(rngs.params(), shape) * fan_in ** -0.5)


class GemmaBlock(nnx.Module):
    def __init__(self, rngs):
        self.pre_attention_norm = RMSNorm(D_MODEL)
        self.q_einsum = _normal(rngs, (HEADS, D_MODEL, HEAD_DIM), D_MODEL)
        self.kv_einsum = _normal(rngs, (2, KV_HEADS, D_MODEL, HEAD_DIM), D_MODEL)
        self.attn_vec_einsum = _normal(rngs, (HEADS, HEAD_DIM, D_MODEL), HEADS * HEAD_DIM)
        self.pre_ffw_norm = RMSNorm(D_MODEL)
        self.gating_einsum = _normal(rngs, (2, D_MODEL, HIDDEN), D_MODEL)
        self.linear = _normal(rngs, (HIDDEN, D_MODEL), HIDDEN)

    def __call__(self, x):
        y = self.pre_attention_norm(x)
        q = jnp.einsum("btd,ndh->btnh", y, self.q_einsum[...])
        k, v = jnp.einsum("btd,ckdh->cbtkh", y, self.kv_einsum[...])
        attended = causal_attention(rope(q), rope(k), v)
        x = x + jnp.einsum("btnh,nhd->btd", attended, self.attn_vec_einsum[...])
        gate, up = jnp.einsum("btd,cdf->cbtf", self.pre_ffw_norm(x), self.gating_einsum[...])
        return x + jnp.einsum("btf,fd->btd", nnx.gelu(gate) * up, self.linear[...])


class GemmaStyle(nnx.Module):
    def __init__(self, rngs):
        self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D_MODEL)) * 0.02)
        self.blocks = nnx.List([GemmaBlock(rngs) for _ in range(LAYERS)])
        self.final_norm = RMSNorm(D_MODEL)

    def __call__(self, tokens):
        table = self.input_embedding[...]
        x = table[tokens] * np.sqrt(D_MODEL)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x) @ table.T  # tied: the lookup's table gives the logits


class SwitchBlock(nnx.Module):
    def __init__(self, rngs):
        self.attention_norm = RMSNorm(D_MODEL)
        self.qkv = _normal(rngs, (3, D_MODEL, HEADS, HEAD_DIM), D_MODEL)
        self.out = _normal(rngs, (HEADS, HEAD_DIM, D_MODEL), HEADS * HEAD_DIM)
        self.moe_norm = RMSNorm(D_MODEL)
        self.router = _normal(rngs, (D_MODEL, EXPERTS), D_MODEL)
        self.wi = _normal(rngs, (EXPERTS, D_MODEL, HIDDEN), D_MODEL)
        self.wo = _normal(rngs, (EXPERTS, HIDDEN, D_MODEL), HIDDEN)

    # each row of the batch is one group; an expert takes up to `capacity` of its tokens
    def experts(self, x):
        capacity = x.shape[1] * TOP_K // EXPERTS
        probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, self.router[...]))
        gates, chosen = jax.lax.top_k(probs, TOP_K)
        picked = jax.nn.one_hot(chosen, EXPERTS)  # (B, T, K, E)
        routed = picked.sum(2)
        slot = ((jnp.cumsum(routed, axis=1) - 1) * routed).astype(jnp.int32)  # a token's place in its expert
        dispatch = jax.nn.one_hot(slot, capacity) * routed[..., None]  # (B, T, E, capacity): the rest dropped
        combine = dispatch * jnp.einsum("btk,btke->bte", gates, picked)[..., None]
        tokens = jnp.einsum("btd,btec->ebcd", x, dispatch)
        hidden = nnx.gelu(jnp.einsum("ebcd,edf->ebcf", tokens, self.wi[...]))
        return jnp.einsum("ebcd,btec->btd", jnp.einsum("ebcf,efd->ebcd", hidden, self.wo[...]), combine)

    def __call__(self, x):
        q, k, v = jnp.einsum("btd,cdnh->cbtnh", self.attention_norm(x), self.qkv[...])
        x = x + jnp.einsum("btnh,nhd->btd", causal_attention(rope(q), rope(k), v), self.out[...])
        return x + self.experts(self.moe_norm(x))


class SwitchStyle(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([SwitchBlock(rngs) for _ in range(LAYERS)])
        self.norm = RMSNorm(D_MODEL)
        self.head = nnx.Linear(D_MODEL, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _annotated(rngs, shape, names, fan_in):
    init = nnx.with_partitioning(nnx.initializers.normal(fan_in ** -0.5), names)
    return nnx.Param(init(rngs.params(), shape))


class MeshAnnotatedBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = RMSNorm(D_MODEL)
        self.wq = _annotated(rngs, (D_MODEL, HEADS, HEAD_DIM), ("fsdp", "tp", None), D_MODEL)
        self.wkv = _annotated(rngs, (D_MODEL, 2, HEADS, HEAD_DIM), ("fsdp", None, "tp", None), D_MODEL)
        self.wo = _annotated(rngs, (HEADS, HEAD_DIM, D_MODEL), ("tp", None, "fsdp"), HEADS * HEAD_DIM)
        self.w_in = _annotated(rngs, (D_MODEL, HIDDEN), ("fsdp", "tp"), D_MODEL)
        self.w_out = _annotated(rngs, (HIDDEN, D_MODEL), ("tp", "fsdp"), HIDDEN)

    def __call__(self, x):
        y = self.norm(x)
        q = jnp.einsum("btd,dnh->btnh", y, self.wq[...])
        k, v = jnp.einsum("btd,dcnh->cbtnh", y, self.wkv[...])
        q = jax.lax.with_sharding_constraint(q, P("fsdp", None, "tp", None))
        x = x + jnp.einsum("btnh,nhd->btd", causal_attention(rope(q), rope(k), v), self.wo[...])
        hidden = jax.lax.with_sharding_constraint(nnx.relu(self.norm(x) @ self.w_in[...]),
                                                  P("fsdp", None, "tp"))
        return jax.lax.with_sharding_constraint(x + hidden @ self.w_out[...], P("fsdp", None, None))


class MeshAnnotated(nnx.Module):
    def __init__(self, rngs):
        self.embed = _annotated(rngs, (VOCAB, D_MODEL), ("tp", "fsdp"), 1.0)
        self.blocks = nnx.List([MeshAnnotatedBlock(rngs) for _ in range(LAYERS)])
        self.head = _annotated(rngs, (D_MODEL, VOCAB), ("fsdp", "tp"), D_MODEL)

    def __call__(self, tokens):
        x = jax.lax.with_sharding_constraint(self.embed[...][tokens], P("fsdp", None, None))
        for block in self.blocks:
            x = block(x)
        return x @ self.head[...]


MESH_NAMES = {"fsdp": "data", "tp": "model"}


def lm_loss(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), {}


def lm_batches(steps, batch_size=16, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, VOCAB, size=(4, LENGTH + 1))  # a few patterns repeated: learnable
    for _ in range(steps):
        yield {"tokens": base[rng.integers(0, 4, size=batch_size)].astype(np.int32)}


ZOO = {"llama": LlamaStyle, "qwen": QwenStyle, "gemma": GemmaStyle, "mesh-annotated": MeshAnnotated,
       "switch": SwitchStyle}
