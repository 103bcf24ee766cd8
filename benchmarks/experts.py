"""Benchmark 27: a mixture of experts with its experts split over an ``expert`` axis against the
same model with them replicated (dp).

    python benchmarks/experts.py

A Mixtral-style model (8 experts, 2 per token, random weights) with AdamW over 8 simulated CPU
devices: dp on ``data=8`` (every device holds every expert and computes its own tokens' copies),
ep on ``data=2,expert=4`` and fsdp_ep on ``data=2,expert=4`` (each device holds 2 experts; token
copies go to their experts' devices and back by all-to-all). Per strategy: the experts' bytes
on device 0 (from the arrays) against their total / E per expert held, the compiled step's
all-to-all bytes against ``expert_exchange_bytes`` (theory), and the step time, median of steps
of the three interleaved (load on the machine falls on all alike). Writes
``benchmarks/results/experts.json``.

The simulated devices share this machine's cores, so the step times say what the exchange and
the sorting cost here, not what experts split over real accelerators save.
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
import numpy as np  # noqa: E402
import optax  # noqa: E402
from lora import device0_bytes, time_interleaved  # noqa: E402  (benchmarks/lora.py, beside this one)

from shardax import parallelize  # noqa: E402
from shardax.analysis.collectives import find_collectives  # noqa: E402
from shardax.analysis.theory import expert_exchange_bytes  # noqa: E402
from shardax.analysis.traffic import wire_bytes  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL = dict(vocab_size=4096, d_model=256, n_heads=8, n_kv_heads=4, n_layers=4, d_ff=512, positions="rotary",
             norm="rms", mlp="swiglu", tie_embeddings=False, seq_len=128, n_experts=8, experts_per_token=2,
             router_aux_loss=0.001)
BATCH, STEPS = 16, 15
LAYOUTS = {"dp": "data=8", "ep": "data=2,expert=4", "fsdp_ep": "data=2,expert=4"}


def all_to_all_bytes(step, state, batch, devices: int) -> float:
    text = step.lower(state, batch).compile().as_text()
    return sum(wire_bytes(c, devices) * c.executions
               for c in find_collectives(text) if c.kind == "all-to-all")


def main() -> None:
    config = TransformerConfig(**MODEL)
    tokens = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (BATCH, MODEL["seq_len"] + 1))
    runs, rows = {}, {}
    for strategy, mesh in LAYOUTS.items():
        parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(1e-4), mesh,
                               strategy)
        state, step = parallel.init(0), parallel.train_step(next_token_loss)
        batch = parallel.place_batch({"tokens": jnp.asarray(tokens, jnp.int32)})
        experts = state.params["blocks"]["layers"]["experts"]
        whole = sum(leaf[...].nbytes for leaf in (experts["gate_up"], experts["down"]))
        held = device0_bytes([experts["gate_up"][...], experts["down"][...]])
        rows[strategy] = {"mesh": mesh, "expert_bytes_per_device": held, "expert_bytes_total": whole,
                          "experts_held_per_device": round(held / whole * config.n_experts, 3),
                          "all_to_all_bytes_compiled": all_to_all_bytes(step, state, batch, 8),
                          "all_to_all_bytes_theory": expert_exchange_bytes(parallel.layout, config, BATCH)}
        for _ in range(2):  # compile and warm up
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs[strategy] = {"state": state, "batch": batch, "step": step, "times": []}
    time_interleaved(runs, STEPS)
    for strategy, run in runs.items():
        rows[strategy]["step_s"] = statistics.median(run["times"])
        rows[strategy]["step_time_vs_dp"] = rows[strategy]["step_s"] / statistics.median(runs["dp"]["times"])
        theory = rows[strategy]["all_to_all_bytes_theory"]
        rows[strategy]["all_to_all_vs_theory"] = (rows[strategy]["all_to_all_bytes_compiled"] / theory
                                                  if theory else None)
    result = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__}, 8 simulated "
                         "CPU devices",
              "model": MODEL, "batch": BATCH, "strategies": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "experts.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
