"""The key/value cache an ``Attention`` decodes from (``shardax.blocks.init_cache`` gives it one).

Each call writes its keys and values at their positions (``positions``, contiguous in each row)
and its queries attend to every cached token at or before their own position (within the
layer's window): a prompt, then one token at a time. Position p goes to slot p modulo the
cache's length, so a cache at least as long as a sliding window (and as a prompt written at
once) serves any length as a ring.

Arrays are ``(batch, kv_heads, length, head_dim)`` (each head's positions together, as the
attention reads them: its scores and its weighted sum are one batched product over ``(batch,
kv_heads)`` with nothing transposed first), with a leading layers dimension inside a scanned
``LayerStack``, whose caches travel through the scan whole: ``CacheLayer`` counts which
layer a call is at, and each layer writes its new tokens in place. A stack that mixes windowed
and full layers (Gemma 2 and 3, Qwen2's ``max_window_layers``) keeps two caches: the full
layers' (``cached_keys``), which grows with the text, and the windowed layers' ring
(``ring_keys``), which stops at the window; each layer writes and reads only its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.errors import UsageError
from shardax.runtime.attention import grouped_attention

# A cache of 16-bit floats is held as their bits (unsigned integers of the same size) and read as
# the floats: a token's write is then a plain in-place copy on every compiler, where XLA:CPU
# carries out a bfloat16 write as the layer stack's whole cache widened to float32 and narrowed
# back, every layer, every token (benchmark 19). The bits are the same, and so are the bytes.
BITS = {"bfloat16": jnp.uint16, "float16": jnp.uint16}


class CacheLayer(nnx.Cache):
    """Which layer of a scanned stack an ``Attention`` is at while decoding: its cache holds
    every layer's keys and values (carried through the scan, so one token is written in place
    rather than each layer's slice copied in and out); each call reads and writes its own
    layer, then counts one on."""


def allocate(block: Any, make: Callable[[tuple[int, ...], Any], jax.Array], shape: tuple[int, int, int, int],
             dtype: Any, *, layers: int = 0, windows: Sequence[int] | None = None,
             ring: int | None = None) -> None:
    """Give ``block`` (an ``Attention``) an empty cache for ``shape`` ``(batch, length, kv_heads,
    head_dim)``, held as ``(batch, kv_heads, length, head_dim)``: one per layer of a scanned stack
    of ``layers`` (0: the block is one layer); ``make(shape, dtype)`` makes each array, zeros
    where they belong.
    With ``windows`` (each layer's sliding window, 0 for none; one entry for a lone layer) and
    ``ring``, windowed layers keep ``min(length, ring)`` positions apart from the others."""
    block.cache_dtype = jnp.dtype(dtype).name  # what reads see (a new cache's, whatever one held before)
    bits = BITS.get(block.cache_dtype)  # a 16-bit float cache holds its bits (see BITS)

    def zeros(shape: tuple[int, ...]) -> nnx.Cache:
        return nnx.Cache(make(shape, bits or dtype))

    batch, length, kv_heads, head_dim = shape
    shape = (batch, kv_heads, length, head_dim)
    ringed = tuple(w > 0 for w in windows) if windows is not None and ring is not None else ()
    if not layers:
        name, held = ("ring", min(length, ring)) if any(ringed) else ("cached", length)
        setattr(block, f"{name}_keys", zeros((batch, kv_heads, held, head_dim)))
        setattr(block, f"{name}_values", zeros((batch, kv_heads, held, head_dim)))
        return
    block.cache_layer = CacheLayer(make((), jnp.int32))
    if not any(ringed) or all(ringed):
        block.cached_keys, block.cached_values = zeros((layers, *shape)), zeros((layers, *shape))
        return
    # each layer's place in its own group: (in the ring?, index among that group's layers)
    block.cache_groups = (ringed, tuple(sum(r == ringed[i] for r in ringed[:i]) for i in range(layers)))
    full, ringed_count = layers - sum(ringed), sum(ringed)
    block.cached_keys, block.cached_values = zeros((full, *shape)), zeros((full, *shape))
    kept = (batch, kv_heads, min(length, ring), head_dim)
    block.ring_keys, block.ring_values = zeros((ringed_count, *kept)), zeros((ringed_count, *kept))


def attend(block: Any, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None,
           window: Any) -> jax.Array:
    """``block``'s attention of ``q`` to its cache, once ``k`` and ``v`` are written into it."""
    if positions is None:
        raise UsageError("attention from a key/value cache needs each token's position (positions=...)")
    floats = getattr(block, "cache_dtype", None)
    look = lambda keys, values: _attend(block, q, _floats(block, keys), _floats(block, values),  # noqa: E731
                                        positions, window)
    if not hasattr(block, "cache_layer"):  # one layer's own cache: full, or a ring
        name = "ring" if hasattr(block, "ring_keys") else "cached"
        keys, values = getattr(block, f"{name}_keys"), getattr(block, f"{name}_values")
        return look(_write(keys, k, positions, floats=floats), _write(values, v, positions, floats=floats))
    layer = block.cache_layer[...]
    block.cache_layer[...] += 1
    if not hasattr(block, "ring_keys"):
        _write(block.cached_keys, k, positions, layer, floats=floats)
        _write(block.cached_values, v, positions, layer, floats=floats)
        return look(_layer(block.cached_keys, layer), _layer(block.cached_values, layer))
    ringed, slots = (jnp.asarray(table) for table in block.cache_groups)
    in_ring, slot = ringed[layer], slots[layer]
    for cache, new in ((block.cached_keys, k), (block.cached_values, v)):  # the other group keeps its tokens
        _write(cache, new, positions, jnp.minimum(slot, cache.shape[0] - 1), keep=in_ring,
               floats=floats)
    for cache, new in ((block.ring_keys, k), (block.ring_values, v)):
        _write(cache, new, positions, jnp.minimum(slot, cache.shape[0] - 1), keep=~in_ring,
               floats=floats)
    full = (block.cached_keys[...], block.cached_values[...])
    kept = (block.ring_keys[...], block.ring_values[...])
    return jax.lax.cond(in_ring, lambda: look(_layer(kept[0], slot), _layer(kept[1], slot)),
                        lambda: look(_layer(full[0], slot), _layer(full[1], slot)))


def _attend(block: Any, q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array,
            window: Any) -> jax.Array:
    """``q`` (B, T, N, H) attending to a cache's ``keys`` and ``values`` (B, K, length, H)."""
    # slot s holds the latest position p <= q with p = s (mod length): a ring once positions pass the length
    length = keys.shape[2]
    ahead = positions[:, :, None]
    held = ahead - (ahead - jnp.arange(length)) % length  # (B, T, cache length)
    visible = held >= 0
    if window is not None:
        visible &= (jnp.asarray(window) <= 0) | (ahead - held < window)
    scale = q.shape[-1] ** -0.5 if block.scale is None else block.scale
    return grouped_attention(q, keys, values, visible, scale, block.softcap, heads_first=True)


def _floats(block: Any, held: jax.Array) -> jax.Array:
    """A cache's keys or values as the floats they are (a 16-bit cache holds bits: see BITS)."""
    dtype = jnp.dtype(getattr(block, "cache_dtype", held.dtype))
    return held if held.dtype == dtype else jax.lax.bitcast_convert_type(held, dtype)


def _layer(cache: Any, layer: jax.Array) -> jax.Array:
    value = cache[...] if isinstance(cache, nnx.Variable) else cache
    return jax.lax.dynamic_index_in_dim(value, layer, 0, keepdims=False)


def _held(cache: nnx.Cache, new: jax.Array, floats: str | None) -> jax.Array:
    """``new`` as ``cache`` holds it: in its dtype, or as the bits of ``floats`` where the cache
    holds a 16-bit float's bits (see BITS)."""
    if floats is None or jnp.dtype(floats) == cache.dtype:
        return new.astype(cache.dtype)
    return jax.lax.bitcast_convert_type(new.astype(floats), cache.dtype)


def _write(cache: nnx.Cache, new: jax.Array, positions: jax.Array, layer: jax.Array | None = None,
           keep: jax.Array | None = None, floats: str | None = None) -> jax.Array:
    """Write ``new`` (B, T, K, H) into ``cache`` (B, K, length, H; at ``layer`` of its leading
    dimension, if given) at its positions (B, T), in place, and return the cache; where ``keep``
    is true, what the cache holds there stays (the write of a layer whose tokens belong to the
    other group). ``floats``: the float the cache's values are (its own dtype, or a 16-bit float
    whose bits it holds: see BITS)."""
    new, slots = _held(cache, new, floats), positions % cache.shape[-2]
    rows = jnp.arange(new.shape[0])[:, None]
    # rows and slots are indices apart, around the heads: what they pick is (B, T, K, H), as ``new`` is
    index = (rows, slice(None), slots) if layer is None else (layer, rows, slice(None), slots)
    if keep is not None:
        new = jnp.where(keep, cache[...][index], new)
    cache[...] = cache[...].at[index].set(new, mode="promise_in_bounds")
    return cache[...]
