"""What a query may see, and attention of a whole sequence at once with any mask, scale and cap.

A query sees a key of its own document (segment) at a position up to its own; with a sliding
``window`` of W (Mistral, Qwen2, Gemma's local layers) only the W latest of those, its own
included (``query position - key position < W``). The window is an integer (a traced value
inside a stack of layers, where it differs from layer to layer); 0 or less means no window.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def allowed(q_pos: jax.Array, q_seg: jax.Array, k_pos: jax.Array, k_seg: jax.Array,
            window: Any = 0) -> jax.Array:
    """(B, q, k): same document, key not after the query and, with a window, within it."""
    distance = q_pos[:, :, None] - k_pos[:, None, :]
    seen = (distance >= 0) & (k_seg[:, None, :] == q_seg[:, :, None])
    window = jnp.asarray(window)
    return seen & ((window <= 0) | (distance < window))


def softcapped(logits: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's soft cap on attention scores: ``cap * tanh(logits / cap)`` (None: unchanged)."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None,
                    softcap: float | None = None, implementation: str | None = None) -> jax.Array:
    """``q`` (B, T, N, H) attending to ``k``, ``v`` (B, S, K, H), K dividing N, where ``mask``
    (B, 1, T, S) allows. Scores are ``q . k * scale`` (default ``H ** -0.5``), soft-capped when
    ``softcap`` is given (written out in XLA ops then; otherwise ``jax.nn.dot_product_attention``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
    return grouped_attention(q, k, v, mask[:, 0], scale, softcap)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                      softcap: float | None = None, *, heads_first: bool = False) -> jax.Array:
    """Attention written out in XLA ops: ``q`` (B, T, N, H), a group of N / K of its heads to each
    of the K heads of ``k`` and ``v`` (B, S, K, H; or B, K, S, H when ``heads_first``, a cache's
    layout, whose heads' keys a product reads in place), where ``mask`` (B, T, S) allows. Scores
    are ``q . k * scale``, soft-capped when ``softcap`` is given; ``k`` and ``v`` are read in
    ``q``'s dtype."""
    batch, length, heads, size = q.shape
    key_heads = k.shape[1 if heads_first else 2]
    keys = "bksh" if heads_first else "bskh"
    grouped = q.reshape(batch, length, key_heads, heads // key_heads, size)
    logits = jnp.einsum(f"btkgh,{keys}->bkgts", grouped, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], softcapped(logits, softcap), -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    out = jnp.einsum(f"bkgts,{keys}->btkgh", weights, v.astype(q.dtype), preferred_element_type=jnp.float32)
    return out.reshape(batch, length, heads, size).astype(q.dtype)
