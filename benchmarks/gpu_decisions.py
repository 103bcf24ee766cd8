"""Benchmark 24: the step's choices timed on one real GPU (benchmark 22 compiled them for TPUs).

    python benchmarks/gpu_decisions.py                    # on a machine with one H100 or H200
    python benchmarks/gpu_decisions.py --preset tiny --steps 2 --allow-cpu   # check the script

Each choice the train step made, timed both ways on the GPU (dp on one device, bfloat16
compute, attention ``auto``, random tokens): with the blocks scanned (the default until this
benchmark) and in a Python loop (``blocks_in_a_loop``, now the default on GPUs under dp); with
one choice undone while tracing (``step_variants.py``): the layer norm and GELU custom VJPs; on
GPUs, a ``lax.cond`` around the optimizer update rather than TPUs' select; blocks in a loop left
without ``nnx.remat``; and each remat policy, on the largest preset at batch sizes that fit. Per row: the
median step time of ``--steps`` steps after two warm-up steps, MFU (6 N + 12 L d T per token
against the device's dense bf16 peak), XLA's compiled peak and the loss after the last step.
Rows go to ``benchmarks/results/gpu_decisions.json`` after each one (and to ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import optax
from gpu_device import first_device
from mfu import peak_flops
from step_variants import no_remat_on_plain_loops, plain_autodiff, remat_every_loop, select_update

from shardax import DeviceMeshManager, parallelize
from shardax.analysis.plan import compile_step, compiled_memory
from shardax.models.presets import flops_per_token, get_preset
from shardax.models.transformer import TransformerLM

RESULTS = Path(__file__).parent / "results" / "gpu_decisions.json"
NONE = contextlib.nullcontext

# (row, how the step is traced, model settings over the preset's), per group; each row names its
# layout of the blocks, so that it measures the same step whatever the defaults become
SCANNED, LOOPED = {"scan_layers": True}, {"scan_layers": False}
CHOICES = [("scanned blocks", NONE, SCANNED),
           ("scanned, select around the update (TPUs' choice)", select_update, SCANNED),
           ("scanned, without custom VJPs (layer norm, GELU)", plain_autodiff, SCANNED),
           ("blocks in a loop (no remat)", no_remat_on_plain_loops, {**LOOPED, "remat": "none"}),
           ("blocks in a loop under remat", remat_every_loop, {**LOOPED, "remat": "none"}),
           *[(f"scanned, remat {policy}", NONE, {**SCANNED, "remat": policy})
             for policy in ("full", "dots_saveable", "dots_with_no_batch_dims_saveable")]]
# the largest preset, where the step is longest: what MFU is most sensitive to
LARGEST = [("scanned blocks", NONE, SCANNED),
           ("scanned, select around the update (TPUs' choice)", select_update, SCANNED),
           ("blocks in a loop", NONE, LOOPED),
           ("scanned, remat dots_with_no_batch_dims_saveable", NONE,
            {**SCANNED, "remat": "dots_with_no_batch_dims_saveable"})]
# blocks in a loop on the largest preset: each remat policy at a batch size that may fit
# (``remat none`` without ``nnx.remat``, as the step ran on GPUs when this was measured)
LOOPS = [(f"blocks in a loop, remat {policy}{' (no nnx.remat)' * (policy == 'none')}, batch {batch}",
          no_remat_on_plain_loops, {**LOOPED, "remat": policy, "batch_size": batch})
         for policy, batch in [("dots_saveable", 32), ("none", 16), ("none", 24),
                               ("dots_with_no_batch_dims_saveable", 48), ("full", 64)]]
LOOPS.append(("scanned, remat full, batch 64", NONE, {**SCANNED, "remat": "full", "batch_size": 64}))


def timed(preset: str, batch_size: int, variant, settings: dict, steps: int, peak: float | None) -> dict:
    settings = dict(settings)
    batch_size = settings.pop("batch_size", batch_size)
    config = get_preset(preset).config(**{"compute_dtype": "bfloat16", "attention": "auto", **settings})
    mesh = DeviceMeshManager().create_device_mesh("data=1")
    with variant():
        parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(1e-4), mesh, "dp")
        started = time.perf_counter()
        compiled = compile_step(parallel, batch_size, config.seq_len)
        compile_s = time.perf_counter() - started
        state = parallel.init(seed=0)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(batch_size, config.seq_len + 1))
    batch = parallel.place_batch({"tokens": tokens.astype(np.int32)})
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - started)
    step_s = float(np.median(times[2:]))
    model_flops_per_s = flops_per_token(config) * batch_size * config.seq_len / step_s
    return {"step_ms": step_s * 1e3, "mfu": model_flops_per_s / peak if peak else None,
            "compiled_peak_bytes": compiled_memory(compiled)["peak"], "compile_s": compile_s,
            "loss": float(metrics["loss"]), "settings": settings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", help="every choice on this preset (default: medium)")
    parser.add_argument("--largest", default="1b", help="the few choices MFU hangs on, on this preset")
    parser.add_argument("--largest-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", choices=["choices", "largest", "loops"], action="append",
                        help="run these groups (default: all)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on a CPU to check the script")
    options = parser.parse_args()
    device, on_gpu = first_device(options.allow_cpu, "this benchmark times a GPU", "checks the script here")
    peak = peak_flops(device, None) if on_gpu else None
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() and on_gpu else {}
    results |= {"benchmark": "gpu_decisions", "machine": f"{device.device_kind}, jax {jax.__version__}",
                "steps": options.steps}
    groups = {"choices": (options.preset, get_preset(options.preset).batch_size, CHOICES),
              "largest": (options.largest, options.largest_batch, LARGEST),
              "loops": (options.largest, options.largest_batch, LOOPS)}
    for group in options.only or list(groups):
        preset, batch_size, choices = groups[group]
        rows = results.setdefault(f"{preset} batch {batch_size}" if group != "loops" else f"{preset} loops",
                                  {})
        for label, variant, settings in choices:
            try:
                row = timed(preset, batch_size, variant, settings, options.steps, peak)
                mfu = f", MFU {row['mfu']:.1%}" if row["mfu"] else ""
                print(f"{preset:<7} {label:<42} {row['step_ms']:8.2f} ms{mfu}, peak "
                      f"{row['compiled_peak_bytes'] / 1e9:.2f} GB, loss {row['loss']:.4f}, compiled in "
                      f"{row['compile_s']:.0f} s", flush=True)
            except Exception as error:  # an out-of-memory at run time is a finding, not the end
                row = {"error": str(error).splitlines()[0][:300], "settings": settings}
                print(f"{preset:<7} {label:<42} failed: {row['error']}", flush=True)
            rows[label] = row
            jax.clear_caches()
            gc.collect()
            if on_gpu:
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")
                if os.environ.get("OUT"):
                    shutil.copy(RESULTS, os.environ["OUT"])


if __name__ == "__main__":
    main()
