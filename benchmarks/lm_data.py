"""Benchmark 9: language-model data at scale (``shardax prepare`` and lazily read token shards).

    python benchmarks/lm_data.py [--corpus-mb 512] [--workdir DIR]

1. ``prepare`` throughput on a synthetic corpus built from the standard library's source: copies
   of every ``.py`` file, each copy's documents made distinct by a header line, written as files
   of about 8 MB (many documents each, joined as JSON lines) until the corpus holds ``--corpus-mb``
   of text. Input MB/s with the byte tokenizer and with BPE (vocabulary 4096, trained on a 64 MB
   sample, training included), one worker process per core.
2. Data loading as a share of step time: the ``tiny`` LM's compiled step (dp, 8 CPU devices)
   fed from the byte shards of the whole corpus, against the same loop reusing one placed batch,
   in interleaved rounds (the median of the paired ratios, minus one); also the batch
   function's own time, alone and inside the loop.
3. Peak resident memory (``ru_maxrss`` of the process) of the same ``shardax train`` run on
   shards of a tenth of the corpus and on shards of all of it.

Writes ``benchmarks/results/lm_data.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def build_corpus(folder: Path, megabytes: int) -> int:
    """JSON-lines files of stdlib documents until ``megabytes`` of text; returns the bytes written."""
    from shardax.data.corpus import default_sources

    sources = [p.read_text(encoding="utf-8") for p in default_sources() if p.stat().st_size]
    folder.mkdir(parents=True, exist_ok=True)
    written, copy, number = 0, 0, 0
    target = megabytes << 20
    handle = None
    while written < target:
        for text in sources:
            if handle is None or handle.tell() > 8 << 20:
                if handle:
                    handle.close()
                handle = open(folder / f"part-{number:04d}.jsonl", "w", encoding="utf-8")
                number += 1
            document = f"# copy {copy}\n{text}"
            handle.write(json.dumps({"text": document}) + "\n")
            written += len(document.encode("utf-8"))
            if written >= target:
                break
        copy += 1
    handle.close()
    return written


def time_prepare(inputs: list[Path], out: Path, **options) -> tuple[float, dict]:
    from shardax.data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    done = prepare(inputs, out, show_progress=False, **options)
    return time.perf_counter() - start, done.index


def loading_share(shards: Path, steps: int, rounds: int = 5) -> dict:
    """What reading batches from the shards adds to a step, interleaved with a loop that reuses one
    placed batch: both run the tiny LM's compiled step (dp, 8 devices) and read the loss every 10
    steps as a training loop does; rounds alternate which goes first. Also the batch function's own
    time, alone and inside the shard loop (where it shares the CPU with the step in flight)."""
    code = f"""
import json, statistics, time, jax
from shardax.cpu_devices import simulate_cpu_devices
simulate_cpu_devices(8)
from shardax.lm.settings import TrainConfig
from shardax.lm import job
trainer, data, run, _ = job.prepare(TrainConfig.of(data=[{str(shards)!r}]))
sharding = trainer.parallel.layout.batch()
batches = data.batches(run.model.seq_len, run.batch_size, run.seed, sharding)
step_fn = trainer.train_step()
state = trainer.init()
fixed = batches(0)
state, metrics = step_fn(state, fixed)
jax.block_until_ready(metrics)
position, inside = 1, []
def loop(read):
    global state, position
    start = time.perf_counter()
    for i in range({steps}):
        if read:
            t = time.perf_counter()
            batch = batches(position)
            inside.append(time.perf_counter() - t)
            position += 1
        else:
            batch = fixed
        state, metrics = step_fn(state, batch)
        if i % 10 == 9:
            float(metrics["loss"])
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / {steps}
ratios, shard_times, fixed_times = [], [], []
for r in range({rounds}):
    order = (True, False) if r % 2 == 0 else (False, True)
    times = {{read: loop(read) for read in order}}
    shard_times.append(times[True]); fixed_times.append(times[False])
    ratios.append(times[True] / times[False])
alone = []
for s in range(20):
    t = time.perf_counter(); jax.block_until_ready(batches(10**6 + s)); alone.append(time.perf_counter() - t)
