"""Text from a trained LM: seeded temperature / top-k sampling (greedy at temperature 0).

Greedy decoding of a small model trained for a minute repeats its most likely token (often a
space) forever; drawing from the top ``k`` tokens at a temperature below one shows what it
learned. The draw is a pure function of the seed, so the same run prints the same sample.
Tokens come from ``shardax.generate``'s key/value cache; a sample longer than the model's
context goes on from the latest half-context of text, prefilled afresh. A model without that
cache (one of the user's that does not implement ``shardax.decoding.CachedDecoder``) is run
whole on the latest context of text, padded to the full context (one compilation serves every
token), and the token drawn from the logits at its last real position: a causal model gives
the same distribution, at the cost of a full forward pass a token.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.generation import generate


def sample_tokens(parallel, state, prompt: Sequence[int], new_tokens: int, context: int, *, vocab: int,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``new_tokens`` tokens drawn from the next-token distribution of the
    model ``parallel`` lays out holding ``state`` (see ``sample_model``)."""
    return sample_model(parallel.merge(state), prompt, new_tokens, context, vocab=vocab,
                        temperature=temperature, top_k=top_k, seed=seed)


def sample_model(model: nnx.Module, prompt: Sequence[int], new_tokens: int, context: int, *, vocab: int,
                 temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``new_tokens`` tokens drawn from ``model``'s next-token distribution
    (restricted to the first ``vocab`` ids: the model's padding rows are never drawn)."""
    if temperature < 0 or top_k < 0:
        raise UsageError(f"sampling needs temperature >= 0 and top_k >= 0, got {temperature} and {top_k}; "
                         "temperature 0 is greedy, top_k 0 keeps every token")
    if not all(callable(getattr(model, name, None)) for name in ("decode_spec", "init_cache")):
        return _uncached(model, prompt, new_tokens, context, vocab, temperature, top_k, seed)
    tokens = list(prompt[-context:])
    start, part = len(tokens), 0
    while len(tokens) - start < new_tokens:
        window = tokens[-max(1, context // 2):] if len(tokens) - start else tokens
        wanted = min(new_tokens - (len(tokens) - start), context - len(window))
        tokens += generate(model, [window], max_new_tokens=wanted, temperature=temperature,
                           top_k=min(top_k, vocab), seed=seed + 7919 * part, vocab=vocab)[0]
        part += 1
    return tokens[start:]


def _uncached(model: nnx.Module, prompt: Sequence[int], new_tokens: int, context: int, vocab: int,
              temperature: float, top_k: int, seed: int) -> list[int]:
    """``sample_tokens`` of a model without a key/value cache: a forward pass over the latest
    ``context`` tokens (zeros after them) for each new token."""
    step = _next_token(model, vocab, temperature, min(top_k, vocab))
    tokens, start = list(prompt[-context:]), len(prompt[-context:])
    key = jax.random.key(seed)
    while len(tokens) - start < new_tokens:
        window = tokens[-context:]
        row = np.zeros((1, context), np.int32)
        row[0, :len(window)] = window
        tokens.append(int(step(row, np.int32(len(window) - 1), jax.random.fold_in(key, len(tokens) - start))))
    return tokens[start:]


def _next_token(model: nnx.Module, vocab: int, temperature: float,
                top_k: int) -> Callable[[np.ndarray, np.ndarray, jax.Array], jax.Array]:
    """``(row (1, context), last, key) -> the token drawn after position last``, jitted, on a copy
    of ``model`` in eval mode (the token replicated: every process reads it)."""
    graphdef, state = nnx.split(model)
    work = nnx.merge(graphdef, state)
    work.eval()
    graphdef, state = nnx.split(work)
    mesh = next((leaf.sharding.mesh for leaf in jax.tree.leaves(state)
                 if isinstance(getattr(leaf, "sharding", None), NamedSharding)), None)

    def step(state: Any, row: jax.Array, last: jax.Array, key: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, state)(row)[0, last, :vocab].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        logits = logits / temperature
        if top_k:
            logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
        return jax.random.categorical(key, logits).astype(jnp.int32)

    jitted = jax.jit(step, out_shardings=None if mesh is None else NamedSharding(mesh, PartitionSpec()))
    return lambda row, last, key: jitted(state, row, last, key)


# A word: a run of two or more ASCII letters (identifiers split at underscores and digits), lower-cased.
_WORD = re.compile(r"[A-Za-z]{2,}")


def words(text: str) -> list[str]:
    """The words of ``text``: runs of two or more letters, lower-cased (``get_file2Name(x)``
    gives ``get``, ``file``, ``name``)."""
    return [word.lower() for word in _WORD.findall(text)]


def vocabulary(texts: Iterable[str]) -> set[str]:
    """Every word of ``texts`` (a corpus)."""
    found: set[str] = set()
    for text in texts:
        found.update(words(text))
    return found


def word_share(text: str, known: set[str]) -> tuple[float, int]:
    """The share of ``text``'s words found in ``known`` (a corpus' vocabulary), and how many
    words there were: how much of a sample is made of real words."""
    sampled = words(text)
    return (sum(word in known for word in sampled) / len(sampled) if sampled else 0.0), len(sampled)
