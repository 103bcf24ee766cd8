"""The ``preferences`` format: pairs (``prompt``, ``chosen``, ``rejected``) written by ``shardax
prepare`` as their two sequences, trained with DPO (``shardax.models.preference``): against the
base weights of a model with LoRA adapters (the adapters left out), else against a frozen copy of
the model's first weights, a second part of the run (full DPO)."""

from __future__ import annotations

import math
from typing import Any

import jax

from shardax.data.batches import global_rows
from shardax.data.conversations import preference_texts
from shardax.data.examples import PAIR_KEYS, PairRows, pair_validation
from shardax.data.formats.conversations import Conversations
from shardax.data.registry import Procedure, register_format
from shardax.errors import UsageError
from shardax.models.preference import dpo_eval_step, dpo_loss, dpo_step


class Preferences(Conversations):
    """Preference pairs written by ``shardax prepare``, trained with DPO (``dpo_loss``): the batch
    holds each pair's chosen and rejected sequences and the masks of their completions."""

    name, what, example, sequences_per_example = "preferences", "preference pairs", "pair", 2
    options, purpose, give = ("dpo_beta", "dpo_label_smoothing"), "DPO", "pairs (prompt, chosen, rejected)"
    batch_keys = PAIR_KEYS
    unit = "nats/pair"  # of the loss (DPO's: -log sigmoid of the reward margin)
    against = ""  # the reference, once the procedure is chosen (for the header)

    @staticmethod
    def recognises(record: Any, field: str) -> bool:
        return isinstance(record, dict) and {"chosen", "rejected"} <= set(record)

    @staticmethod
    def sequences(record: Any, template: Any, where: str) -> list[tuple[str, list[tuple[int, int]]]]:
        return preference_texts(record, template, where)

    def baselines(self) -> dict[str, float]:
        """DPO's loss while the policy is still its reference: log 2 (the reward margin is 0)."""
        return {"policy = reference": math.log(2)}

    def header(self) -> str:
        splits = self.data.index["splits"]
        cut = f"; {self.cut:,} longer than a row, cut to it" if self.cut else ""
        return (f"data: {self.data.root}: {splits['train']['documents'] // 2:,} train / "
                f"{splits['validation']['documents'] // 2:,} validation preference pairs{cut}; rendered with "
                f"{self.data.index['chat_template']}{self.against}")

    def use_packing(self, packing: bool) -> None:
        raise UsageError("--no-packing lays conversations one a row, and --data holds preference pairs "
                         "(always one a row); leave it out")

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any):
        rows = PairRows(self.train, seq_len, batch, seed)
        self.cut = rows.cut
        return lambda step: rows.global_batch(step, sharding)

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[dict[str, jax.Array]]:
        return [{key: global_rows(value, sharding) for key, value in rows.items()}
                for rows in pair_validation(self.held_out, seq_len, batch, count)]

    def procedure(self, options: dict[str, Any], adapters: bool) -> Procedure:
        """DPO (``dpo_beta``, ``dpo_label_smoothing``): a model with LoRA adapters against its base
        weights (no second copy), any other against a frozen copy of its first weights."""
        dpo = {name: options[key] for name, key in (("beta", "dpo_beta"),
                                                     ("label_smoothing", "dpo_label_smoothing"))
               if options.get(key) is not None}
        if adapters:
            self.against = "; DPO against the base weights (the adapters left out)"
            loss = dpo_loss(**dpo)
            return Procedure(loss, loss)
        self.against = "; DPO against a frozen copy of the model's first weights (the reference)"
        return Procedure(step=dpo_step(**dpo), eval_step=dpo_eval_step(**dpo))


register_format(Preferences)
