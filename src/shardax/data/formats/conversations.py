"""The ``conversations`` format: records of ``messages``, or ``prompt`` and ``completion``, rendered
with a chat template by ``shardax prepare``; whole examples packed into rows (or one a row), the
loss on the tokens the assistant wrote (see ``shardax.data.conversations`` and ``.examples``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.data.batches import global_rows
from shardax.data.chat import ChatTemplate
from shardax.data.conversations import assistant_text
from shardax.data.examples import ExampleRows, Examples, validation_rows
from shardax.data.formats.documents import TokenShards, unigram_nats
from shardax.data.registry import Procedure, register_format
from shardax.models.transformer import token_losses, weighted_next_token_loss


class Conversations(TokenShards):
    """Conversations written by ``shardax prepare``: whole examples packed into rows, the loss
    on the tokens the assistant wrote (see ``shardax.data.examples``). A format of examples with
    a loss mask of its own is this class with ``recognises`` and ``sequences`` changed."""

    name, what, example, examples = "conversations", "conversations", "conversation", True
    learned = "the assistant's"  # which tokens the loss learns, in the header
    batch_keys = ("tokens", "mask", "segments", "positions")

    @staticmethod
    def recognises(record: Any, field: str) -> bool:
        return isinstance(record, dict) and ("messages" in record or {"prompt", "completion"} <= set(record))

    @staticmethod
    def sequences(record: Any, template: Any, where: str) -> list[tuple[str, list[tuple[int, int]]]]:
        return [assistant_text(record, template, where)]

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
                f"{splits['validation']['documents']:,} validation {self.what}, "
                f"{splits['train']['trained']:,} of {splits['train']['tokens']:,} tokens learned "
                f"({self.learned}), {'packed into rows' if self.packing else 'one a row'}{cut}; rendered "
                f"with {self.data.index['chat_template']}; unigram baseline {self.unigram_nats():.4f} "
                "nats/token")

    def unigram_nats(self) -> float:
        tokens, mask = self.train.trained()
        return unigram_nats(tokens[mask > 0], self.vocab)

    def use_packing(self, packing: bool) -> None:
        self.packing = packing

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        rows = ExampleRows(self.train, seq_len, batch, seed, pack=self.packing)
        self.cut = rows.cut
        return lambda step: rows.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        return [{key: global_rows(value, sharding) for key, value in rows.items()}
                for rows in validation_rows(self.held_out, seq_len, batch, count)]

    def procedure(self, options: dict[str, Any], adapters: bool) -> Procedure:
        """The next token's loss on the tokens the mask marks."""
        return Procedure(weighted_next_token_loss, self.eval_loss)

    @staticmethod
    def eval_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        """Nats per token the assistant wrote (the loss) and bits per such token."""
        losses, weights = token_losses(model, batch)
        loss = (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)
        return loss, {"bits_per_token": loss / math.log(2), "weight": weights.sum()}

    def prompt(self, length: int) -> list[int]:
        """The first held-out example up to its first learned token (what the template writes to
        open the reply included): the closing sample is the model's reply."""
        ids, mask = self.held_out.example(0, 1 << 20)
        first = int(np.argmax(mask > 0)) if mask.any() else len(ids)
        return [int(t) for t in ids[:first]][-max(length, 1):]  # its end: the turn the reply answers


register_format(Conversations)
