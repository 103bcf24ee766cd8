"""Benchmark 26: a moving average of the weights (``shardax.ema_params``): its bytes per device
against the parameters', and its cost per step.

    python benchmarks/ema.py
    python benchmarks/ema.py --accelerator   # on a GPU/TPU machine: a 0.2B model, dp over its devices

A Llama-style model (random weights) with AdamW over 8 simulated CPU devices, under dp, zero2
and fsdp, with and without ``ema_params(0.999)`` chained last. Per device, from the arrays
themselves (device 0's shards): parameter bytes and the average's bytes; the step time, median
of interleaved steps (with and without alternate, so load on the machine falls on both alike).
The average is laid out like the optimizer state, so it costs a replica of the parameters per
device under dp and one share of them under zero2 and fsdp. Writes ``benchmarks/results/ema.json``.
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

import sys  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from lora import device0_bytes, time_interleaved  # noqa: E402  (benchmarks/lora.py, beside this one)

from shardax import DeviceMeshManager, ema_params, parallelize  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss  # noqa: E402
from shardax.step.ema import EmaState  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# --accelerator: a model whose optimizer update is a visible part of a step on one GPU (0.2B parameters)
ACCELERATOR_MODEL = dict(vocab_size=32000, d_model=1024, n_heads=16, n_kv_heads=8, n_layers=12, d_ff=2816,
                         positions="rotary", norm="rms", mlp="swiglu", tie_embeddings=False, seq_len=1024,
                         compute_dtype="bfloat16")
MODEL = dict(vocab_size=4096, d_model=256, n_heads=8, n_kv_heads=4, n_layers=4, d_ff=688, positions="rotary",
             norm="rms", mlp="swiglu", tie_embeddings=False, seq_len=128)
BATCH, STEPS = 16, 15


def average_of(opt_state):
    [state] = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda node: isinstance(node, EmaState))
               if isinstance(leaf, EmaState)]
    return state.average


def measure(strategy: str, mesh, tokens, model: dict = MODEL, steps: int = STEPS) -> dict:
    config = TransformerConfig(**model)
    runs = {}
    for name, tx in (("without", optax.adamw(1e-4)),
                     ("with", optax.chain(optax.adamw(1e-4), ema_params(0.999)))):
        parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), tx, mesh, strategy)
        state = parallel.init(0)
        batch = parallel.place_batch({"tokens": tokens})
        step = parallel.train_step(next_token_loss)
        for _ in range(2):  # compile and warm up
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs[name] = {"state": state, "batch": batch, "step": step, "times": []}
    time_interleaved(runs, steps)
    with_ema = runs["with"]["state"]
    row = {"param_bytes_per_device": device0_bytes(with_ema.params),
           "ema_bytes_per_device": device0_bytes(average_of(with_ema.opt_state)),
           "step_s_without": statistics.median(runs["without"]["times"]),
           "step_s_with": statistics.median(runs["with"]["times"])}
    row["ema_bytes_ratio"] = row["ema_bytes_per_device"] / row["param_bytes_per_device"]
    row["step_time_ratio"] = row["step_s_with"] / row["step_s_without"]
    return row


def main() -> None:
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, MODEL["vocab_size"],
                                                           (BATCH, MODEL["seq_len"] + 1)),
                         jnp.int32)
    result = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__}, 8 simulated "
                         "CPU devices",
              "model": MODEL, "batch": BATCH, "decay": 0.999, "mesh": "data=8",
              "strategies": {strategy: measure(strategy, mesh, tokens)
                             for strategy in ("dp", "zero2", "fsdp")}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ema.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["strategies"], indent=1))


def main_accelerator() -> None:
    """dp over this machine's accelerators (one H100 or H200 here), the larger model, bfloat16 compute."""
    devices = jax.devices()
    mesh = DeviceMeshManager().create_device_mesh(f"data={len(devices)}")
    batch = 8 * len(devices)
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        0, ACCELERATOR_MODEL["vocab_size"], (batch, ACCELERATOR_MODEL["seq_len"] + 1)), jnp.int32)
    row = measure("dp", mesh, tokens, ACCELERATOR_MODEL, steps=20)
    kind = devices[0].device_kind
    result = {"machine": f"{len(devices)} x {kind}, jax {jax.__version__}", "model": ACCELERATOR_MODEL,
              "batch": batch, "decay": 0.999, "mesh": f"data={len(devices)}", "strategies": {"dp": row}}
    RESULTS.mkdir(exist_ok=True)
    name = "ema_" + "".join(c if c.isalnum() else "_" for c in kind.lower()) + ".json"
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main_accelerator() if "--accelerator" in sys.argv[1:] else main()
