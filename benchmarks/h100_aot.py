"""Benchmark 23: the deviceless H100 compile (``shardax plan --target h100-1``) against a real H100.

    python benchmarks/h100_aot.py              # on a machine with one H100 (JAX's CUDA plugin installed)
    JAX_PLATFORMS=cpu python benchmarks/h100_aot.py --allow-cpu   # check the script (deviceless side only)

``--target h100-N`` compiles for H100s that are not there, from a description of the chip
(``shardax.analysis.targets.H100_TARGET_CONFIG``). This checks that description against the
chip: the same train step (dp on one device, bfloat16 compute) compiled by XLA:GPU for the GPU
in the machine and for the described one, preset by preset. Equal memory (arguments,
temporaries, outputs, peak) means the plan's fits and per-device figures are the real compiler's.
On the GPU it also records XLA:GPU's own FLOP count (which the deviceless compile cannot give)
against the model's 6N + attention, and the analytic plan's peak against the compiled one.
Writes ``benchmarks/results/h100_aot.json`` on a GPU and prints it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
from gpu_device import first_device

from shardax.analysis.plan import compile_step, compiled_memory, plan_strategy, transformer_for
from shardax.analysis.targets import parse_target
from shardax.models.presets import flops_per_token, get_preset

RESULTS = Path(__file__).parent / "results"
CASES = [("tiny", None), ("small", None), ("medium", None), ("large", 8), ("small", 64)]


def compile_memory(config, batch_size: int, target) -> tuple[dict, object, float]:
    started = time.perf_counter()
    compiled = compile_step(transformer_for(config, "dp", "data=1", None, target), batch_size, config.seq_len)
    return compiled_memory(compiled), compiled, time.perf_counter() - started


def compiled_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return (cost or {}).get("flops")


def one_case(preset: str, batch_size: int | None, on_gpu: bool) -> dict:
    config = get_preset(preset).config(compute_dtype="bfloat16")
    batch_size = batch_size or get_preset(preset).batch_size
    aot, _, aot_s = compile_memory(config, batch_size, parse_target("h100-1"))
    row = {"case": f"{preset} batch {batch_size}", "deviceless": aot, "deviceless_compile_s": aot_s}
    if on_gpu:
        real, compiled, real_s = compile_memory(config, batch_size, None)
        model_flops = flops_per_token(config) * batch_size * config.seq_len
        plan = plan_strategy(config, "dp", "data=1", batch_size=batch_size)
        row |= {"real": real, "real_compile_s": real_s,
                "peak_ratio": aot["peak"] / real["peak"],
                "temporaries_ratio": aot["temporaries"] / max(real["temporaries"], 1),
                "xla_gpu_flops": compiled_flops(compiled), "model_flops": model_flops,
                "flops_ratio": (compiled_flops(compiled) or 0) / model_flops,
                "analytic_peak_ratio": plan.predicted["total"] / plan.compiled["peak"]}
    print(json.dumps(row), flush=True)
    return row


def eight_gpus() -> list[dict]:
    """``--target h100-8`` from this host: 8 described H100s, what each strategy sends."""
    config = get_preset("small").config(compute_dtype="bfloat16")
    rows = []
    for strategy, mesh in (("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2")):
        plan = plan_strategy(config, strategy, mesh, batch_size=16, target=parse_target("h100-8"))
        rows.append({"strategy": strategy, "mesh": mesh, "peak": plan.compiled["peak"],
                     "sent": plan.collective_bytes, "theory": plan.theoretical_collective_bytes})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="compile the deviceless side only, on a CPU")
    options = parser.parse_args()
    device, on_gpu = first_device(options.allow_cpu, "this check needs an H100",
                                  "compiles the deviceless side here")
    rows = [one_case(preset, batch, on_gpu) for preset, batch in CASES]
    result = {"benchmark": "h100_aot", "machine": f"{device.device_kind}, jax {jax.__version__}",
              "strategy": "dp on data=1, bfloat16 compute", "cases": rows, "h100_8": eight_gpus()}
    if on_gpu:
        ratios = [row["peak_ratio"] for row in rows]
        result["peak_ratio_range"] = [min(ratios), max(ratios)]
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "h100_aot.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({key: value for key, value in result.items() if key != "cases"}, indent=1))


if __name__ == "__main__":
    main()
