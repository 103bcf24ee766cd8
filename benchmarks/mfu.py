"""Benchmark 7: model FLOPs utilisation (MFU) of shardax's train step on one GPU in bfloat16.

    python benchmarks/mfu.py                      # on a machine with one H100 or H200
    python benchmarks/mfu.py --preset tiny --steps 3 --allow-cpu   # check the script on a CPU

It takes the largest preset (and the largest of its batch size, 1/2, 1/4 or 1/8 of it) whose
compiled step fits the device's memory, with its blocks laid as ``shardax train`` lays them under
dp (in a Python loop on a GPU: ``blocks_in_a_loop``), trains it on random tokens, and reports tokens/s,
the device's peak memory and

    MFU = flops_per_token x tokens per second / the device's dense bf16 peak,

with flops_per_token = 6 N + 12 L d T (``shardax.models.presets.flops_per_token``: N
parameters, L layers, model width d, sequence length T; remat's recomputation not counted).
On a GPU it writes ``benchmarks/results/mfu.json``, which ``run_all.py`` puts in the table;
on a CPU (``--allow-cpu``) it only prints, since a CPU's figure says nothing about the target.
Attention is ``--attention auto`` (cuDNN's fused kernel on a GPU in bfloat16) unless told; the
result names the kernel used and why. It also profiles 3 steps and lists the 5 ops the device
spends most of its time in (``profile_ops.py``). With XLA's command buffers on (the default), the
profiler gives a whole buffer's time to its first kernel; for a true list of ops, run it again
with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` (on an H100 that cost 0.4 points of MFU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
import optax
from gpu_device import first_device
from profile_ops import markdown, profile_top_ops

from shardax import DeviceMeshManager, parallelize
from shardax.analysis.plan import compile_step, compiled_memory
from shardax.models.presets import PRESETS, blocks_in_a_loop, flops_per_token, get_preset, parameter_count
from shardax.models.transformer import TransformerLM, attention_implementation

RESULTS = Path(__file__).parent / "results"

# Dense bfloat16 peak FLOP/s from the vendor's data sheets, matched against jax's device_kind.
PEAK_BF16 = [("H200", 989.4e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12),
             ("A100", 312e12)]


def peak_flops(device: jax.Device, override_tflops: float | None) -> float:
    if override_tflops:
        return override_tflops * 1e12
    for name, peak in PEAK_BF16:
        if name in device.device_kind:
            return peak
    raise SystemExit(f"no bf16 peak known for device {device.device_kind!r}; pass --peak-tflops "
                     f"(e.g. --peak-tflops 989.4 for an H100 SXM)")


def build(preset: str, batch_size: int, remat: str | None, attention: str):
    overrides = {"compute_dtype": "bfloat16", "attention": attention,
                 # blocks laid as shardax train lays them
                 "scan_layers": not blocks_in_a_loop(jax.default_backend(), "dp")} | ({"remat": remat}
                                                                                      if remat else {})
    config = get_preset(preset).config(**overrides)
    mesh = DeviceMeshManager().create_device_mesh("data=1")
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(1e-4), mesh, "dp")
    compiled = compile_step(parallel, batch_size, config.seq_len)
    return config, parallel, compiled, compiled_memory(compiled)["peak"]


def choose(device: jax.Device, presets: list[str], remat: str | None, attention: str, allow_cpu: bool):
    """The first (largest) preset and batch size whose compiled step fits 95% of the device."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit is None and not allow_cpu:
        raise SystemExit(f"device {device.device_kind!r} reports no memory limit; pass --allow-cpu to run "
                         "anyway")
    for preset in presets:
        full = get_preset(preset).batch_size
        for batch_size in (full, full // 2, full // 4, full // 8):
            config, parallel, compiled, peak = build(preset, batch_size, remat, attention)
            print(f"{preset} batch {batch_size}: compiled peak {peak / 1e9:.2f} GB", flush=True)
            if limit is None or peak <= 0.95 * limit:
                return preset, batch_size, config, parallel, compiled, peak
    raise SystemExit("no preset fits this device even at 1/8 of its batch size")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS),
                        help="measure this preset (default: the largest that fits)")
    parser.add_argument("--remat", help="override the preset's remat policy")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after 3 warm-up steps")
    parser.add_argument("--attention", choices=["auto", "xla", "cudnn"], default="auto",
                        help="attention kernel (auto: cuDNN on a GPU in bfloat16)")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense bf16 peak, if not an H100/H200/A100")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on a CPU to check the script (prints only)")
    options = parser.parse_args()

    device, on_gpu = first_device(options.allow_cpu, "MFU needs a GPU", "checks the script here")
    peak = peak_flops(device, options.peak_tflops) if on_gpu else None
    presets = [options.preset] if options.preset else sorted(PRESETS, key=lambda name: -parameter_count(
        get_preset(name).config()))
    preset, batch_size, config, parallel, compiled, compiled_peak = choose(device, presets, options.remat,
                                                                          options.attention,
                                                                          options.allow_cpu)

    state = parallel.init(seed=0)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(batch_size, config.seq_len + 1))
    batch = parallel.place_batch({"tokens": tokens.astype(np.int32)})
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    started = time.perf_counter()
    for _ in range(options.steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - started) / options.steps

    tokens_per_s = batch_size * config.seq_len / step_s
    flops_per_s = flops_per_token(config) * tokens_per_s
    stats = device.memory_stats() or {}
    holder = {"state": state}

    def one_step():
        holder["state"], step_metrics = compiled(holder["state"], batch)
        return step_metrics["loss"]

    top_ops = profile_top_ops(one_step, compiled.as_text(), steps=3, top=5)
    kernel, why = attention_implementation(config)
    result = {
        "benchmark": "mfu", "machine": f"{device.device_kind}, jax {jax.__version__}",
        "preset": preset, "parameters": parameter_count(config), "batch_size": batch_size,
        "seq_len": config.seq_len, "remat": config.remat, "compute_dtype": config.compute_dtype,
        "scan_layers": config.scan_layers,
        "attention": kernel, "attention_why": why,
        "step_s": step_s, "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token(config), "formula": "6 N + 12 L d T per token",
        "model_flops_per_s": flops_per_s, "peak_flops_per_s": peak,
        "mfu": flops_per_s / peak if peak else None, "target": ">= 0.50",
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "compiled_peak_bytes": compiled_peak,
        "final_loss": float(metrics["loss"]), "top_ops": top_ops,
    }
    print(json.dumps(result, indent=1))
    print("top ops:", markdown(top_ops))
    if on_gpu:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "mfu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
