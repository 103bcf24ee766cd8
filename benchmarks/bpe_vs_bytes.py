"""Benchmark 10: the main job with BPE against bytes, in bits per byte of the same held-out text.

    python benchmarks/bpe_vs_bytes.py [--steps 200] [--vocab-size 4096]

Both runs are ``shardax train`` on the standard library (preset ``tiny``, its batch, steps and
learning rate, dp on 8 CPU devices), through token shards packed across documents: one with
the byte tokenizer, one with a BPE tokenizer trained on the training split. The documents
held out for validation are the same for both (a hash of each document's text), and the final
evaluation covers the whole validation split, so bits per byte compare the same text. Writes
``benchmarks/results/bpe_vs_bytes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def train(tokenizer: list[str], steps: int, folder: Path) -> dict:
    metrics = folder / f"{tokenizer[1]}.jsonl"
    command = [sys.executable, "-m", "shardax.cli", "train", *tokenizer, "--steps", str(steps), "--seq-len",
               "128", "--eval-every", "0",
               "--eval-batches", "1000", "--metrics", str(metrics), "--sample-bytes", "200"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ,
                            "SHARDAX_DATA_CACHE": str(folder / "cache")})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    final = [r for r in records if "val_loss" in r][-1]
    sample = result.stdout[result.stdout.index("sample (") :].split("\n", 1)[1].strip()
    return {"wall_s": time.perf_counter() - start, "val_loss_nats_per_token": final["val_loss"],
            "val_bits_per_token": final["val_bits_per_token"],
            "val_bits_per_byte": final["val_bits_per_byte"],
            "train_loss": final["loss"], "tokens_per_s": final.get("tokens_per_sec"), "sample": sample[:400],
            "data": next(line for line in result.stdout.splitlines() if line.startswith("data:"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=4096)
    options = parser.parse_args()
    from shardax.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(8)  # what the training runs use (the machine line says so)
    from suite import save

    with tempfile.TemporaryDirectory(prefix="shardax-bpe-") as folder:
        byte_run = train(["--tokenizer", "bytes"], options.steps, Path(folder))
        bpe_run = train(["--tokenizer", "bpe", "--vocab-size", str(options.vocab_size)], options.steps,
                        Path(folder))
    for name, run in (("bytes", byte_run), ("bpe", bpe_run)):
        print(f"{name}: {run['val_bits_per_byte']:.3f} bits/byte ({run['val_bits_per_token']:.3f} "
              f"bits/token), {run['wall_s']:.0f} s\n{run['sample']}\n")
    save("bpe_vs_bytes", {"preset": "tiny", "steps": options.steps, "vocab_size": options.vocab_size,
                          "bytes": byte_run, "bpe": bpe_run,
                          "bits_per_byte_ratio": bpe_run["val_bits_per_byte"]
                                                 / byte_run["val_bits_per_byte"]})


if __name__ == "__main__":
    main()
