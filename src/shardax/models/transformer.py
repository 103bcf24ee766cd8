"""A decoder-only transformer LM in Flax NNX, every parameter annotated with logical axis names.

Pre-norm blocks of causal self-attention and an MLP, learned or rotary positions, a tied or
untied output head. Its config covers shardax's own presets (layer norm, GELU MLP with biases)
and the Llama family as Hugging Face defines it (``shardax.hf``): RMSNorm, SwiGLU, grouped-query
attention, RoPE with its base and Llama 3's scaling, q/k/v biases (Qwen2), query and key RMSNorm
(Qwen3), a head size of its own. Built from shardax's public blocks only (``shardax.blocks``):
a ``LayerStack`` (stacked and scanned, so parameters carry a leading ``layers`` axis and compile
time does not grow with depth; ``scan_layers=False`` keeps one module per block in a Python
loop) of blocks that attend through ``Attention``, what pipeline and context parallelism act on.
Parameters are float32 unless ``param_dtype`` says ``bfloat16`` (the residual stream and the
norms stay float32 either way); ``compute_dtype`` sets the matmul precision (``bfloat16`` for mixed
precision); ``remat`` chooses what the backward pass recomputes. Norms, GELU and RoPE: ``ops``.

LoRA (``lora_rank`` > 0): each targeted projection ``W`` gains adapters ``A`` (its inputs x
rank) and ``B`` (rank x its outputs, zeros at first), ``nnx.LoRAParam``s, and computes
``x W + (alpha / rank) (x A) B``; a train step then trains the adapters alone. Each adapter
carries the logical names of the base weight's dimensions it shares, so FSDP and tensor
parallelism split it as they split the base weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardax.adapters import LORA_TARGETS, LoRA  # noqa: F401 (also importable from here)
from shardax.blocks import (
    Attention,
    LayerSetting,
    LayerStack,
    attention_kernel,
    blocks_of,
    init_cache as cache_every_attention,
    sequence_split,
)
from shardax.decoding import CacheSharding, DecodeSpec
from shardax.errors import UsageError
from shardax.layers import annotated_param, metadata_only
from shardax.models import ops
from shardax.models.moe import MixtureOfExperts, router_losses
from shardax.models.transformer_config import ATTENTION, COMPUTE_DTYPES, MLPS, NORMS, TransformerConfig  # noqa: F401 (here too)
from shardax.runtime import context
from shardax.runtime.attention import softcapped
from shardax.sharding.compute import for_compute


def attention_implementation(config: TransformerConfig, platform: str | None = None) -> tuple[str, str]:
    """The attention kernel ``config`` runs with on ``platform`` (default: JAX's first device), and why.

    The rule is the attention call's own (``blocks.attention_kernel``), applied to the model's
    compute dtype, head dimension and masking: ``auto`` takes cuDNN's fused kernel when it applies
    and says why not otherwise; ``cudnn`` asked for where it does not apply is a one-line error."""
    masked = bool(config.sliding_window or config.attention_softcap)
    return attention_kernel(config.attention, config.compute_dtype, config.head_dim, platform, masked=masked,
                            named="`attention='cudnn'`")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...],
           scale: float | None = None) -> nnx.Param:
    """A normal-initialised parameter (fan-in scaled unless ``scale``), annotated with ``axes``."""
    std = scale if scale is not None else shape[0] ** -0.5
    return annotated_param(nnx.initializers.normal(std), rngs.params(), shape, axes)


def _norm(config: TransformerConfig, features: int, axis: str = "embed") -> nnx.Module:
    if config.norm == "layer":
        return ops.LayerNorm(features)
    return ops.RMSNorm(features, config.norm_eps, axis=axis, plus_one=config.norm == "rms_plus_one")


def _rope_tables(config: TransformerConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """RoPE's frequencies of the full-attention layers and of the sliding ones (Gemma 3's differ)."""
    h = config.head_dim
    full = ops.rope_frequencies(h, config.rope_theta, config.rope_scaling) / config.rope_linear_factor
    local = full if config.rope_local_theta is None else ops.rope_frequencies(h, config.rope_local_theta)
    return tuple(full.tolist()), tuple(local.tolist())


class Block(nnx.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        d, n, k, h = config.d_model, config.n_heads, config.kv_heads, config.head_dim
        self.config = config
        self.inv_freq, self.local_inv_freq = _rope_tables(config)
        if config.sliding_window:  # this layer's window (0: none), set per layer by TransformerLM
            self.window = LayerSetting(jnp.zeros((), jnp.int32))
        self.attn_norm = _norm(config, d)
        if k == n:
            # Query, key and value projections in one weight: under tensor parallelism the backward
            # pass then sums their input gradients before one all-reduce over the model axis (three
            # separate weights cost three), and FSDP gathers one array per layer instead of three.
            self.qkv = _param(rngs, (d, 3, n, h), ("embed", None, "heads", "kv"))
            if config.qkv_bias:
                self.qkv_bias = annotated_param(nnx.initializers.zeros, rngs.params(), (3, n, h),
                                                (None, "heads", "kv"))
        else:  # grouped-query attention: fewer key/value heads than query heads
            self.q = _param(rngs, (d, n, h), ("embed", "heads", "kv"))
            self.kv = _param(rngs, (d, 2, k, h), ("embed", None, "heads", "kv"))
            if config.qkv_bias:
                self.q_bias = annotated_param(nnx.initializers.zeros, rngs.params(), (n, h), ("heads", "kv"))
                self.kv_bias = annotated_param(nnx.initializers.zeros, rngs.params(), (2, k, h),
                                               (None, "heads", "kv"))
        if config.qk_norm:
            self.q_norm, self.k_norm = _norm(config, h, "kv"), _norm(config, h, "kv")
        self.attn_out = _param(rngs, (n, h, d), ("heads", "kv", "embed"), scale=(n * h) ** -0.5)
        self.mlp_norm = _norm(config, d)
        if config.post_norms:
            self.attn_post_norm, self.mlp_post_norm = _norm(config, d), _norm(config, d)
        if config.n_experts:
            self.experts = MixtureOfExperts(config, rngs)
        else:
            self._dense_mlp(config, rngs)
        self.attention = Attention(implementation=config.attention, scale=config.attention_scale,
                                   softcap=config.attention_softcap)
        for target, (inputs, in_axes, outputs, out_axes) in config.lora_shapes().items():
            r = config.lora_rank
            setattr(self, f"lora_{target}_a", annotated_param(
                nnx.initializers.normal(math.prod(inputs) ** -0.5), rngs.params(), (*inputs, r),
                (*in_axes, None), nnx.LoRAParam))
            setattr(self, f"lora_{target}_b", annotated_param(
                nnx.initializers.zeros, rngs.params(), (r, *outputs), (None, *out_axes), nnx.LoRAParam))

    def _dense_mlp(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        d, f = config.d_model, config.d_ff
        if config.mlp != "gelu":
            self.mlp_gate_up = _param(rngs, (d, 2, f), ("embed", None, "mlp"))
        else:
            self.mlp_in = _param(rngs, (d, f), ("embed", "mlp"))
            self.mlp_in_bias = annotated_param(nnx.initializers.zeros, rngs.params(), (f,), ("mlp",))
        self.mlp_out = _param(rngs, (f, d), ("mlp", "embed"))
        if config.mlp == "gelu":
            self.mlp_out_bias = annotated_param(nnx.initializers.zeros, rngs.params(), (d,), ("embed",))

    def _adapted(self, target: str, x: jax.Array, base: jax.Array) -> jax.Array:
        """``base`` (x through the projection ``target``) plus its LoRA adapters' term, if any."""
        if not hasattr(self, f"lora_{target}_a"):
            return base
        dtype = self.config.dtype
        a, b = (for_compute(getattr(self, f"lora_{target}_a"), dtype),
                for_compute(getattr(self, f"lora_{target}_b"), dtype))
        low = jnp.tensordot(x, a, axes=a.ndim - 1)  # (B, T, rank)
        return base + (self.config.lora_scale * jnp.tensordot(low, b, axes=1)).astype(base.dtype)

    def _queries_keys_values(self, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        dtype = self.config.dtype
        if hasattr(self, "qkv"):
            qkv = jnp.einsum("btd,dcnh->btcnh", y, for_compute(self.qkv, dtype))
            if self.config.qkv_bias:
                qkv = qkv + for_compute(self.qkv_bias, dtype)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = jnp.einsum("btd,dnh->btnh", y, for_compute(self.q, dtype))
            kv = jnp.einsum("btd,dckh->btckh", y, for_compute(self.kv, dtype))
            if self.config.qkv_bias:
                q, kv = q + for_compute(self.q_bias, dtype), kv + for_compute(self.kv_bias, dtype)
            k, v = kv[:, :, 0], kv[:, :, 1]
        return self._adapted("q", y, q), self._adapted("k", y, k), self._adapted("v", y, v)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None,
                 segments: jax.Array | None = None) -> jax.Array:  # (B, T, D)
        """``positions`` and ``segments`` (B, T) or None: see ``TransformerLM.__call__``."""
        config = self.config
        dtype = config.dtype
        window = self.window[...] if hasattr(self, "window") else None
        y = self.attn_norm(x).astype(dtype)
        q, k, v = self._queries_keys_values(y)
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if config.positions == "rotary":
            positions = jnp.arange(x.shape[1]) if positions is None else positions
            inv_freq = np.asarray(self.inv_freq, np.float32)
            if window is not None and self.local_inv_freq != self.inv_freq:
                inv_freq = jnp.where(window > 0, np.asarray(self.local_inv_freq, np.float32), inv_freq)
            q, k = ops.rotary(q, positions, inv_freq), ops.rotary(k, positions, inv_freq)
        # (B, T, N, H)
        attended = self.attention(q, k, v, positions=positions, segments=segments, window=window)
        projected = self._adapted("o", attended, jnp.einsum("btnh,nhd->btd", attended,
                                                            for_compute(self.attn_out, dtype)))
        x = x + (self.attn_post_norm(projected) if config.post_norms else projected).astype(x.dtype)
        out = self._mlp(self.mlp_norm(x).astype(dtype))
        return x + (self.mlp_post_norm(out) if config.post_norms else out).astype(x.dtype)

    def _mlp(self, y: jax.Array) -> jax.Array:
        config, dtype = self.config, self.config.dtype
        if config.n_experts:
            return self.experts(y)
        if config.mlp != "gelu":  # gated: SwiGLU or GeGLU
            gate_up = jnp.einsum("btd,dcf->btcf", y, for_compute(self.mlp_gate_up, dtype))
            glu = ops.swiglu if config.mlp == "swiglu" else ops.geglu
            hidden = glu(self._adapted("gate", y, gate_up[:, :, 0]), self._adapted("up", y, gate_up[:, :, 1]))
            return self._adapted("down", hidden, hidden @ for_compute(self.mlp_out, dtype))
        hidden = ops.gelu(self._adapted("up", y, y @ for_compute(self.mlp_in, dtype))
                          + for_compute(self.mlp_in_bias, dtype))
        return self._adapted("down", hidden, hidden @ for_compute(self.mlp_out, dtype)) + for_compute(
            self.mlp_out_bias, dtype)


