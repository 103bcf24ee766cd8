"""Benchmark 30: supervised fine-tuning packed against one example a row, and a DPO step against an SFT step.

    python benchmarks/post_training.py

The built-in conversations (``python-chats``, rendered with the built-in template, bytes as
tokens) laid into rows of 513 tokens, packed (whole examples sharing rows) and one a row; and
the built-in preference pairs (``python-pairs``). One Llama-style model with LoRA adapters
(rank 8 on every projection), data parallel over 8 simulated CPU devices, AdamW. The steps
alternate (interleaved, median of each), so load on the machine falls on all alike:

- SFT, packed and unpacked, 16 rows a step: learned (assistant) tokens a second, and the steps
  an epoch of the conversations takes;
- DPO, 8 pairs a step (16 rows), with the base weights as the reference (one more forward) and
  with the reference's log-probabilities given in the batch (computed once beforehand), against
  the SFT step of the same 16 rows.

Writes ``benchmarks/results/post_training.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import jax

from shardax.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from lora import time_interleaved  # noqa: E402  (benchmark 18's: the runs' steps alternate)

from shardax import DeviceMeshManager, LoRA, dpo_loss, parallelize  # noqa: E402
from shardax.data.chat import BUILT_IN  # noqa: E402
from shardax.data.conversations import (  # noqa: E402
    assistant_text,
    lay_rows,
    plan_rows,
    preference_texts,
    supervised_tokens,
)
from shardax.data.python_chats import conversations, preference_pairs  # noqa: E402
from shardax.data.tokenizer import ByteTokenizer  # noqa: E402
from shardax.models.preference import sequence_logprobs  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM, weighted_next_token_loss  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LENGTH, ROWS, PAIRS, STEPS = 513, 16, 8, 7
MODEL = dict(vocab_size=320, d_model=256, n_heads=4, n_kv_heads=4, n_layers=4, d_ff=688, positions="rotary",
             norm="rms", mlp="swiglu", tie_embeddings=False, seq_len=LENGTH - 1)


def examples(records, texts) -> list:
    return [supervised_tokens(ByteTokenizer(), text, spans) for record in records
            for text, spans in texts(record)]


def sft_batches(chats: list) -> dict:
    """The conversations' rows, packed and one a row: a step's batch of each, and the rows an epoch takes."""
    found = {}
    for name, pack in (("packed", True), ("unpacked", False)):
        plan = plan_rows([len(ids) for ids, _ in chats], LENGTH, pack=pack)
        rows = lay_rows([[chats[i] for i in row] for row in plan], LENGTH)
        first = {key: value[:ROWS] for key, value in rows.items()}
        found[name] = {"batch": first, "rows": len(plan), "learned": int(rows["mask"][:, 1:].sum()),
                       "tokens": int((rows["segments"] > 0).sum())}
    return found


def pair_batch(pairs: list) -> dict:
    sides = {}
    for offset, side in enumerate(("chosen", "rejected")):
        laid = lay_rows([[pairs[2 * i + offset]] for i in range(PAIRS)], LENGTH)
        sides[side], sides[f"{side}_mask"] = laid["tokens"], laid["mask"]
    return sides


def main() -> None:
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    config = LoRA(8).applied(TransformerConfig(**MODEL))
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(1e-4), mesh, "dp")
    chats = examples(conversations(), lambda record: [assistant_text(record, BUILT_IN, "chat")])
    pairs = examples(preference_pairs()[:PAIRS], lambda record: preference_texts(record, BUILT_IN, "pair"))
    sft = sft_batches(chats)
    dpo = pair_batch(pairs)
    model = parallel.merge(parallel.init(0))
    reference = jax.jit(sequence_logprobs)
    given = {**dpo, "reference_chosen": reference(model, dpo["chosen"], dpo["chosen_mask"]),
             "reference_rejected": reference(model, dpo["rejected"], dpo["rejected_mask"])}
    runs = {}
    for name, loss, batch in (("sft_packed", weighted_next_token_loss, sft["packed"]["batch"]),
                              ("sft_unpacked", weighted_next_token_loss, sft["unpacked"]["batch"]),
                              ("dpo_base_reference", dpo_loss(0.1), dpo),
                              ("dpo_given_reference", dpo_loss(0.1), given)):
        placed = parallel.place_batch({key: jnp.asarray(value) for key, value in batch.items()})
        runs[name] = {"state": parallel.init(0), "step": parallel.train_step(loss), "batch": placed,
                      "times": []}
        for _ in range(2):  # compile and warm up
            runs[name]["state"], metrics = runs[name]["step"](runs[name]["state"], placed)
        jax.block_until_ready(metrics)
    time_interleaved(runs, STEPS)
    steps = {name: statistics.median(run["times"]) for name, run in runs.items()}
    learned = {name: int(sft[name]["batch"]["mask"][:, 1:].sum()) for name in ("packed", "unpacked")}
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__}, 8 simulated CPU "
                   "devices",
        "model": MODEL, "lora_rank": 8, "rows": ROWS, "row_tokens": LENGTH, "pairs": PAIRS,
        "conversations": len(chats),
        "step_s": steps, "step_s_all": {name: run["times"] for name, run in runs.items()},
        "learned_tokens_per_step": learned,
        "learned_tokens_per_s": {name: learned[name] / steps[f"sft_{name}"] for name in learned},
        "epoch_rows": {name: sft[name]["rows"] for name in learned},
        "epoch_s": {name: sft[name]["rows"] / ROWS * steps[f"sft_{name}"] for name in learned},
        "dpo_vs_sft": {name: steps[name] / steps["sft_unpacked"] for name in ("dpo_base_reference",
                                                                            "dpo_given_reference")}}
    result["packed_vs_unpacked"] = (result["learned_tokens_per_s"]["packed"]
                                    / result["learned_tokens_per_s"]["unpacked"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "post_training.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("model", "step_s_all")}, indent=1))


if __name__ == "__main__":
    main()
