"""Benchmark 22: what XLA:CPU decided, measured on XLA:TPU's compile (no TPU needed).

    python benchmarks/tpu_decisions.py                        # small and medium on tpu-v5p-8
    python benchmarks/tpu_decisions.py --preset large --target tpu-v5e-16

Choices in the train step that were made by measuring XLA:CPU, each compiled by XLA:TPU both
ways (the step as shipped, and with the choice undone while tracing): the layer norm and GELU
with custom VJPs that keep only their input for the backward pass (``shardax.models.
transformer``); on TPUs, a select around the optimizer update rather than a ``lax.cond`` that
computes the update only when it applies (``shardax.step.train.keep_where``; XLA:CPU keeps the
cond);
layers in a Python loop left without ``nnx.remat`` when nothing is recomputed or gathered
(``shardax.blocks.LayerStack``). Besides, each remat policy's compiled peak and FLOPs (what it
saves and what it recomputes). All for dp over the slice, in bfloat16 compute as an
accelerator runs it, compared by XLA:TPU's compiled peak per chip, its FLOPs and HBM bytes
(``step_cost``), and the roofline step time. Needs ``pip install
"shardax[tpu-plan]"``. Rows go to ``benchmarks/results/tpu_decisions.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from step_variants import cond_update, plain_autodiff, remat_every_loop  # noqa: E402

from shardax.analysis.plan import compile_step, compiled_memory, step_cost, transformer_for  # noqa: E402
from shardax.analysis.targets import parse_target, roofline  # noqa: E402
from shardax.models import transformer  # noqa: E402
from shardax.models.presets import flops_per_token, get_preset  # noqa: E402
from shardax.sharding.strategies import get_strategy  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "tpu_decisions.json"


def measure(target, preset: str, variant, **settings) -> dict:
    config = get_preset(preset).config(**{"compute_dtype": "bfloat16", **settings})
    batch = get_preset(preset).batch_size
    strategy = get_strategy("dp")
    with variant():
        compiled = compile_step(transformer_for(config, strategy, target=target), batch, config.seq_len)
        flops, hbm = step_cost(config, strategy, None, None, target, batch, 1, compiled)
    model_flops = flops_per_token(config) * batch * config.seq_len / len(target.devices())
    bound = roofline(target, flops, hbm, 0.0, model_flops)  # dp's gradient all-reduce is the same both ways
    return {"peak_bytes": compiled_memory(compiled)["peak"], "flops": flops, "hbm_bytes": hbm,
            "compute_ms": bound.compute_s * 1e3, "memory_ms": bound.memory_s * 1e3,
            "step_ms": bound.step_s * 1e3}


def update_by_strategy(target) -> dict:
    """The select around the update against a ``lax.cond`` under each strategy (8 chips), on
    ``small`` (activations dominate) and a wide, shallow model on short sequences (parameters
    and optimizer state dominate), in float32: XLA:TPU's compiled peak per chip both ways."""
    wide = transformer.TransformerConfig(vocab_size=256, seq_len=16, d_model=512, n_heads=4, n_layers=2,
                                         d_ff=2048)
    rows = []
    for name, config, batch in [("small", get_preset("small").config(), 64), ("wide and shallow", wide, 16)]:
        for strategy, mesh in [("dp", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"),
                               ("tp", "data=4,model=2"), ("hsdp", "replica=2,data=4")]:
            peaks = []
            for variant in (contextlib.nullcontext, cond_update):
                with variant():
                    compiled = compile_step(transformer_for(config, strategy, mesh, target=target), batch,
                                            config.seq_len)
                peaks.append(compiled_memory(compiled)["peak"])
            rows.append({"model": name, "strategy": strategy, "mesh": mesh, "select_peak_bytes": peaks[0],
                         "cond_peak_bytes": peaks[1], "select_vs_cond": peaks[0] / peaks[1]})
            print(f"{target.name} {name:<16} {strategy:<6} select {peaks[0] / 1e6:.1f} MB, cond "
                  f"{peaks[1] / 1e6:.1f} MB ({peaks[0] / peaks[1]:.3f}x)", flush=True)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu-v5p-8")
    parser.add_argument("--preset", action="append", help="default: small, medium")
    parser.add_argument("--update-only", action="store_true",
                        help="only the select against a cond, per strategy")
    args = parser.parse_args()
    target = parse_target(args.target)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    # (row, how the step is traced, model settings): the step as shipped first, then each choice undone
    variants = [("as shipped", contextlib.nullcontext, {}),
                ("without custom VJPs (layer norm, GELU)", plain_autodiff, {}),
                ("with a lax.cond around the update", cond_update, {}),
                ("layers in a loop, as shipped (no remat)", contextlib.nullcontext, {"scan_layers": False}),
                ("layers in a loop under remat", remat_every_loop, {"scan_layers": False}),
                *[(f"remat {policy}", contextlib.nullcontext, {"remat": policy})
                  for policy in ("full", "dots_saveable", "dots_with_no_batch_dims_saveable")]]
    eight = parse_target("tpu-v5p-16")  # 8 chips, for the strategies' 8-device meshes
    results[f"{eight.name} update: select vs cond"] = update_by_strategy(eight)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    for preset in [] if args.update_only else args.preset or ["small", "medium"]:
        rows = {}
        for label, variant, settings in variants:
            rows[label] = row = measure(target, preset, variant, **settings)
            print(f"{args.target} {preset:<7} {label:<42} peak {row['peak_bytes'] / 1e9:.3f} GB, FLOPs "
                  f"{row['flops'] / 1e9:.1f} G, HBM bytes {row['hbm_bytes'] / 1e9:.2f} GB, roofline "
                  f"{row['step_ms']:.3f} ms", flush=True)
        results[f"{args.target} {preset}"] = rows
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")

if __name__ == "__main__":
    main()
