"""The LM job's data: bytes of text held in memory (the default), or token shards read lazily.

``open_data`` chooses: a ``--data`` directory written by ``shardax prepare`` is read as shards;
``--tokenizer`` tokenizes the inputs into shards first (in a cache directory, once); otherwise
the text is read into memory as bytes, as the two-command default run does with the standard
library. Both give the Trainer a batch function of the step, fixed validation batches, and a
loss reported per token and per byte of text, so runs with different tokenizers compare.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.data.batches import WindowSampler, validation_batches
from shardax.data.chat import ChatTemplate
from shardax.data.corpus import default_sources, load_corpus
from shardax.data.documents import detect_format, input_files
from shardax.data.examples import (
    PAIR_KEYS,
    ExampleRows,
    Examples,
    PairRows,
    pair_validation,
    validation_rows as example_validation,
)
from shardax.data.index import INDEX, read_index
from shardax.data.prepare import prepare
from shardax.data.shards import PackedBatches, PreparedData, validation_rows
from shardax.data.tokenizer import ByteTokenizer, padded_vocab
from shardax.errors import UsageError
from shardax.models.preference import dpo_loss
from shardax.models.transformer import token_losses, weighted_next_token_loss


def global_rows(rows: np.ndarray, sharding: Any) -> jax.Array:
    """Rows every process knows in full, as a global array (each process fills its own devices)."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def _unigram_nats(tokens: np.ndarray, vocab: int) -> float:
    counts = np.bincount(tokens, minlength=vocab).astype(np.float64)
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())


class ByteText:
    """Text files read into memory; every byte a token, random windows. The model's vocabulary is
    the byte tokenizer's (256 bytes and an end-of-document token that this text never holds,
    padded to 320), so that the run exports with the same ``tokenizer.json`` as ``--tokenizer
    bytes`` runs and fine-tunes from there."""

    batch_keys = ("tokens",)  # what each batch holds: (batch, seq_len + 1) int32 arrays

    tokenizer_fingerprint = None
    unit = "nats/byte"  # of the loss

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
                + f"; unigram baseline {self.unigram_nats():.4f} nats/byte")

    def unigram_nats(self) -> float:
        return self.corpus.unigram_entropy()

    def baselines(self) -> dict[str, float]:
        """The losses the run's summary and plot set the model's beside."""
        return {"unigram": self.unigram_nats()}

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        sampler = WindowSampler(self.corpus.train, seq_len, batch, seed)
        return lambda step: sampler.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        return [{"tokens": global_rows(rows, sharding)}
                for rows in validation_batches(self.corpus.validation, seq_len, batch, count)]

    @staticmethod
    def eval_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        loss, weight = weighted_next_token_loss(model, batch)
        return loss, {"bits_per_byte": loss / math.log(2), **weight}

    def prompt(self, length: int) -> list[int]:
        return list(bytes(self.corpus.validation[:length]))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenShards:
    """Shards written by ``shardax prepare``, packed into windows and read lazily."""

    batch_keys = ("tokens", "segments", "positions")
    unit = "nats/token"  # of the loss

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
        return _unigram_nats(self.data.train.read(0, 1 << 22), self.vocab)  # the first 4M tokens

    def baselines(self) -> dict[str, float]:
        """The losses the run's summary and plot set the model's beside."""
        return {"unigram": self.unigram_nats()}

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        packed = PackedBatches(self.data.train, seq_len, batch, seed, self.data.eod_id)
        return lambda step: packed.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        rows = validation_rows(self.data.validation, seq_len, batch, count, self.data.eod_id,
                               self.token_bytes)
        return [{key: global_rows(value, sharding) for key, value in batch_rows.items()}
                for batch_rows in rows]

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

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class Conversations(TokenShards):
    """Conversations written by ``shardax prepare``: whole examples packed into rows, the loss
    on the tokens the assistant wrote (see ``shardax.data.examples``)."""

    batch_keys = ("tokens", "mask", "segments", "positions")

    def __init__(self, root: Path, source: str | None = None) -> None:
        super().__init__(root, source)
        index, dtype = self.data.index, self.data.index["dtype"]
        self.train = Examples(self.data.root, index["splits"]["train"]["shards"], dtype, self.vocab)
        self.held_out = Examples(self.data.root, index["splits"]["validation"]["shards"], dtype, self.vocab)
        self.template = ChatTemplate.from_tokenizer_config(self.data.root)
        self.end_of_turn = self.template.end_of_turn()
        self.cut = 0
        self.packing = True  # whole conversations share rows; False: one a row

    def header(self) -> str:
        splits = self.data.index["splits"]
        cut = f"; {self.cut:,} longer than a row, cut to it" if self.cut else ""
        return (f"data: {self.data.root}: {splits['train']['documents']:,} train / "
                f"{splits['validation']['documents']:,} validation conversations, "
                f"{splits['train']['trained']:,} of {splits['train']['tokens']:,} tokens learned (the "
                f"assistant's), {'packed into rows' if self.packing else 'one a row'}{cut}; rendered with "
                f"{self.data.index['chat_template']}; unigram baseline {self.unigram_nats():.4f} nats/token")

    def unigram_nats(self) -> float:
        tokens, mask = self.train.trained()
        return _unigram_nats(tokens[mask > 0], self.vocab)

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        rows = ExampleRows(self.train, seq_len, batch, seed, pack=self.packing)
        self.cut = rows.cut
        return lambda step: rows.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        return [{key: global_rows(value, sharding) for key, value in rows.items()}
                for rows in example_validation(self.held_out, seq_len, batch, count)]

    @staticmethod
    def eval_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        """Nats per token the assistant wrote (the loss) and bits per such token."""
        losses, weights = token_losses(model, batch)
        loss = (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)
        return loss, {"bits_per_token": loss / math.log(2), "weight": weights.sum()}

    def prompt(self, length: int) -> list[int]:
        """The first held-out conversation up to its assistant's first reply (what the template
        writes to open it included): the closing sample is the model's reply."""
        ids, mask = self.held_out.example(0, 1 << 20)
        first = int(np.argmax(mask > 0)) if mask.any() else len(ids)
        return [int(t) for t in ids[:first]][-max(length, 1):]  # its end: the turn the reply answers


