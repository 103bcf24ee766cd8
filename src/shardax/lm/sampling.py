"""Text from a trained LM: seeded temperature / top-k sampling (greedy at temperature 0).

Greedy decoding of a small model trained for a minute repeats its most likely token (often a
space) forever; drawing from the top ``k`` tokens at a temperature below one shows what it
learned. The draw is a pure function of the seed, so the same run prints the same sample.
Tokens come from ``shardax.generate``'s key/value cache; a sample longer than the model's
context goes on from the latest half-context of text, prefilled afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardax.errors import UsageError
from shardax.generation import generate


def sample_tokens(parallel, state, prompt: Sequence[int], new_tokens: int, context: int, *, vocab: int,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``new_tokens`` tokens drawn from the model's next-token distribution
    (restricted to the first ``vocab`` ids: the model's padding rows are never drawn)."""
    if temperature < 0 or top_k < 0:
        raise UsageError(f"sampling needs temperature >= 0 and top_k >= 0, got {temperature} and {top_k}; "
                         "temperature 0 is greedy, top_k 0 keeps every token")
    model = parallel.merge(state)
    tokens = list(prompt[-context:])
    start, part = len(tokens), 0
    while len(tokens) - start < new_tokens:
        window = tokens[-max(1, context // 2):] if len(tokens) - start else tokens
        wanted = min(new_tokens - (len(tokens) - start), context - len(window))
        tokens += generate(model, [window], max_new_tokens=wanted, temperature=temperature, top_k=min(top_k, vocab),
                           seed=seed + 7919 * part, vocab=vocab)[0]
        part += 1
    return tokens[start:]
