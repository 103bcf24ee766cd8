"""Benchmark 20: does the default ``shardax train`` end with text made of real words?

    python benchmarks/default_sample.py after                  # the default run as it is
    python benchmarks/default_sample.py before --source DIR
        # another checkout's src/ (e.g. the previous default)

Trains the default run (``shardax train`` with no flags: ``lm.job.run(TrainConfig())``) in a
fresh process, from an empty data cache (so a BPE default pays for training its tokenizer and
tokenizing the corpus), then samples it as the run's closing sample does (``sample_tokens`` at
the version's default temperature and top-k) from 8 prompts of validation text, 200 tokens each,
seeds 0-7 (prompts as long as the closing sample's: 48 tokens or half the context). The figure: the share of
the samples' words (runs of two or more letters, lower-cased: ``shardax.lm.sampling.words``) that occur in the
training corpus (the standard library's source), pooled over the 8 samples, with the lowest and highest single
sample (one sample varies a lot; the pool is what to compare). Also the wall time to the end of training and
the validation loss. Keeps each label's row in ``benchmarks/results/default_sample.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "default_sample.json"
SAMPLES, NEW_TOKENS, PROMPT = 8, 200, 48

CHILD = f"""
import json, sys, time
began = time.perf_counter()
from shardax.cli.devices import configure_jax
configure_jax(8)
from shardax.lm import job
from shardax.lm.config import resolve
from shardax.lm.settings import TrainConfig
from shardax.lm.data import open_data
from shardax.lm.sampling import sample_tokens

config = TrainConfig.of(sample_bytes=0)
result = job.run(config)
wall = time.perf_counter() - began
run = resolve(config)
data = open_data(run.data, run.tokenizer, run.vocab_size, run.field, run.model.seq_len)
samples = []
for seed in range({SAMPLES}):
    length = min({PROMPT}, run.model.seq_len // 2)  # as the run's closing sample
    prompt = data.prompt(length + 300 * seed)[-length:]
    while len(prompt) > 8 and not data.decode(prompt).endswith("\\n"):  # start the sample on a new line
        prompt = prompt[:-1]
    ids = sample_tokens(result.parallel, result.state, prompt, {NEW_TOKENS}, run.model.seq_len,
                        vocab=data.vocab, temperature=config.sample_temperature, top_k=config.sample_top_k,
                        seed=seed)
    samples.append(data.decode(ids))
print("RESULT " + json.dumps({{"samples": samples, "wall_s": wall, "val_loss": result.final_val_loss,
                              "unigram": result.baselines["unigram"], "tokenizer": run.tokenizer,
                              "vocab": data.vocab,
                              "batch_size": run.batch_size, "steps": run.steps,
                              "temperature": config.sample_temperature, "top_k": config.sample_top_k}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--source",
                        help="a checkout's src/ directory to run instead of the installed shardax")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.source:
        env["PYTHONPATH"] = str(Path(args.source).resolve())
    with tempfile.TemporaryDirectory() as work:
        env["SHARDAX_DATA_CACHE"] = str(Path(work) / "cache")  # a first run: a tokenizer is trained afresh
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=work, env=env, capture_output=True,
                              text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])

    from shardax.data.corpus import default_sources
    from shardax.lm.sampling import vocabulary, word_share

    known = vocabulary(path.read_text(errors="replace") for path in default_sources())
    each = [word_share(text, known) for text in found["samples"]]
    words = sum(count for _, count in each)
    pooled = sum(share * count for share, count in each) / max(words, 1)
    shares = [share for share, count in each if count]
    row = {"label": args.label, "word_share": round(pooled, 3), "words": words,
           "lowest": round(min(shares), 3), "highest": round(max(shares), 3), "samples": found.pop("samples"),
           **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in found.items()},
           "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    rows = [r for r in (json.loads(RESULTS.read_text()) if RESULTS.exists() else [])
            if r["label"] != args.label]
    RESULTS.write_text(json.dumps(rows + [row], indent=1) + "\n")
    print(f"{args.label}: {100 * pooled:.1f}% of {words} sampled words are words of the corpus (single "
          f"samples {100 * min(shares):.0f}-{100 * max(shares):.0f}%); trained in {found['wall_s']:.0f} s; "
          f"validation {found['val_loss']:.4f} vs unigram {found['unigram']:.4f}")
    print(row["samples"][0])


if __name__ == "__main__":
    main()
