"""Text from a trained LM: seeded temperature / top-k sampling (greedy at temperature 0).

Greedy decoding of a small model trained for a minute repeats its most likely token (often a
space) forever; drawing from the top ``k`` tokens at a temperature below one shows what it
learned. The draw is a pure function of the seed, so the same run prints the same sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardax.errors import UsageError


def sample_tokens(parallel, state, prompt: Sequence[int], new_tokens: int, context: int, *, vocab: int,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``new_tokens`` tokens drawn from the model's next-token distribution
    (restricted to the first ``vocab`` ids: the model's padding rows are never drawn)."""
    if temperature < 0 or top_k < 0:
        raise UsageError(f"sampling needs temperature >= 0 and top_k >= 0, got {temperature} and {top_k}; "
                         "temperature 0 is greedy, top_k 0 keeps every token")
    replicated = NamedSharding(parallel.mesh, PartitionSpec())
    keep = vocab if top_k == 0 else min(top_k, vocab)

    @jax.jit
    def next_token(params, rest, window, length, key):
        logits = nnx.merge(parallel.graphdef, params, rest)(window)[0, length - 1, :vocab]  # (vocab,)
        if temperature == 0:
            return jnp.argmax(logits)
        top, ids = jax.lax.top_k(logits, keep)
        return ids[jax.random.categorical(key, top / temperature)]

    tokens = list(prompt[-context:])
    start = len(tokens)
    base = jax.random.key(seed)
    for i in range(new_tokens):
        recent = tokens[-context:]
        window = np.zeros((1, context), np.int32)
        window[0, : len(recent)] = recent
        placed = jax.make_array_from_callback(window.shape, replicated, lambda index: window[index])
        token = next_token(state.params, state.rest, placed, len(recent), jax.random.fold_in(base, i))
        tokens.append(int(np.asarray(token.addressable_data(0))))
    return tokens[start:]