def _kept_in(model: nnx.Module, dtype: Any) -> None:
    """Every weight of ``model`` but LoRA's adapters (which train) cast to ``dtype``."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and not isinstance(node, nnx.LoRAParam):
            node.set_value(node.get_value().astype(dtype))


class TransformerLM(nnx.Module):
    """tokens (B, T) int -> logits (B, T, vocab) float32."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        with metadata_only():
            self._build(config, rngs)

    def lora_factory(self, lora: LoRA) -> Callable[[nnx.Rngs], "TransformerLM"]:
        """``Trainer(lora=...)``'s hook: this model's factory with ``lora``'s adapters on the
        projections it names (checked by the config)."""
        config = lora.applied(self.config)
        return lambda rngs: TransformerLM(config, rngs=rngs)

    def decode_spec(self) -> DecodeSpec:
        """What ``shardax.generate`` reads of this model (``shardax.decoding.CachedDecoder``)."""
        c = self.config
        return DecodeSpec(c.vocab_size, c.seq_len, c.kv_heads, c.head_dim, c.dtype, c.layer_windows)

    def init_cache(self, batch: int, length: int, dtype: Any, sharding: CacheSharding = None, *,
                   ring: int | None = None) -> None:
        """An empty key/value cache in every attention layer, each layer's window its own
        (``shardax.blocks.init_cache``), for ``shardax.generate``."""
        c = self.config
        cache_every_attention(self, batch, length, c.kv_heads, c.head_dim, dtype, sharding,
                              windows=c.layer_windows, ring=ring)

    def _build(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        d = config.d_model
        self.embedding = _param(rngs, (config.vocab_size, d), ("vocab", "embed"), scale=0.02)
        if config.positions == "learned":
            self.position = _param(rngs, (config.seq_len, d), ("length", "embed"), scale=0.02)
        self.final_norm = _norm(config, d)
        if not config.tie_embeddings:
            self.head = _param(rngs, (d, config.vocab_size), ("embed", "vocab"))

        self.blocks = LayerStack(lambda rngs: Block(config, rngs), config.n_layers, rngs=rngs,
                                 scan=config.scan_layers, remat=config.remat)
        if config.sliding_window:  # each layer's own window
            windows = jnp.asarray(config.layer_windows, jnp.int32)
            if config.scan_layers:
                self.blocks.layers.window[...] = windows
            for layer, window in zip([] if config.scan_layers else self.blocks.layers, windows):
                layer.window[...] = window
        if config.param_dtype != "float32":
            _kept_in(self, COMPUTE_DTYPES[config.param_dtype])

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """``segments`` (B, T): packed documents numbered from 1 (0: padding); a token attends only
        to earlier tokens of its own document. ``positions`` (B, T): each token's place in its
        document (default ``0..T-1``)."""
        config = self.config
        length = tokens.shape[1]
        if length > config.seq_len and config.positions == "learned":
            raise UsageError(f"sequence of {length} tokens is longer than seq_len={config.seq_len}")
        embedding = for_compute(self.embedding)
        x = jnp.take(embedding, tokens, axis=0).astype(jnp.float32)  # (B, T, D)
        if config.scale_embeddings:
            x = x * np.float32(math.sqrt(config.d_model))
        if config.positions == "learned":
            table = for_compute(self.position)
            x = x + (table[:length] if positions is None else jnp.take(table, positions, axis=0))
        if self.blocks.plan.sequence is not None and positions is None:  # the mask comes from positions
            positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
        x = self.blocks(x, positions, segments)
        x = self.final_norm(x).astype(config.dtype)
        head = embedding.T if config.tie_embeddings else for_compute(self.head)
        logits = (x @ head.astype(config.dtype)).astype(jnp.float32)
        return logits if config.logits_softcap is None else softcapped(logits, config.logits_softcap)


def token_losses(model: TransformerLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy (nats) of each prediction of ``tokens[:, 1:]`` from ``tokens[:, :-1]``, and
    which predictions count (0 where the input or the target is padding, ``segments == 0``, and
    where a ``mask`` beside the tokens is 0: supervised fine-tuning learns only the tokens it
    marks, an assistant's turns or a completion).

    With ``segments``, a document's first token is predicted from the end-of-document token that
    opens it, and its last token predicts the one that closes it (which opens the next)."""
    tokens = batch["tokens"]
    segments, positions = batch.get("segments"), batch.get("positions")
    split = sequence_split(model)
    if split is not None:
        losses, weights = _zigzag_token_losses(model, tokens, segments, positions, split)
        return losses, _masked(weights, batch)
    if segments is None:
        logits = model(tokens[:, :-1])
        weights = jnp.ones(tokens[:, 1:].shape, jnp.float32)
    else:
        logits = model(tokens[:, :-1], segments[:, :-1], None if positions is None else positions[:, :-1])
        weights = ((segments[:, :-1] > 0) & (segments[:, 1:] > 0)).astype(jnp.float32)
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
    return losses, _masked(weights, batch)


def _masked(weights: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """``weights`` of the predictions of ``tokens[:, 1:]``, zero where the batch's ``mask`` (beside
    the tokens) does not mark the target."""
    return weights if "mask" not in batch else weights * (batch["mask"][:, 1:] > 0).astype(weights.dtype)


def _weighted_mean(batch: dict[str, jax.Array]) -> bool:
    """Whether a batch's loss is a weighted mean (some predictions do not count) or a plain one."""
    return "segments" in batch or "mask" in batch


def _zigzag_token_losses(model: TransformerLM, tokens: jax.Array, segments: jax.Array | None,
                         positions: jax.Array | None,
                         split: context.ContextLayout) -> tuple[jax.Array, jax.Array]:
    """``token_losses`` with the sequence split over devices: the model sees the sequence in the
    zig-zag order (each device two chunks, one early and one late, so that under the causal mask
    all do the same work), told each token's position; the losses come back in the usual order.
    Only token ids, positions and the per-token losses are reordered, never activations."""
    length = tokens.shape[1] - 1
    split.check_length(length, "a sequence (the batch's length - 1)")
    order = context.zigzag_order(length, split.shards)
    inputs, targets = tokens[:, :-1][:, order], tokens[:, 1:][:, order]
    if positions is None:
        positions = jnp.broadcast_to(jnp.asarray(order), inputs.shape)  # each token's place: its index
    else:
        positions = positions[:, :-1][:, order]
    weights = jnp.ones(inputs.shape, jnp.float32)
    if segments is not None:
        weights = ((segments[:, :-1] > 0) & (segments[:, 1:] > 0)).astype(jnp.float32)
        segments = segments[:, :-1][:, order]
    logits = model(inputs, segments, positions)
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return losses[:, np.argsort(order)], weights


def with_router_losses(model: TransformerLM, loss: jax.Array, metrics: dict[str, jax.Array]) -> Any:
    """``loss`` plus a mixture of experts' router terms (their weights ``router_aux_loss`` and
    ``router_z_loss``), with ``router_balance`` and ``router_z`` among the metrics; a model without
    experts: ``loss`` alone where there are no metrics."""
    stats = [moe.router_stats[...] for _, moe in blocks_of(model, MixtureOfExperts)]
    if not stats:
        return (loss, metrics) if metrics else loss
    balance, z = router_losses(jnp.concatenate([s.reshape(-1, s.shape[-1]) for s in stats]))
    config = model.config
    loss = loss + config.router_aux_loss * balance + config.router_z_loss * z
    return loss, {**metrics, "router_balance": balance, "router_z": z}


def next_token_loss(model: TransformerLM, batch: dict[str, jax.Array]) -> Any:
    """Mean cross-entropy of the predictions that count (see ``token_losses``), plus the router's
    terms of a mixture of experts (then with them as metrics: ``with_router_losses``)."""
    losses, weights = token_losses(model, batch)
    if not _weighted_mean(batch):
        return with_router_losses(model, losses.mean(), {})
    return with_router_losses(model, (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0), {})


# how these losses feed a model whose sequences are split over a context axis (Trainer.describe says so)
next_token_loss.sequence_order = "zig-zag"  # type: ignore[attr-defined]


def weighted_next_token_loss(model: TransformerLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """``next_token_loss`` and, as ``"weight"``, how many predictions it is the mean of: the
    loss ``shardax train`` trains on, so that microbatches of packed or padded rows, which count
    different numbers of tokens, accumulate to the whole batch's update."""
    losses, weights = token_losses(model, batch)
    if not _weighted_mean(batch):
        return with_router_losses(model, losses.mean(), {"weight": jnp.asarray(losses.size, jnp.float32)})
    count = weights.sum()
    return with_router_losses(model, (losses * weights).sum() / jnp.maximum(count, 1.0), {"weight": count})


weighted_next_token_loss.sequence_order = "zig-zag"  # type: ignore[attr-defined]
