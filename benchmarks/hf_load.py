"""Benchmark 17: loading a Hugging Face checkpoint of about 1B parameters into shards.

    python benchmarks/hf_load.py

Makes a Llama-style checkpoint locally (random weights, bfloat16 safetensors in 1 GB files, as
the Hub ships them; nothing is downloaded), then, in a fresh process each time, loads it FSDP over
8 simulated CPU devices with ``shardax.hf.load``, its weights as float32 (what training keeps) and
as bfloat16 (``param_dtype="bfloat16"``: as they are in the files, what a frozen model keeps). On
CPU the devices' memory is the host's, so the loaded state itself is in the process's resident
memory; what the loader adds on top is the peak resident memory minus the baseline (before
loading, once the devices' runtime has started) minus the state's bytes, reported against the
largest tensor's size in the loaded dtype (goal: at most 2 tensors; the peak is the process's own
high-water mark, ``VmHWM``, which counts the file pages a read maps too).

Throughput: the checkpoint's bytes over the load's wall time (the call, its compiles included),
against reading the same files raw into one reused 64 MB buffer. Both are timed from a warm page
cache and, where this process may empty the page cache (``/proc/sys/vm/drop_caches``, as root), from
a cold one, which is reading at the disk's pace; raw reads and loads alternate ``REPEATS`` times
(medians reported). A load on CPU also has to fault in its state as new memory, which a raw read
into one buffer never does: after each load, a separate process times that alone (new memory of
the state's shards' sizes as the loader takes it, each written once), so the figure can be read
against it. Writes ``benchmarks/results/hf_load.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODEL = dict(vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=4, n_layers=20, d_ff=5632,
             positions="rotary", norm="rms", mlp="swiglu", tie_embeddings=False, seq_len=2048)
REPEATS = 3
DTYPES = ("float32", "bfloat16")  # the loaded weights' dtype
FRESH_MEMORY = """
import json, sys, time
from shardax.hf.files import new_memory
sizes = json.loads(sys.argv[1])
began = time.perf_counter()
kept = [new_memory(size) for size in sizes]
for block in kept:
    block[:] = 1
print(time.perf_counter() - began)
"""
MEASURE = """
import json, os, sys, time
import jax
from shardax.cpu_devices import simulate_cpu_devices
simulate_cpu_devices(8)
import numpy as np
from shardax import hf

def rss():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

folder = sys.argv[1]
tensors = hf.SafeTensors(__import__("pathlib").Path(folder))
dtype = sys.argv[2]
largest = max(int(np.prod(tensors.shape(n))) for n in tensors.where) * jax.numpy.dtype(dtype).itemsize
tensors.close()
before_runtime = rss()
# the devices' runtime started first (116 MB here) and a first computation run (50 MB): any JAX
# program holds that, a load or not; the loader's own memory is counted from there
jax.block_until_ready([jax.jit(lambda x: x + 1)(jax.device_put(np.zeros(4), d)) for d in jax.devices()])
baseline = rss()
began = time.perf_counter()
loaded = hf.load(folder, "data=8", "fsdp", param_dtype=dtype)
jax.block_until_ready(loaded.state.params)
seconds = time.perf_counter() - began
# the high-water mark of this process's own memory (ru_maxrss would carry the parent's over exec)
peak = int(next(line for line in open(f"/proc/{os.getpid()}/status")
                if line.startswith("VmHWM")).split()[1]) * 1024
state = sum(leaf.nbytes for leaf in jax.tree.leaves(loaded.state.params))
shards = [shard.data.nbytes for leaf in jax.tree.leaves(loaded.state.params)
          for shard in leaf.addressable_shards]
print(json.dumps({"runtime_rss": baseline - before_runtime, "baseline_rss": baseline, "peak_rss": peak,
                  "state_bytes": state, "shard_bytes": shards, "largest_tensor_bytes": largest,
                  "load_s": seconds, "bytes_read": loaded.bytes_read}))
"""


def make(folder: Path) -> int:
    import jax

    from shardax.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    import optax

    from shardax import hf
    from shardax.model_parallel import parallelize
    from shardax.models.presets import parameter_count
    from shardax.models.transformer import TransformerConfig, TransformerLM

    config = TransformerConfig(**MODEL)
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.identity(),
                           jax.make_mesh((8,), ("data",)), "fsdp")
    hf.save(folder, parallel.init(0).params, config, dtype="bfloat16", max_shard_bytes=1 << 30)
    return parameter_count(config)


def raw_read(folder: Path) -> tuple[float, int]:
    began, total, buffer = time.perf_counter(), 0, bytearray(64 << 20)
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb", buffering=0) as file:
            while read := file.readinto(buffer):
                total += read
    return time.perf_counter() - began, total


def python(code: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def emptied_page_cache() -> bool:
    """Whether the page cache could be emptied (as root, on Linux), so that the next read is cold."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def summary(raws: list[float], loads: list[dict], files: int) -> dict:
    raw_s = statistics.median(raws)
    measured = sorted(loads, key=lambda run: run["load_s"])[len(loads) // 2]  # the median load
    return {"raw_read_s": raw_s, "raw_read_runs_s": raws, "load_runs_s": [run["load_s"] for run in loads],
            "raw_gb_per_s": files / raw_s / 1e9, "load_gb_per_s": files / measured["load_s"] / 1e9,
            "load_over_raw": raw_s / measured["load_s"], **measured}


def main() -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("SHARDAX_BENCH_DIR")) as scratch:
        folder = Path(scratch) / "llama-1b"
        parameters = make(folder)
        files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        caches = ["warm", "cold"] if emptied_page_cache() else ["warm"]
        raws: dict[str, list[float]] = {cache: [] for cache in caches}
        loads: dict[tuple[str, str], list[dict]] = {(c, d): [] for c in caches for d in DTYPES}
        fresh: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for _ in range(REPEATS):  # alternating, so that the machine's drift falls on all of them
            for cache in caches:
                for what in ("raw", *DTYPES):
                    if cache == "cold":
                        emptied_page_cache()
                    else:
                        raw_read(folder)  # warm the page cache
                    if what == "raw":
                        raws[cache].append(raw_read(folder)[0])
                        continue
                    run = json.loads(python(MEASURE, str(folder), what))
                    shards = run.pop("shard_bytes")
                    loads[cache, what].append(run)
                    if cache == "warm":
                        fresh[what].append(float(python(FRESH_MEMORY, json.dumps(shards))))
    result = {"parameters": parameters, "model": MODEL, "files_bytes": files, "repeats": REPEATS,
              "caches": caches}
    for cache, dtype in loads:
        runs = loads[cache, dtype]
        added = max(run["peak_rss"] - run["baseline_rss"] - run["state_bytes"] for run in runs)
        result[f"{cache}_{dtype}"] = {
            **summary(raws[cache], runs, files), "added_rss_bytes": added,
            "added_over_largest_tensor": added / runs[0]["largest_tensor_bytes"],
            **({"fresh_state_memory_s": statistics.median(fresh[dtype]), "fresh_state_memory_runs_s":
                fresh[dtype]} if cache == "warm" else {})}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hf_load.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
