"""Benchmark 18: LoRA (rank 16) against full fine-tuning of the same Llama-style model.

    python benchmarks/lora.py

One model (random weights; what is measured does not depend on them), FSDP over 8 simulated
CPU devices, AdamW: trained in full, and with rank-16 adapters on all seven projections (the
base weights frozen). Reported per device, from the arrays themselves (device 0's shards):
parameter bytes, optimizer-state bytes, and the compiled step's scratch (``memory_analysis``);
and the step time, median of interleaved steps (the two steps alternate, so load on the
machine falls on both alike). Writes ``benchmarks/results/lora.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax

from shardax.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardax import DeviceMeshManager, LoRA, parallelize  # noqa: E402
from shardax.models.presets import adapter_count, parameter_count  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL = dict(vocab_size=8192, d_model=512, n_heads=8, n_kv_heads=4, n_layers=4, d_ff=1408, positions="rotary",
             norm="rms", mlp="swiglu", tie_embeddings=False, seq_len=128)
BATCH, RANK, STEPS = 8, 16, 7


def device0_bytes(tree) -> int:
    first = jax.devices()[0]
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
               if shard.device == first)


def time_interleaved(runs: dict, steps: int) -> None:
    """Append each run's step times to its ``times``, the runs' steps alternating ``steps`` times."""
    for _ in range(steps):
        for run in runs.values():
            began = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["batch"])
            jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - began)


def main() -> None:
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    base = TransformerConfig(**MODEL)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, MODEL["vocab_size"],
                                                           (BATCH, MODEL["seq_len"] + 1)),
                         jnp.int32)
    runs = {}
    for name, config in (("full", base), ("lora", LoRA(RANK, 2 * RANK).applied(base))):
        parallel = parallelize(lambda rngs, config=config: TransformerLM(config, rngs=rngs),
                               optax.adamw(1e-4), mesh, "fsdp")
        state = parallel.init(0)
        batch = parallel.place_batch({"tokens": tokens})
        step = parallel.train_step(next_token_loss)
        compiled = step.lower(state, batch).compile()
        memory = compiled.memory_analysis()
        runs[name] = {"parallel": parallel, "state": state, "batch": batch, "step": step, "times": [],
                      "row": {
            "parameters_trained": adapter_count(config) if name == "lora" else parameter_count(base),
            "param_bytes_per_device": device0_bytes(state.params),
            "optimizer_bytes_per_device": device0_bytes(state.opt_state),
            "compiled_temp_bytes_per_device": memory.temp_size_in_bytes}}
        for _ in range(2):  # compile and warm up
            runs[name]["state"], metrics = step(runs[name]["state"], batch)
        jax.block_until_ready(metrics)
    time_interleaved(runs, STEPS)
    result = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__}, 8 simulated "
                         "CPU devices",
              "model": MODEL, "parameters": parameter_count(base), "rank": RANK, "batch": BATCH,
              "strategy": "fsdp", "mesh": "data=8"}
    for name, run in runs.items():
        result[name] = {**run["row"], "step_s": statistics.median(run["times"]), "step_s_all": run["times"]}
    result["optimizer_bytes_ratio"] = result["lora"]["optimizer_bytes_per_device"] / result["full"][
        "optimizer_bytes_per_device"]
    result["step_time_ratio"] = result["lora"]["step_s"] / result["full"]["step_s"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "model"}, indent=1))


if __name__ == "__main__":
    main()
