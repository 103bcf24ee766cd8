"""Deterministic batches of byte windows, resumable from a step number, read per process.

Training windows are the corpus cut into ``seq_len + 1``-byte pieces at multiples of
``seq_len``; each epoch visits them in an order drawn from ``seed`` and the epoch number. The
global batch of step ``s`` is a pure function of ``(seed, s)``, so the loader's whole position
is the step number: resuming at step ``s`` continues with exactly the next batch.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Sharding

from shardax.errors import UsageError


class WindowSampler:
    """Windows of ``seq_len + 1`` tokens from a 1-D token array, ``batch_size`` per step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise UsageError(
                f"the text has {len(tokens)} bytes, shorter than one window of `seq_len={seq_len}` + 1; "
                "give more text or a shorter seq_len"
            )

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.windows)

    def window_ids(self, step: int) -> np.ndarray:
        """Which windows make up the global batch of ``step`` (wrapping into later epochs)."""
        first = step * self.batch_size
        ids = [
            self._order(position // self.windows)[position % self.windows]
            for position in range(first, first + self.batch_size)
        ]
        return np.asarray(ids)

    def rows(self, window_ids: np.ndarray) -> np.ndarray:
        """``(len(window_ids), seq_len + 1)`` int32 tokens."""
        starts = window_ids * self.seq_len
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)

    def global_batch(self, step: int, sharding: Sharding) -> dict[str, jax.Array]:
        """The batch of ``step`` as a global array; this process reads only the rows its devices hold."""
        ids = self.window_ids(step)
        shape = (self.batch_size, self.seq_len + 1)
        tokens = jax.make_array_from_callback(shape, sharding,
                                              lambda index: self.rows(ids[index[0]])[:, index[1]])
        return {"tokens": tokens}

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.windows


def validation_batches(tokens: np.ndarray, seq_len: int, batch_size: int, count: int) -> list[np.ndarray]:
    """The first ``count`` batches of consecutive validation windows (the same every evaluation)."""
    sampler = WindowSampler(tokens, seq_len, batch_size, seed=0)
    ids = np.arange(min(count * batch_size, sampler.windows - sampler.windows % batch_size or batch_size))
    ids = ids % sampler.windows
    return [sampler.rows(ids[i : i + batch_size])
            for i in range(0, len(ids) - batch_size + 1, batch_size)] or [
        sampler.rows(np.arange(batch_size) % sampler.windows)
    ]


def global_rows(rows: np.ndarray, sharding: Sharding) -> jax.Array:
    """Rows every process knows in full, as a global array (each process fills its own devices)."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])
