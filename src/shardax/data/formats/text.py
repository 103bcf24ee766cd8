"""The ``text`` format: text files read into memory, every byte a token, random windows (the
default run's data when no tokenizer is given)."""

from __future__ import annotations

import math
from typing import Any

import jax

from shardax.data.batches import WindowSampler, global_rows, validation_batches
from shardax.data.corpus import load_corpus
from shardax.data.registry import TEXT, DataFormat, Procedure, register_format
from shardax.data.tokenizer import ByteTokenizer, padded_vocab
from shardax.models.transformer import weighted_next_token_loss


class ByteText(DataFormat):
    """Text files read into memory; every byte a token, random windows. The model's vocabulary is
    the byte tokenizer's (256 bytes and an end-of-document token that this text never holds,
    padded to 320), so that the run exports with the same ``tokenizer.json`` as ``--tokenizer
    bytes`` runs and fine-tunes from there."""

    name, what, examples, prepared = TEXT, "documents", False, False
    batch_keys = ("tokens",)
    unit, counted = "nats/byte", "bytes"

    def __init__(self, paths: list[str] | None, seq_len: int) -> None:
        self.corpus = load_corpus(paths, min_bytes=seq_len + 1)
        self.tokenizer = ByteTokenizer()
        self.vocab = 256
        self.model_vocab = padded_vocab(self.tokenizer.vocab_size)

    def header(self) -> str:
        corpus = self.corpus
        return (f"data: {corpus.source}: {corpus.files} files, {corpus.train.size:,} train / "
                f"{corpus.validation.size:,} validation bytes"
                + (f", {len(corpus.skipped)} skipped" if corpus.skipped else "")
                + f"; unigram baseline {self.baselines()['unigram']:.4f} nats/byte")

    def baselines(self) -> dict[str, float]:
        return {"unigram": self.corpus.unigram_entropy()}

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        sampler = WindowSampler(self.corpus.train, seq_len, batch, seed)
        return lambda step: sampler.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        return [{"tokens": global_rows(rows, sharding)}
                for rows in validation_batches(self.corpus.validation, seq_len, batch, count)]

    def procedure(self, options: dict[str, Any], adapters: bool) -> Procedure:
        return Procedure(weighted_next_token_loss, self.eval_loss)

    @staticmethod
    def eval_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        loss, weight = weighted_next_token_loss(model, batch)
        return loss, {"bits_per_byte": loss / math.log(2), **weight}

    def prompt(self, length: int) -> list[int]:
        return list(bytes(self.corpus.validation[:length]))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


register_format(ByteText)
