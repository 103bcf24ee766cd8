"""Benchmark 29: ``shardax plan --init-from`` on a Llama-3-8B-shaped checkpoint, before renting hardware.

    python benchmarks/plan_init_from.py                               # tpu-v5p-8
    PYTHONPATH=.ci/gpu-plan python benchmarks/plan_init_from.py      # and h100-8 (JAX's CUDA plugin)

A ``config.json`` with Llama-3-8B's shape (4096 wide, 32 layers, 32 query and 8 key/value heads,
14336 hidden, a 128256-token vocabulary; the facts of meta-llama/Meta-Llama-3-8B's config) and no
weights, planned as ``shardax train --init-from`` would build it: full fine-tuning and LoRA rank
16 on the model's own targets, fsdp over the target, batch 8 x 2048, bfloat16 compute, remat
full. Per target and run: the step as the target's compiler compiles it (XLA:TPU on this host
for a v5p-8; XLA:GPU through JAX's CUDA plugin for h100-8, no GPU either way), its memory per
device against the chip's, shardax's analytic peak against the compiled one, the roofline step
time and MFU. Each is the real command (``shardax plan ... --json``) run as a user runs it.
Writes ``benchmarks/results/plan_init_from.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "plan_init_from.json"
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
              "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}
FLAGS = ["--strategy", "fsdp", "--batch-size", "8", "--seq-len", "2048", "--precision", "bfloat16",
         "--remat", "full", "--json"]


def has_cuda_plugin() -> bool:
    probe = "from shardax.analysis.targets import cuda_plugin; print(cuda_plugin() is not None)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          text=True).stdout.strip() == "True"


def plan(folder: Path, target: str, lora: list[str]) -> dict:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shardax.cli", "plan", "--init-from", str(folder),
                           "--target", target, *FLAGS, *lora], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise SystemExit(f"shardax plan --target {target} failed:\n{done.stderr[-2000:]}")
    (row,) = json.loads(done.stdout)
    bound = row["roofline"]
    return {"target": target, "lora_rank": int(lora[1]) if lora else 0, "mesh": row["mesh"],
            "compiled_bytes_per_device": row["compiled_bytes_per_device"],
            "predicted_bytes_per_device": row["predicted"]["total"],
            "predicted_vs_compiled": row["predicted"]["total"] / row["compiled_bytes_per_device"],
            "fits": row["fits"], "step_ms": bound["step_s"] * 1e3, "bound": bound["bound"],
            "mfu": bound["mfu"], "seconds": time.perf_counter() - began}


def main() -> None:
    targets = ["tpu-v5p-8"] + (["h100-8"] if has_cuda_plugin() else [])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(LLAMA_3_8B))
        for target in targets:
            for lora in ([], ["--lora-rank", "16"]):
                row = plan(Path(folder), target, lora)
                rows.append(row)
                print(f"{target:<10} LoRA {row['lora_rank']:>2}: "
                      f"{row['compiled_bytes_per_device'] / 2**30:6.2f} GiB a device compiled, analytic "
                      f"{row['predicted_vs_compiled']:.3f}x, fits={row['fits']}, roofline "
                      f"{row['step_ms']:.0f} ms ({row['bound']}-bound), MFU {100 * row['mfu']:.1f}% "
                      f"({row['seconds']:.0f} s)", flush=True)
    RESULTS.write_text(json.dumps({"model": "Llama-3-8B-shaped config.json", "flags": FLAGS, "rows": rows},
                                  indent=1) + "\n")


if __name__ == "__main__":
    main()
