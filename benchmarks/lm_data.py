"""Benchmark 9: language-model data at scale (``shardax prepare`` and lazily read token shards).

    python benchmarks/lm_data.py [--corpus-mb 512] [--workdir DIR]

1. ``prepare`` throughput on a synthetic corpus built from the standard library's source: copies
   of every ``.py`` file, each copy's documents made distinct by a header line, written as files
   of about 8 MB (many documents each, joined as JSON lines) until the corpus holds ``--corpus-mb``
   of text. Input MB/s with the byte tokenizer and with BPE (vocabulary 4096, trained on a 64 MB
   sample, training included), one worker process per core.
2. Data loading as a share of step time: the ``tiny`` LM trained by ``Trainer.fit`` (dp, 8 CPU
   devices) on the byte shards of the whole corpus; time inside the batch function over the
   whole ``fit`` wall time, steps 10 to the end.
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


def loading_share(shards: Path, steps: int) -> dict:
    """Seconds in the batch function against the wall time of the same steps of ``Trainer.fit``."""
    code = f"""
import json, time, jax
jax.config.update("jax_num_cpu_devices", 8)
from shardax.lm.config import TrainConfig
from shardax.lm import job
trainer, data, run = job.prepare(TrainConfig(data=[{str(shards)!r}], steps={steps}))
sharding = trainer.parallel.layout.batch()
batches = data.batches(run.model.seq_len, run.batch_size, run.seed, sharding)
spent, marks = {{}}, {{}}
def timed(step):
    start = time.perf_counter()
    batch = batches(step)
    spent[step] = time.perf_counter() - start
    marks[step] = time.perf_counter()
    return batch
trainer.fit(timed, steps={steps}, log_every=10)
first, last = 10, {steps} - 1
wall = marks[last] - marks[first]
loading = sum(spent[s] for s in range(first + 1, last + 1))
print(json.dumps({{"steps": last - first, "wall_s": wall, "loading_s": loading,
                  "step_s": wall / (last - first), "loading_per_step_s": loading / (last - first)}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
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
    from suite import save

    work = Path(options.workdir or tempfile.mkdtemp(prefix="shardax-lm-data-"))
    corpus = work / "corpus"
    text_bytes = build_corpus(corpus, options.corpus_mb)
    parts = sorted(corpus.iterdir())
    tenth = parts[: max(1, len(parts) // 10)]
    input_bytes = sum(p.stat().st_size for p in parts)
    print(f"corpus: {text_bytes / 1e6:.0f} MB of text in {len(parts)} files ({input_bytes / 1e6:.0f} MB as JSON lines)")

    bytes_s, bytes_index = time_prepare(parts, work / "shards_bytes")
    print(f"prepare, bytes: {bytes_s:.1f} s, {input_bytes / 1e6 / bytes_s:.1f} MB/s")
    bpe_s, bpe_index = time_prepare(parts, work / "shards_bpe", tokenizer="bpe", vocab_size=4096)
    print(f"prepare, bpe: {bpe_s:.1f} s, {input_bytes / 1e6 / bpe_s:.1f} MB/s")
    _, small_index = time_prepare(tenth, work / "shards_small")

    def shard_bytes(index: dict) -> int:
        return sum(split["tokens"] for split in index["splits"].values()) * (2 if index["dtype"] == "uint16" else 4)

    share = loading_share(work / "shards_bytes", options.steps)
    print(f"loading: {1000 * share['loading_per_step_s']:.2f} ms of a {1000 * share['step_s']:.0f} ms step")
    small_rss = peak_rss(work / "shards_small", options.steps)
    large_rss = peak_rss(work / "shards_bytes", options.steps)
    print(f"peak RSS: {small_rss / 1e6:.0f} MB on {shard_bytes(small_index) / 1e6:.0f} MB of shards, "
          f"{large_rss / 1e6:.0f} MB on {shard_bytes(bytes_index) / 1e6:.0f} MB")
    save("lm_data", {
        "cores": os.cpu_count(), "text_bytes": text_bytes, "input_bytes": input_bytes, "files": len(parts),
        "prepare_bytes_s": bytes_s, "prepare_bytes_mb_per_s": input_bytes / 1e6 / bytes_s,
        "prepare_bpe_s": bpe_s, "prepare_bpe_mb_per_s": input_bytes / 1e6 / bpe_s,
        "bpe_bytes_per_token": bpe_index["splits"]["train"]["bytes"] / bpe_index["splits"]["train"]["tokens"],
        "loading": share, "loading_fraction": share["loading_s"] / share["wall_s"],
        "shards_small_bytes": shard_bytes(small_index), "shards_large_bytes": shard_bytes(bytes_index),
        "peak_rss_small_bytes": small_rss, "peak_rss_large_bytes": large_rss,
        "peak_rss_ratio": large_rss / small_rss,
    })
    if not options.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
