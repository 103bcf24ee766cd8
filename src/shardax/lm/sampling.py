"""Greedy text generation from a trained byte-level LM (a short sample at the end of a run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


def greedy_sample(parallel, state, prompt: bytes, new_bytes: int, context: int) -> bytes:
    """Continue ``prompt`` by ``new_bytes`` bytes, always taking the most likely next byte."""
    replicated = NamedSharding(parallel.mesh, PartitionSpec())

    @jax.jit
    def next_byte(params, rest, window, length):
        logits = nnx.merge(parallel.graphdef, params, rest)(window)  # (1, context, vocab)
        return jnp.argmax(logits[0, length - 1, :256])

    tokens = list(prompt[-context:])
    for _ in range(new_bytes):
        recent = tokens[-context:]
        window = np.zeros((1, context), np.int32)
        window[0, : len(recent)] = recent
        placed = jax.make_array_from_callback(window.shape, replicated, lambda index: window[index])
        token = next_byte(state.params, state.rest, placed, len(recent))
        tokens.append(int(np.asarray(token.addressable_data(0))))
    return bytes(tokens[len(prompt[-context:]) :])