class Preferences(Conversations):
    """Preference pairs written by ``shardax prepare``, trained with DPO (``dpo_loss``): the batch
    holds each pair's chosen and rejected sequences and the masks of their completions."""

    batch_keys = PAIR_KEYS
    unit = "nats/pair"  # of the loss (DPO's: -log sigmoid of the reward margin)

    def __init__(self, root: Path, source: str | None = None) -> None:
        super().__init__(root, source)
        self.eval_loss = dpo_loss()  # the run sets its beta and label smoothing (``use_loss``)

    def use_loss(self, loss: Any) -> None:
        self.eval_loss = loss

    def baselines(self) -> dict[str, float]:
        """DPO's loss while the policy is still its reference: log 2 (the reward margin is 0)."""
        return {"policy = reference": math.log(2)}

    def header(self) -> str:
        splits = self.data.index["splits"]
        cut = f"; {self.cut:,} longer than a row, cut to it" if self.cut else ""
        return (f"data: {self.data.root}: {splits['train']['documents'] // 2:,} train / "
                f"{splits['validation']['documents'] // 2:,} validation preference pairs{cut}; rendered with "
                f"{self.data.index['chat_template']}")

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        rows = PairRows(self.train, seq_len, batch, seed)
        self.cut = rows.cut
        return lambda step: rows.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        return [{key: global_rows(value, sharding) for key, value in rows.items()}
                for rows in pair_validation(self.held_out, seq_len, batch, count)]


def cache_root() -> Path:
    return Path(os.environ.get("SHARDAX_DATA_CACHE") or Path.home() / ".cache" / "shardax" / "data")


def _prepared_directory(paths: list[str] | None) -> Path | None:
    if paths and len(paths) == 1 and (Path(paths[0]) / INDEX).is_file():
        return Path(paths[0])
    return None


def _opened(root: Path, source: str | None = None) -> TokenShards:
    """A prepared directory as the data of a run: conversations or documents, as it holds."""
    kind = (read_index(root) or {}).get("kind")
    opened = {"conversations": Conversations, "preferences": Preferences}.get(kind, TokenShards)
    return opened(root, source)


def _check_tokenizer_matches(data: TokenShards, prepared: Path, tokenizer: str,
                             vocab_size: int | None) -> None:
    wanted = {"kind": "file"} if tokenizer not in ("bytes", "bpe") else {"kind": tokenizer}
    made = data.data.index["settings"]["tokenizer"]
    if made["kind"] != wanted["kind"] or (vocab_size and made.get("vocab_size") != vocab_size):
        raise UsageError(f"--data {prepared} holds shards made with {data.data.index['tokenizer_name']}, not "
                         f"--tokenizer {tokenizer}" + (f" --vocab-size {vocab_size}" if vocab_size else "")
                         + "; drop --tokenizer to train on them, or prepare the text again")


def _holds_examples(paths: list[str], field: str) -> bool:
    """Whether ``--data`` names conversations or preference pairs (what else it may be, the text
    reader says)."""
    try:
        return detect_format(input_files(paths)[0], field) != "documents"
    except UsageError:
        return False


def open_data(paths: list[str] | None, tokenizer: str | None, vocab_size: int | None, field: str | None,
              seq_len: int, template: str | None = None,
              data_format: str | None = None) -> ByteText | TokenShards:
    """The data a run reads (see the module docstring); conversations (JSON lines or Parquet of
    ``messages`` or ``prompt``/``completion``) render with ``template`` (default: the tokenizer's
    own, else the built-in one). Only process 0 prepares; the others wait for it and then read
    the same shards, which must be on storage they share."""
    prepared = _prepared_directory(paths)
    if prepared is not None:
        data = _opened(prepared)
        if tokenizer is not None:
            _check_tokenizer_matches(data, prepared, tokenizer, vocab_size)
        return data
    examples = (data_format not in (None, "documents")
                or bool(paths) and _holds_examples(paths, field or "text"))
    if tokenizer is None and paths and examples:
        tokenizer = "bytes"  # conversations and pairs are read as examples, from shards
    if tokenizer is None:
        if vocab_size is not None:
            raise UsageError(f"--vocab-size {vocab_size} needs --tokenizer bpe")
        return ByteText(paths, seq_len)
    inputs = [str(p) for p in default_sources() if p.stat().st_size] if not paths else paths
    key = json.dumps([sorted(str(Path(p).resolve()) for p in inputs), tokenizer, vocab_size, field or "text"]
                     + ([str(Path(template).resolve())] if template else [])
                     + ([data_format] if data_format else []))
    root = cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]
    if jax.process_index() == 0:
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.with_name(root.name + ".lock"), "w") as lock:  # two runs on one machine prepare once
            fcntl.flock(lock, fcntl.LOCK_EX)
            prepare(inputs, root, tokenizer=tokenizer, vocab_size=vocab_size, field=field or "text",
                    template=template, data_format=data_format or "auto")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("shardax data prepared")
    return _opened(root, None if paths else "the Python standard library")
