"""Benchmark 21: every preset x strategy compiled by XLA:TPU for a TPU slice, on this CPU host.

    python benchmarks/tpu_plan.py                                  # tiny..large on tpu-v5p-8
    python benchmarks/tpu_plan.py --target tpu-v5e-64 --preset 1b  # one preset on another slice
    python benchmarks/tpu_plan.py --analytic-only  # the analytic peak again, against the stored compiles
    python benchmarks/tpu_plan.py --heap-only
        # XLA:TPU's heap-based peak of each stored row (one compile each)

Needs ``pip install "shardax[tpu-plan]"`` (libtpu; no TPU). For each preset (its own batch and
sequence length, float32 weights) and strategy (its default mesh over the slice), ``shardax
plan``'s ``plan_strategy`` with the target: XLA:TPU's compiled peak per chip and whether it fits
the chip's HBM, the bytes its collectives send against the strategy's theory, XLA's FLOPs
(scanned layers extrapolated from 1- and 2-layer compiles) against 6 N tokens + attention, the
roofline step time and its MFU (an upper bound), and shardax's analytic peak against XLA:TPU's.
Rows go to ``benchmarks/results/tpu_plan.json`` keyed by target and preset.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

RESULTS = Path(__file__).parent / "results" / "tpu_plan.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu-v5p-8")
    parser.add_argument("--preset", action="append", help="default: tiny, small, medium, large")
    parser.add_argument("--strategy", action="append", help="default: all")
    parser.add_argument("--analytic-only", action="store_true",
                        help="recompute the analytic peak of every stored row (no compile), after a change "
                             "to it")
    parser.add_argument("--heap-only", action="store_true",
                        help="compile each stored row's step again for XLA:TPU's heap-based peak and what "
                             "fits by it")
    args = parser.parse_args()
    if args.analytic_only:
        return reanalyse()
    if args.heap_only:
        return add_heaps()

    from shardax.analysis.plan import out_of_memory, plan_strategy
    from shardax.analysis.targets import parse_target
    from shardax.models.presets import get_preset
    from shardax.sharding.strategies import STRATEGIES

    target = parse_target(args.target)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in args.preset or ["tiny", "small", "medium", "large"]:
        preset = get_preset(name)
        rows = []
        for strategy in args.strategy or list(STRATEGIES):
            began = time.perf_counter()
            try:
                plan = plan_strategy(preset.config(), strategy, None, batch_size=preset.batch_size,
                                     target=target)
            except Exception as error:  # noqa: BLE001 - a row that says why
                if not out_of_memory(error):
                    raise
                rows.append({"strategy": strategy, "fits": False, "error": str(error).splitlines()[0][:200]})
                print(f"{args.target} {name:<7} {strategy:<8} does not fit: {rows[-1]['error']}", flush=True)
                continue
            row = {"strategy": strategy, "mesh": plan.mesh, "peak_gb": plan.compiled["peak"] / 1e9,
                   "hbm_peak_gb": plan.compiled_bytes_per_device / 1e9,
                   "fits": plan.fits, "sent_mb": plan.collective_bytes / 1e6,
                   "sent_vs_theory": plan.collective_bytes / max(plan.theoretical_collective_bytes, 1),
                   "flops_vs_model": ((plan.cost["flops"] / plan.cost["model_flops"]) if plan.cost["flops"]
                                      else None),
                   "step_ms": plan.roofline["step_s"] * 1e3, "bound": plan.roofline["bound"],
                   "mfu": plan.roofline["mfu"],
                   "predicted_vs_compiled": plan.predicted["total"] / plan.compiled_bytes_per_device,
                   "seconds": time.perf_counter() - began}
            rows.append(row)
            print(f"{args.target} {name:<7} {strategy:<8} {row['peak_gb']:7.3f} GB fits={row['fits']} "
                  f"sent {row['sent_vs_theory']:.2f}x theory, FLOPs {row['flops_vs_model'] or 0:.3f}x model, "
                  f"{row['step_ms']:.3f} ms {row['bound']}-bound, MFU {100 * row['mfu']:.1f}%, "
                  f"analytic peak {row['predicted_vs_compiled']:.2f}x ({row['seconds']:.0f} s)", flush=True)
        kept = [row for row in results.get(f"{args.target} {name}", {}).get("rows", [])
                if row["strategy"] not in {new["strategy"] for new in rows}]  # rows of strategies not rerun
        order = list(STRATEGIES)
        results[f"{args.target} {name}"] = {"batch_size": preset.batch_size,
                                            "seq_len": preset.config().seq_len,
                                            "rows": sorted(kept + rows,
                                                           key=lambda row: order.index(row["strategy"]))}
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def stored_steps(results: dict):
    """(key, entry, target, model, row, parallel) for each stored row that compiled, its step
    built again for its target (abstractly: nothing is compiled here)."""
    from shardax.analysis.plan import transformer_for
    from shardax.analysis.targets import parse_target
    from shardax.models.presets import get_preset

    for key, entry in results.items():
        target_name, name = key.split()
        target, model = parse_target(target_name), get_preset(name).config()
        for row in entry["rows"]:
            if "peak_gb" in row:
                yield key, entry, target, model, row, transformer_for(model, row["strategy"], row["mesh"],
                                                                      None, target)


def reanalyse() -> None:
    """Each stored row's analytic peak against its stored XLA:TPU peak, predicted again from shapes."""
    from shardax.analysis.memory import predict_memory

    results = json.loads(RESULTS.read_text())
    for key, entry, target, model, row, parallel in stored_steps(results):
        schedule = parallel.schedule() if parallel.strategy.pipeline_axis else None
        predicted = predict_memory(parallel, model, entry["batch_size"], model.seq_len, 1, schedule,
                                   compiler=target.chip.platform, on_chip=target.chip.on_chip_bytes)
        compiled = row.get("hbm_peak_gb", row["peak_gb"]) * 1e9  # what XLA:TPU allocates, where known
        before, row["predicted_vs_compiled"] = row["predicted_vs_compiled"], predicted.total / compiled
        print(f"{key} {row['strategy']:<8} analytic peak {before:.3f}x -> "
              f"{row['predicted_vs_compiled']:.3f}x",
              flush=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def add_heaps() -> None:
    """Each stored row's step compiled again: XLA:TPU's heap-based peak (see shardax.analysis.heap)
    and whether the chip holds it."""
    from shardax.analysis.plan import compile_step, compiled_memory, device_bytes

    results = json.loads(RESULTS.read_text())
    for key, entry, target, model, row, parallel in stored_steps(results):
        pipeline = {"microbatches": None, "pipeline_repeats": 1} if parallel.strategy.pipeline_axis else {}
        measured = compiled_memory(compile_step(parallel, entry["batch_size"], model.seq_len, **pipeline))
        row["hbm_peak_gb"] = device_bytes(measured) / 1e9
        row["fits"] = device_bytes(measured) <= target.per_device()["hbm_bytes"]
        print(f"{key} {row['strategy']:<8} {row['peak_gb']:7.3f} GB estimated, {row['hbm_peak_gb']:7.3f} GB "
              f"by XLA:TPU's heap, fits={row['fits']}", flush=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
