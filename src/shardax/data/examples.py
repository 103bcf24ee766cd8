"""Supervised fine-tuning batches read lazily from ``prepare``'s shards of conversations.

Each conversation is an example: its tokens (``.tokens``) and which of them the loss learns
(``.mask``, the assistant's). Examples are never cut across rows unless longer than a row: they
are laid into rows of ``seq_len + 1`` tokens once, packed (each into the fullest row it fits) or
one a row, and each epoch visits the rows in an order drawn from ``(seed, epoch)``. The batch of
step ``s`` is a pure function of ``(data, seed, s)``, the same under resume and with any number
of processes, and each process reads only the examples of its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from shardax.data.conversations import lay_rows, plan_rows
from shardax.data.shards import TokenStream
from shardax.errors import UsageError

KEYS = ("tokens", "mask", "segments", "positions")


class Examples:
    """One split's conversations, read by index: token ids and loss mask of each."""

    def __init__(self, root: Path, shards: list[dict[str, Any]], dtype: str, vocab_size: int) -> None:
        self.tokens = TokenStream(root, shards, dtype, vocab_size)
        self.mask = TokenStream(root, shards, "uint8", suffix=".mask")
        starts, ends = [], []
        for first, shard in zip(self.tokens.starts, shards):
            offsets = np.load(root / f"{shard['name']}.docs.npy") + first
            starts.append(offsets[:-1] + 1)  # each example opens with the end-of-document token: not its own
            ends.append(offsets[1:])
        self.starts = np.concatenate(starts or [np.zeros(0, np.int64)])
        self.lengths = np.concatenate(ends or [np.zeros(0, np.int64)]) - self.starts

    def __len__(self) -> int:
        return len(self.starts)

    def example(self, index: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Example ``index``'s first ``limit`` tokens and their mask."""
        start, count = int(self.starts[index]), min(int(self.lengths[index]), limit)
        return self.tokens.read(start, count), self.mask.read(start, count)

    def rows(self, plan: list[list[int]], length: int) -> dict[str, np.ndarray]:
        return lay_rows([[self.example(i, length) for i in row] for row in plan], length)

    def trained(self, limit: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
        """The first ``limit`` tokens of the split and their mask (for the unigram baseline)."""
        return self.tokens.read(0, limit), self.mask.read(0, limit)


def on_devices(read: Callable[[list[int]], dict[str, np.ndarray]], ids: list[int], length: int,
               keys: tuple[str, ...], sharding: Sharding) -> dict[str, jax.Array]:
    """The rows ``read(ids)`` gives, as global arrays of ``len(ids)`` rows of ``length``: each
    process reads only the rows its devices hold, each span of them once."""
    done: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def rows(key: str, index: tuple[slice, ...]) -> np.ndarray:
        span = index[0].indices(len(ids))[:2]
        if span not in done:
            done[span] = read(ids[span[0]: span[1]])
        return done[span][key][:, index[1]]

    return {key: jax.make_array_from_callback((len(ids), length), sharding,
                                              lambda index, key=key: rows(key, index))
            for key in keys}


class ExampleRows:
    """``batch_size`` rows of ``seq_len + 1`` tokens per step, in a seeded order, epoch after epoch."""

    def __init__(self, examples: Examples, seq_len: int, batch_size: int, seed: int,
                 pack: bool = True) -> None:
        import grain

        self.examples, self.length, self.batch_size = examples, seq_len + 1, batch_size
        self.plan = plan_rows(examples.lengths, self.length, pack=pack)
        self.cut = int((examples.lengths > self.length).sum())
        if not self.plan:
            raise UsageError("the training split holds no conversation; give more examples")
        self.order = grain.MapDataset.range(len(self.plan)).shuffle(seed=seed)  # a new order each epoch

    def global_batch(self, step: int, sharding: Sharding) -> dict[str, jax.Array]:
        """The batch of ``step`` as global arrays; this process reads only the rows its devices hold."""
        first = step * self.batch_size
        ids = [int(self.order[i]) for i in range(first, first + self.batch_size)]
        return on_devices(lambda some: self.examples.rows([self.plan[i] for i in some], self.length), ids,
                          self.length, KEYS, sharding)

    def epoch(self, step: int) -> float:
        return step * self.batch_size / len(self.plan)


def validation_rows(examples: Examples, seq_len: int, batch_size: int,
                    count: int) -> list[dict[str, np.ndarray]]:
    """Up to ``count`` batches of the held-out conversations, packed (the same every evaluation);
    the last batch padded with empty rows."""
    plan = plan_rows(examples.lengths, seq_len + 1)
    batches = []
    for first in range(0, min(len(plan), count * batch_size), batch_size):
        rows = plan[first: first + batch_size]
        batch = examples.rows(rows + [[]] * (batch_size - len(rows)), seq_len + 1)
        batches.append(batch)
    return batches


PAIR_KEYS = ("chosen", "rejected", "chosen_mask", "rejected_mask")


def pair_rows(examples: Examples, pairs: list[int], length: int) -> dict[str, np.ndarray]:
    """Pairs as a batch for ``dpo_loss``: each side's sequences a row of ``length`` tokens (cut to
    it), with the masks of their completions."""
    sides = {}
    for offset, side in enumerate(("chosen", "rejected")):
        laid = lay_rows([[examples.example(2 * i + offset, length)] for i in pairs], length)
        sides[side], sides[f"{side}_mask"] = laid["tokens"], laid["mask"]
    return sides


class PairRows:
    """Preference pairs (examples ``2i``, chosen, and ``2i + 1``, rejected), ``batch_size`` a step
    in a seeded order: each sequence a row of ``seq_len + 1`` tokens of its own, cut to it."""

    def __init__(self, examples: Examples, seq_len: int, batch_size: int, seed: int) -> None:
        import grain

        self.examples, self.length, self.batch_size = examples, seq_len + 1, batch_size
        self.pairs = len(examples) // 2
        if not self.pairs:
            raise UsageError("the training split holds no preference pair; give more pairs")
        self.cut = int((examples.lengths.reshape(-1, 2) > self.length).any(axis=1).sum())
        self.order = grain.MapDataset.range(self.pairs).shuffle(seed=seed)

    def global_batch(self, step: int, sharding: Sharding) -> dict[str, jax.Array]:
        """The pairs of ``step`` as global arrays; this process reads only its devices' rows."""
        first = step * self.batch_size
        ids = [int(self.order[i]) for i in range(first, first + self.batch_size)]
        return on_devices(lambda some: pair_rows(self.examples, some, self.length), ids, self.length,
                          PAIR_KEYS, sharding)


def pair_validation(examples: Examples, seq_len: int, batch_size: int,
                    count: int) -> list[dict[str, np.ndarray]]:
    """Up to ``count`` batches of the held-out pairs (the same every evaluation); a last batch
    that is not full is filled by the first pairs again, so every pair in it is a real one."""
    pairs = len(examples) // 2
    batches = max(1, min(count, pairs // batch_size))
    return [pair_rows(examples, [(first + i) % pairs for i in range(batch_size)], seq_len + 1)
            for first in range(0, batches * batch_size, batch_size)]
