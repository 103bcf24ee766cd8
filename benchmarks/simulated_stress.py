"""Simulated devices under load: how often a run aborts in XLA:CPU's collectives.

    python benchmarks/simulated_stress.py            # 10 runs of each command in each pool (~40 min, 2 cores)
    python benchmarks/simulated_stress.py 3          # 3 runs of each

Three commands on 8 simulated devices: the fine-tuning guide's LoRA run under fsdp (50 steps,
batch 32) and a context-parallel run (ring attention over ``data=2,context=4``, 50 steps), as a
user types them, and the smallest program that stalled (``tests/test_cpu_devices.py``: a loop
of all-gathers beside an all-reduce, 300 steps), whose stall does not depend on how the
model's step happens to be scheduled (a change to the LM's MLP made the LoRA run's stall rare). Each runs
beside a CPU load of twice the cores (busy processes), in two thread pools: XLA's default (``PJRT_NPROC`` =
max(cores, devices), what the process had before ``shardax.simulate_cpu_devices``) and shardax's (2 threads
per device). The runs of the two pools alternate, so both see the same machine. A run that ends with XLA's
rendezvous abort ("Termination timeout") counts as an abort; any other failure is listed.
Writes ``benchmarks/results/simulated_stress.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardax.cpu_devices import collective_threads

RESULTS = Path(__file__).parent / "results"
DEVICES = 8
POOLS = {"xla default": max(os.cpu_count() or 1, DEVICES), "shardax": collective_threads(DEVICES)}
CHECKPOINT = """
import pathlib, sysconfig, sys
import shardax
shardax.simulate_cpu_devices(8)
from flax import nnx
from shardax import hf
from shardax.data.tokenizer import train_bpe
from shardax.models.transformer import TransformerConfig, TransformerLM
texts = [p.read_text() for p in pathlib.Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py")]
config = TransformerConfig(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128,
                           positions="rotary", norm="rms", mlp="swiglu", tie_embeddings=False)
hf.save(sys.argv[1], nnx.state(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param), config)
pathlib.Path(sys.argv[1], "tokenizer.json").write_text(train_bpe(texts, 512).to_json())
"""


STALLING = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "tests")!r})
from test_cpu_devices import STEPS, stalling_program
import shardax
shardax.simulate_cpu_devices(8)
step, args = stalling_program(8)
for _ in range(STEPS):
    grads = step(*args)
grads.block_until_ready()
"""


def commands(work: Path) -> dict[str, list[str]]:
    return {
        "the smallest stalling program": ["-c", STALLING],
        "LoRA under fsdp (the fine-tuning guide)": [
            "train", "--init-from", str(work / "tiny-llama"), "--lora-rank", "8", "--lora-targets", "q,k,v,o",
            "--strategy", "fsdp", "--steps", "50", "--seq-len", "64"],
        "context-parallel ring (data=2,context=4)": [
            "train", "--mesh", "data=2,context=4", "--context-attention", "ring", "--steps", "50",
            "--eval-every", "0", "--sample-bytes", "0"],
    }


def busy() -> None:
    while True:
        pass


def run_once(args: list[str], pool: int, work: Path, index: int) -> tuple[str, float]:
    env = {**os.environ, "PJRT_NPROC": str(pool), "JAX_PLATFORMS": "cpu"}
    began = time.time()
    command = [*args] if args[0] == "-c" else ["-m", "shardax.cli", *args, "--run-dir",
                                               str(work / f"run{index}")]
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=900)
    seconds = time.time() - began
    if done.returncode == 0:
        return "finished", seconds
    if "Termination timeout for" in done.stderr:
        return "aborted in a collective", seconds
    return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1][:200]}", seconds


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    work = Path(tempfile.mkdtemp(prefix="shardax-stress-"))
    subprocess.run([sys.executable, "-c", CHECKPOINT, str(work / "tiny-llama")], check=True,
                   capture_output=True)
    load = [multiprocessing.Process(target=busy, daemon=True) for _ in range(2 * (os.cpu_count() or 1))]
    for process in load:
        process.start()
    rows, index = [], 0
    try:
        for name, args in commands(work).items():
            for attempt in range(repeats):
                for pool_name, pool in POOLS.items():
                    outcome, seconds = run_once(args, pool, work, index)
                    index += 1
                    rows.append({"command": name, "pool": pool_name, "threads": pool, "outcome": outcome,
                                 "seconds": round(seconds, 1)})
                    print(f"{name} | {pool_name} ({pool} threads) | {outcome} | {seconds:.0f} s", flush=True)
    finally:
        for process in load:
            process.terminate()
    summary = {f"{name} | {pool_name}": {
        "runs": sum(r["command"] == name and r["pool"] == pool_name for r in rows),
        "aborts": sum(r["command"] == name and r["pool"] == pool_name and r["outcome"].startswith("aborted")
                      for r in rows),
        "other failures": sum(r["command"] == name and r["pool"] == pool_name
                              and r["outcome"].startswith("failed") for r in rows)}
        for name in commands(work) for pool_name in POOLS}
    result = {"cores": os.cpu_count(), "load processes": len(load), "devices": DEVICES, "summary": summary,
              "rows": rows}
    print(json.dumps(summary, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "simulated_stress.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
