"""Text from a trained LM: seeded temperature / top-k sampling (greedy at temperature 0).

Greedy decoding of a small model trained for a minute repeats its most likely token (often a
space) forever; drawing from the top ``k`` tokens at a temperature below one shows what it
learned. The draw is a pure function of the seed, so the same run prints the same sample.
Tokens come from ``shardax.generate``'s key/value cache; a sample longer than the model's
context goes on from the latest half-context of text, prefilled afresh.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

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
        tokens += generate(model, [window], max_new_tokens=wanted, temperature=temperature,
                           top_k=min(top_k, vocab), seed=seed + 7919 * part, vocab=vocab)[0]
        part += 1
    return tokens[start:]


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
