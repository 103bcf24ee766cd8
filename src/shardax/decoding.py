"""What ``shardax.generate`` needs of a model: ``CachedDecoder``, which shardax's ``TransformerLM``
and any model of the user's may implement.

``generate`` runs the model over the prompts once (prefill), then over one new token a row at a
time (decode): each call ``model(tokens, positions=positions)`` (both ``(B, T)``; ``positions``
each token's place in its row) writes its keys and values into a cache the model holds in
``nnx.Cache`` variables and returns the logits ``(B, T, vocab)``. The model says what it is in a
``DecodeSpec`` and makes its own empty cache when asked (``init_cache``): a model whose attention
is ``shardax.blocks.Attention`` calls ``shardax.blocks.init_cache``, which makes the arrays as
``generate`` grows and lays them out, ``(batch, kv_heads, length, head_dim)`` in their last four
dimensions, and attends from them. ``generate`` works on a copy of the model; the model itself is
not changed.

    class MyLM(nnx.Module):
        def decode_spec(self):
            return DecodeSpec(vocab_size=256, seq_len=512, kv_heads=4, head_dim=64, dtype="float32",
                              layer_windows=(0,) * 6)
        def init_cache(self, batch, length, dtype, sharding=None, *, ring=None):
            shardax.blocks.init_cache(self, batch, length, 4, 64, dtype, sharding, ring=ring)
        def __call__(self, tokens, positions=None): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
from flax import nnx

from shardax.errors import UsageError

# where an array of a shape is made (None: on JAX's default device)
CacheSharding = Callable[[tuple[int, ...]], Any] | None


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What ``generate`` reads of a model: its vocabulary, the most positions it attends over
    (prompt and new tokens together), its attention's key/value heads and their size, its compute
    dtype (the cache's unless ``generate`` is told another) and each attention layer's sliding
    window (0: none; one entry per layer: the cache's bytes count them)."""

    vocab_size: int
    seq_len: int
    kv_heads: int
    head_dim: int
    dtype: Any
    layer_windows: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.seq_len, self.kv_heads, self.head_dim)
        if min(sizes) < 1 or not self.layer_windows or min(self.layer_windows) < 0:
            raise UsageError(f"DecodeSpec{sizes} with layer_windows={self.layer_windows!r}: the sizes must "
                             "be positive, with one window (0: none) per attention layer")


class CachedDecoder(Protocol):
    """A model ``generate`` decodes (see the module's docstring): an ``nnx.Module`` with these."""

    def decode_spec(self) -> DecodeSpec:
        """What it is (``DecodeSpec``)."""
        ...

    def init_cache(self, batch: int, length: int, dtype: Any, sharding: CacheSharding = None, *,
                   ring: int | None = None) -> None:
        """Give itself, in place, an empty key/value cache of ``length`` positions for ``batch`` rows
        held as ``dtype``; ``sharding(shape)``: where each array is made; ``ring``: where windowed
        layers sit beside full ones, the windowed layers keep at most this many positions (as
        ``shardax.blocks.init_cache`` takes them)."""
        ...

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits ``(B, T, vocab)`` of ``tokens`` at ``positions`` (both ``(B, T)``), reading and
        writing the cache where it has one."""
        ...


def decode_spec_of(model: Any) -> DecodeSpec:
    """``model``'s ``DecodeSpec``; refused in one line, naming what it lacks, when ``model`` is no
    ``CachedDecoder``."""
    missing = [] if isinstance(model, nnx.Module) else ["is no nnx.Module"]
    missing += [f"has no {name}()" for name in ("decode_spec", "init_cache")
                if not callable(getattr(model, name, None))]
    if missing:
        raise UsageError(f"generate() decodes a model that implements shardax.decoding.CachedDecoder "
                         f"(decode_spec() and init_cache(), as shardax's TransformerLM does); this "
                         f"{type(model).__name__} {' and '.join(missing)}")
    spec = model.decode_spec()
    if not isinstance(spec, DecodeSpec):
        raise UsageError(f"{type(model).__name__}.decode_spec() returned a {type(spec).__name__}; return a "
                         "shardax.decoding.DecodeSpec")
    return spec
