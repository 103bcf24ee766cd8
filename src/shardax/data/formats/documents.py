"""The ``documents`` format: text files, or JSON-lines/Parquet records of a text field, written
by ``shardax prepare`` into token shards and read lazily, packed into windows (every token learned)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.data.batches import global_rows
from shardax.data.registry import DOCUMENTS, DataFormat, Procedure, register_format
from shardax.data.shards import PackedBatches, PreparedData, validation_rows
from shardax.data.tokenizer import padded_vocab
from shardax.models.transformer import token_losses, weighted_next_token_loss


def unigram_nats(tokens: np.ndarray, vocab: int) -> float:
    """Nats per token of the best model that ignores context, fitted to ``tokens``."""
    counts = np.bincount(tokens, minlength=vocab).astype(np.float64)
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())


class TokenShards(DataFormat):
    """Shards written by ``shardax prepare``, packed into windows and read lazily."""

    name, what, examples = DOCUMENTS, "documents", False
    batch_keys = ("tokens", "segments", "positions")

    @staticmethod
    def recognises(record: Any, field: str) -> bool:
        return not isinstance(record, dict) or field in record

    def __init__(self, root: Path, source: str | None = None) -> None:
        # what the shards were made from, when not named by the user (the built-in corpus)
        self.source = source
        self.data = PreparedData(root)
        self.tokenizer = self.data.tokenizer
        self.vocab = self.tokenizer.vocab_size
        self.model_vocab = padded_vocab(self.vocab)
        self.tokenizer_fingerprint = self.data.index["tokenizer"]
        self.token_bytes = self.tokenizer.token_bytes()

    def header(self) -> str:
        source = f"{self.source}, tokenized into " if self.source else ""
        return f"data: {source}{self.data.describe()}; unigram baseline {self.unigram_nats():.4f} nats/token"

    def unigram_nats(self) -> float:
        return unigram_nats(self.data.train.read(0, 1 << 22), self.vocab)  # the first 4M tokens

    def baselines(self) -> dict[str, float]:
        return {"unigram": self.unigram_nats()}

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        packed = PackedBatches(self.data.train, seq_len, batch, seed, self.data.eod_id)
        return lambda step: packed.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        rows = validation_rows(self.data.validation, seq_len, batch, count, self.data.eod_id,
                               self.token_bytes)
        return [{key: global_rows(value, sharding) for key, value in batch_rows.items()}
                for batch_rows in rows]

    def procedure(self, options: dict[str, Any], adapters: bool) -> Procedure:
        """The next token's loss on the tokens learned."""
        return Procedure(weighted_next_token_loss, self.eval_loss)

    @staticmethod
    def eval_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        """Nats per token (the loss), bits per token, and bits per byte of the text predicted."""
        losses, weights = token_losses(model, batch)
        nats = (losses * weights).sum()
        loss = nats / jnp.maximum(weights.sum(), 1.0)
        per_byte = nats / jnp.maximum(batch["target_bytes"].sum().astype(jnp.float32), 1.0)
        return loss, {"bits_per_token": loss / math.log(2), "bits_per_byte": per_byte / math.log(2),
                      "weight": weights.sum()}

    def prompt(self, length: int) -> list[int]:
        return [int(t) for t in self.data.validation.read(0, length)]


register_format(TokenShards)
