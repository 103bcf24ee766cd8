"""Checks that need a GPU: cuDNN attention in shardax's model, and the plan against a GPU compile.

    python benchmarks/gpu_checks.py              # on a machine with one GPU
    python benchmarks/gpu_checks.py --allow-cpu  # check the script on a CPU (the plan part only)

1. **cuDNN attention.** The ``small`` preset in bfloat16 (head dimension 64), its loss and every
   parameter's gradient with ``attention="cudnn"`` and with ``"xla"``, on causal rows and on
   packed documents (the per-document mask shardax hands ``jax.nn.dot_product_attention``),
   each against a float32 reference. cuDNN passes if its error against the reference is no
   more than 1.5 times XLA's own bfloat16 error (plus 1e-3), and if the compiled step holds
   the fused kernels (``__cudnn$fmha`` custom calls, forward and backward).
2. **The plan on a GPU.** ``shardax plan``'s predicted peak per device against the peak of the
   step XLA compiled for this GPU (dp on one device): every preset at its defaults that
   compiles in the device's memory, and the held-out shapes of ``benchmarks/suite.py``. The
   plan was fitted to XLA:CPU compiles, so this is how far that estimate carries to a GPU.

Writes ``benchmarks/results/gpu_checks.json`` (on a GPU) and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardax.analysis.plan import plan_strategy
from shardax.models.presets import PRESETS, get_preset
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss

sys.path.insert(0, str(Path(__file__).parent))
from gpu_device import first_device  # noqa: E402
from suite import HELD_OUT_SHAPES  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def relative_error(value, reference) -> float:
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(value - reference) / max(np.linalg.norm(reference), 1e-30))


def loss_and_grads(config: TransformerConfig, batch: dict) -> tuple[float, dict, str]:
    """The loss, each parameter's gradient by path, and the compiled program's text."""
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, batch):
        def loss_of(params):
            return next_token_loss(nnx.merge(graphdef, params, rest), batch)
        return jax.value_and_grad(loss_of)(params)

    loss, grads = run(params, batch)
    text = run.lower(params, batch).compile().as_text()
    return float(loss), {"/".join(map(str, path)): leaf
                         for path, leaf in jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(grads))[0]}, text


def packed_segments(rows: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Documents of random lengths packed into each row, numbered from 1."""
    segments = np.zeros((rows, length), np.int32)
    for row in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, length), size=5, replace=False))
        for number, (start, stop) in enumerate(zip([0, *cuts], [*cuts, length]), start=1):
            segments[row, start:stop] = number
    return segments


def cudnn_attention() -> dict:
    base = get_preset("small").config(seq_len=512)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, base.vocab_size, size=(8, base.seq_len + 1)).astype(np.int32)
    batches = {"causal": {"tokens": tokens},
               "packed documents": {"tokens": tokens, "segments": packed_segments(8, base.seq_len + 1, rng)}}
    rows = []
    for name, batch in batches.items():
        reference_loss, reference, _ = loss_and_grads(dataclasses.replace(base, attention="xla"), batch)
        result = {"batch": name}
        for kernel in ("xla", "cudnn"):
            config = dataclasses.replace(base, compute_dtype="bfloat16", attention=kernel)
            loss, grads, text = loss_and_grads(config, batch)
            result[kernel] = {
                "loss_error": abs(loss - reference_loss) / abs(reference_loss),
                "worst_gradient_error": max(relative_error(grads[path], reference[path])
                                            for path in reference),
                "fused_kernels": sorted(set(re.findall(r"__cudnn\$fmha\w*", text))),
            }
        worst = result["xla"]["worst_gradient_error"]
        result["passes"] = (result["cudnn"]["worst_gradient_error"] <= 1.5 * worst + 1e-3
                            and result["cudnn"]["loss_error"] <= 1.5 * result["xla"]["loss_error"] + 1e-3
                            and len(result["cudnn"]["fused_kernels"]) >= 2)
        rows.append(result)
        print(json.dumps(result), flush=True)
    return {"config": "small preset, seq 512, batch 8, bfloat16 against a float32 XLA reference",
            "cases": rows}


def plan_on_this_device(memory_limit: int | None) -> dict:
    rows = []
    cases = [(f"preset {name}", get_preset(name).config(), get_preset(name).batch_size) for name in PRESETS]
    cases += [(f"held-out {overrides}", TransformerConfig(**{"vocab_size": 256, "positions": "rotary",
                                                             **overrides}),
               batch) for overrides, batch in HELD_OUT_SHAPES]
    for name, config, batch in cases:
        try:
            plan = plan_strategy(config, "dp", "data=1", batch_size=batch)
        except Exception as error:  # a step too large for this device fails to compile: say so, go on
            rows.append({"case": name, "error": str(error).splitlines()[0][:200]})
            print(rows[-1], flush=True)
            continue
        peak = plan.compiled["peak"]
        if memory_limit is not None and peak > memory_limit:
            rows.append({"case": name,
                         "skipped": f"compiled peak {peak / 1e9:.1f} GB over the device's memory"})
            continue
        rows.append({"case": name, "batch_size": batch, "predicted_peak": plan.predicted["total"],
                     "compiled_peak": peak, "peak_ratio": plan.predicted["total"] / peak})
        print(f"{name}: predicted/compiled {rows[-1]['peak_ratio']:.3f}", flush=True)
    ratios = [row["peak_ratio"] for row in rows if "peak_ratio" in row]
    return {"strategy": "dp on data=1", "cases": rows,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "worst_abs_error": max(abs(r - 1) for r in ratios) if ratios else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run the plan part on a CPU to check the script")
    parser.add_argument("--only", choices=["attention", "plan"], help="run one part")
    options = parser.parse_args()
    device, on_gpu = first_device(options.allow_cpu, "these checks need a GPU",
                                  "runs the plan part here to check the script")
    result = {"machine": f"{device.device_kind}, jax {jax.__version__}"}
    if on_gpu and options.only in (None, "attention"):
        result["cudnn_attention"] = cudnn_attention()
    if options.only in (None, "plan"):
        result["plan"] = plan_on_this_device((device.memory_stats() or {}).get("bytes_limit"))
    print(json.dumps(result, indent=1))
    if on_gpu:  # a part run alone updates its part of the file
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / "gpu_checks.json"
        earlier = json.loads(path.read_text()) if path.exists() and options.only else {}
        path.write_text(json.dumps(earlier | result, indent=1) + "\n")


if __name__ == "__main__":
    main()
