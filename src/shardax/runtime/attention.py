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
    batch, length, heads, size = q.shape
    groups = heads // k.shape[2]
    grouped = q.reshape(batch, length, k.shape[2], groups, size)
    logits = jnp.einsum("btkgh,bskh->bkgts", grouped, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, :, None], softcapped(logits, softcap), -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(batch, length, heads, size).astype(q.dtype)
