"""Benchmark 20: does the default ``shardax train`` end with text made of real words?

    python benchmarks/default_sample.py after                  # the default run as it is
    python benchmarks/default_sample.py before --source DIR    # another checkout's src/ (e.g. the previous default)

Runs ``shardax train`` with no flags but a longer closing sample (``--sample-bytes 600``, which
changes nothing before the sample), on this machine, and measures the sample the run prints:
the share of its words (runs of two or more letters, lower-cased: ``shardax.lm.sampling.words``)
that occur in the training corpus (the standard library's source, the default data), with the
run's wall time (first run: the BPE tokenizer trained and the corpus tokenized, then cached) and
its validation loss in bits per byte (comparable across tokenizers). Keeps each label's row in
``benchmarks/results/default_sample.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardax.data.corpus import default_sources
from shardax.lm.sampling import vocabulary, word_share

RESULTS = Path(__file__).parent / "results" / "default_sample.json"
SAMPLE = re.compile(r"ends at \|\):\n(.*?)\|(.*?)\n\n", re.S)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--source", help="a checkout's src/ directory to run instead of the installed shardax")
    parser.add_argument("--flags", default="", help="extra shardax train flags")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.source:
        env["PYTHONPATH"] = str(Path(args.source).resolve())
    with tempfile.TemporaryDirectory() as work:
        env["SHARDAX_DATA_CACHE"] = str(Path(work) / "cache")  # a first run: tokenizer trained, corpus tokenized
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "shardax.cli", "train", "--sample-bytes", "600",
                               *args.flags.split()], cwd=work, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - began
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    match = SAMPLE.search(done.stdout)
    sample = match.group(2) if match else ""
    if not match:  # the previous layout printed the summary first, then the sample to the end
        tail = done.stdout.split("ends at |):\n", 1)[1]
        sample = tail.split("|", 1)[1]
    known = vocabulary(path.read_text(errors="replace") for path in default_sources())
    share, count = word_share(sample, known)
    bits = re.findall(r"bits_per_byte (\d+\.\d+)", done.stdout)
    loss = re.findall(r"validation loss (\d+\.\d+)", done.stdout)
    unigram = re.search(r"unigram baseline (\d+\.\d+) (nats/\w+)", done.stdout)
    header = [line for line in done.stdout.splitlines() if line.startswith(("data:", "run:"))]
    row = {"label": args.label, "word_share": round(share, 3), "words": count, "wall_s": round(wall, 1),
           "val_bits_per_byte": float(bits[-1]) if bits else None, "val_loss": float(loss[-1]) if loss else None,
           "unigram": float(unigram.group(1)) if unigram else None, "unit": unigram.group(2) if unigram else None,
           "run": header, "sample": sample,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    rows = [r for r in (json.loads(RESULTS.read_text()) if RESULTS.exists() else []) if r["label"] != args.label]
    RESULTS.write_text(json.dumps(rows + [row], indent=1) + "\n")
    print(f"{args.label}: {100 * share:.1f}% of {count} sampled words are words of the corpus; wall {wall:.0f} s, "
          f"validation {row['val_bits_per_byte']} bits/byte")
    print(sample)


if __name__ == "__main__":
    main()