print(json.dumps({{"rounds": {rounds}, "steps_per_round": {steps}, "ratio": statistics.median(ratios),
                  "ratios": ratios, "step_s_reading": statistics.median(shard_times),
                  "step_s_fixed_batch": statistics.median(fixed_times),
                  "batch_fn_alone_s": statistics.median(alone),
                  "batch_fn_in_loop_s": statistics.median(inside)}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def peak_rss(shards: Path, steps: int) -> int:
    """Peak resident bytes of a ``shardax train`` process on ``shards``."""
    command = [sys.executable, "-m", "shardax.cli", "train", "--data", str(shards), "--steps", str(steps),
               "--eval-every", "0", "--sample-bytes", "0", "--log-every", "10"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(process.stderr.read().decode()[-2000:])
    return usage.ru_maxrss * 1024  # kilobytes on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=int, default=512)
    parser.add_argument("--workdir", help="where the corpus and shards go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=60)
    options = parser.parse_args()
    from shardax.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(8)  # what the training runs use (the machine line says so)
    from suite import save

    work = Path(options.workdir or tempfile.mkdtemp(prefix="shardax-lm-data-"))
    corpus = work / "corpus"
    text_bytes = build_corpus(corpus, options.corpus_mb)
    parts = sorted(corpus.iterdir())
    tenth = parts[: max(1, len(parts) // 10)]
    input_bytes = sum(p.stat().st_size for p in parts)
    print(f"corpus: {text_bytes / 1e6:.0f} MB of text in {len(parts)} files ({input_bytes / 1e6:.0f} MB as "
          "JSON lines)")

    bytes_s, bytes_index = time_prepare(parts, work / "shards_bytes")
    print(f"prepare, bytes: {bytes_s:.1f} s, {input_bytes / 1e6 / bytes_s:.1f} MB/s")
    bpe_s, bpe_index = time_prepare(parts, work / "shards_bpe", tokenizer="bpe", vocab_size=4096)
    print(f"prepare, bpe: {bpe_s:.1f} s, {input_bytes / 1e6 / bpe_s:.1f} MB/s")
    _, small_index = time_prepare(tenth, work / "shards_small")

    def shard_bytes(index: dict) -> int:
        return (sum(split["tokens"] for split in index["splits"].values())
                * (2 if index["dtype"] == "uint16" else 4))

    share = loading_share(work / "shards_bytes", options.steps)
    print(f"loading: step {1000 * share['step_s_reading']:.1f} ms reading shards vs "
          f"{1000 * share['step_s_fixed_batch']:.1f} ms on one batch (ratio {share['ratio']:.4f}); batch "
          f"function {1000 * share['batch_fn_alone_s']:.2f} ms alone, "
          f"{1000 * share['batch_fn_in_loop_s']:.2f} ms in the loop")
    small_rss = peak_rss(work / "shards_small", options.steps)
    large_rss = peak_rss(work / "shards_bytes", options.steps)
    print(f"peak RSS: {small_rss / 1e6:.0f} MB on {shard_bytes(small_index) / 1e6:.0f} MB of shards, "
          f"{large_rss / 1e6:.0f} MB on {shard_bytes(bytes_index) / 1e6:.0f} MB")
    save("lm_data", {
        "cores": os.cpu_count(), "text_bytes": text_bytes, "input_bytes": input_bytes, "files": len(parts),
        "prepare_bytes_s": bytes_s, "prepare_bytes_mb_per_s": input_bytes / 1e6 / bytes_s,
        "prepare_bpe_s": bpe_s, "prepare_bpe_mb_per_s": input_bytes / 1e6 / bpe_s,
        "bpe_bytes_per_token": bpe_index["splits"]["train"]["bytes"] / bpe_index["splits"]["train"]["tokens"],
        "loading": share, "loading_fraction": share["batch_fn_alone_s"] / share["step_s_fixed_batch"],
        "shards_small_bytes": shard_bytes(small_index), "shards_large_bytes": shard_bytes(bytes_index),
        "peak_rss_small_bytes": small_rss, "peak_rss_large_bytes": large_rss,
        "peak_rss_ratio": large_rss / small_rss,
    })
    if not options.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
