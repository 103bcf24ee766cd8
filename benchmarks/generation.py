"""Benchmark 19: decoding with the key/value cache, against recomputing the prefix and by length.

    python benchmarks/generation.py

Five models of the ``small`` preset's shape (6 layers of width 384, rotary positions, a
context of 2,304; random weights, float32, greedy): its own 6 key/value heads, 2 (grouped-query
attention as Llama 3 and Mistral have), 6 computing in bfloat16 (its cache bfloat16, held as
the floats' bits), 6 with a sliding window of 256 on every layer (whose
cache is a ring of 256 positions) and 6 with that window on every other layer (Gemma 2's way:
the windowed layers' ring beside the full layers' growing cache). One prompt of 16 tokens on
one CPU device: parts 1 and 2 run in a process of their own with one CPU device (the host's
threads all its own; the 8 simulated devices of part 3 would share them 16 ways).

1. Tokens per second of ``shardax.generate`` (prefill, then one decode step per token from the
   cache) against recomputing (the whole sequence so far run again for every new token, in
   windows of 128 so that a window's shape compiles once), at 128 and 512 new tokens, the two
   interleaved, each timed on a second run after its compiles; the tokens must be equal.
2. The per-token time as the cache fills: the median decode step over the last 64 tokens of
   runs of 128, 512 and 2,048 new tokens (the three lengths in turn, twice; the steps of both
   runs of a length pooled), against what a memory-bound step predicts: the bytes a
   step reads (every weight once, and the keys and values of each layer at the cache's length
   then) in the same ratio.
3. The cache's bytes per device while decoding, 8 prompts on ``data=4,model=2``, against
   2 L B T kv_heads head_dim bytes / devices at the cache's length then; for the alternating
   model at 1,024 new tokens, against 2 B kv_heads head_dim (L_full T + L_window 256) bytes /
   devices and against a cache grown whole.
Writes ``benchmarks/results/generation.json``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax

from shardax.cpu_devices import POOL_VARIABLE, simulate_cpu_devices

SPEED = "--speed" in sys.argv  # parts 1 and 2, on one CPU device
if not SPEED:
    simulate_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import DeviceMeshManager, generate, parallelize  # noqa: E402
from shardax.generation import cache_layout  # noqa: E402
from shardax.models.presets import get_preset  # noqa: E402
from shardax.models.transformer import TransformerLM  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LENGTHS = (128, 512, 2048)
RECOMPUTED = (128, 512)
WINDOW = 128  # the recomputing baseline's shape bucket
TAIL = 64  # decode steps whose median is a length's per-token time
REPEATS = 2  # runs of each length, the lengths in turn
MODELS = {"6 kv heads": {}, "2 kv heads": {"n_kv_heads": 2},
          "6 kv heads, bfloat16": {"compute_dtype": "bfloat16"}, "window 256": {"sliding_window": 256},
          "window 256, alternate layers": {"sliding_window": 256, "sliding_layers": (0, 2, 4)}}
FORWARD = jax.jit(lambda model, tokens: model(tokens))


def compile_windows(model: TransformerLM, longest: int) -> None:
    for width in range(WINDOW, longest + WINDOW, WINDOW):
        FORWARD(model, np.zeros((1, width), np.int32)).block_until_ready()


def recompute(model: TransformerLM, prompt: list[int], new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new):
        width = -(-len(tokens) // WINDOW) * WINDOW
        window = np.zeros((1, width), np.int32)
        window[0, :len(tokens)] = tokens
        tokens.append(int(jnp.argmax(FORWARD(model, window)[0, len(tokens) - 1])))
    return tokens[len(prompt):]


def cached(model: TransformerLM, prompt: list[int], new: int) -> tuple[float, list[float], list[int]]:
    """(seconds, the last TAIL steps' times, tokens) of a second run."""
    generate(model, [prompt], max_new_tokens=new)  # compiles every cache length on the way
    stamps = []
    began = time.perf_counter()
    out = generate(model, [prompt], max_new_tokens=new,
                   on_token=lambda *_: stamps.append(time.perf_counter()))
    return time.perf_counter() - began, list(np.diff(stamps)[-TAIL:]), out[0]


def step_bytes(model: TransformerLM, new: int) -> int:
    """Bytes a decode step reads at the end of a run of ``new`` tokens: the weights, and the
    keys and values at the cache's length then."""
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    layout = cache_layout(model, 1, 16, new)
    return weights + layout.bytes_per_device(model.config, layout.length_for(16 + new))


def speed_rows(name: str, model: TransformerLM, prompt: list[int]) -> list[dict]:
    runs: dict[int, list] = {new: [] for new in LENGTHS}
    for _ in range(REPEATS):
        for new in LENGTHS:
            runs[new].append(cached(model, prompt, new))
    rows = []
    for new in LENGTHS:
        seconds = float(np.median([run[0] for run in runs[new]]))
        steps = [step for run in runs[new] for step in run[1]]
        tokens = runs[new][0][2]
        assert all(run[2] == tokens for run in runs[new])
        row = {"model": name, "new_tokens": new, "cache_tokens_per_s": new / seconds,
               "step_ms": 1e3 * float(np.median(steps)), "step_bytes": step_bytes(model, new)}
        if name == "6 kv heads" and new in RECOMPUTED:
            compile_windows(model, len(prompt) + new)
            began = time.perf_counter()
            again = recompute(model, prompt, new)
            row["recompute_tokens_per_s"] = new / (time.perf_counter() - began)
            assert again == tokens, f"the cache and the full forward disagree at {new} new tokens"
            row["speedup"] = row["cache_tokens_per_s"] / row["recompute_tokens_per_s"]
        rows.append(row)
        print(row, flush=True)
    first, last = rows[0], rows[-1]
    last["step_vs_128"] = last["step_ms"] / first["step_ms"]
    last["bytes_vs_128"] = last["step_bytes"] / first["step_bytes"]
    return rows


def speed() -> list[dict]:
    """Parts 1 and 2 (run with ``--speed``, on one CPU device)."""
    rows = []
    for name, extra in MODELS.items():
        config = get_preset("small").config(positions="rotary", seq_len=2304, **extra)
        model = TransformerLM(config, rngs=nnx.Rngs(0))
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, 16)]
        rows += speed_rows(name, model, prompt)
    return rows


def sharded_model(config) -> TransformerLM:
    mesh = DeviceMeshManager().create_device_mesh("data=4,model=2")
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.identity(), mesh, "fsdp_tp")
    return parallel.merge(parallel.init(0))


def ring_bytes(config, new: int = 1024) -> dict:
    """The alternating model's cache on device 0 at its last decode step (every live key/value
    array of the decoder), against the layout's count and a cache grown whole."""
    import dataclasses

    sharded = sharded_model(config)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, 16)]
    layout = cache_layout(sharded, 8, 16, new)
    seen = []

    def measure(step: int, _: list[int]) -> None:
        if step == new - 2:
            live = [a for a in jax.live_arrays() if a.ndim == 5 and a.shape[1] == layout.batch
                    and (a.shape[2], a.shape[4]) == (config.kv_heads, config.head_dim)]
            seen.append((sorted((a.shape[0], a.shape[1], a.shape[3]) for a in live), sum(
                shard.data.nbytes for a in live for shard in a.addressable_shards
                if shard.device == jax.devices()[0])))

    generate(sharded, [prompt] * 8, max_new_tokens=new, on_token=measure)
    shapes, measured = seen[0]
    theory, whole = (dataclasses.replace(layout, ring=ring).bytes_per_device(sharded.config)
                     for ring in (layout.ring, None))
    return {"new_tokens": new, "ring": layout.ring, "length": layout.length, "arrays": shapes,
            "bytes_per_device": measured, "theory_bytes_per_device": theory, "ratio": measured / theory,
            "grown_whole_bytes_per_device": whole, "of_grown_whole": measured / whole}


def cache_bytes(config) -> dict:
    sharded = sharded_model(config)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, 16)]
    layout = cache_layout(sharded, 8, 16, 64)
    seen = []

    def measure(step: int, _: list[int]) -> None:
        if step == 62:  # the last decode step's cache: its last length
            live = [a for a in jax.live_arrays() if a.ndim == 5 and a.shape[0] == config.n_layers
                    and a.shape[1] == layout.batch and (a.shape[2], a.shape[4]) == (config.kv_heads,
                                                                                    config.head_dim)]
            assert len(live) == 2, [a.shape for a in live]  # keys and values
            seen.append((live[0].shape[3], sum(shard.data.nbytes for a in live
                                               for shard in a.addressable_shards
                                               if shard.device == jax.devices()[0])))

    generate(sharded, [prompt] * 8, max_new_tokens=64, on_token=measure)
    length, measured = seen[0]
    theory = 2 * config.n_layers * layout.batch * length * config.kv_heads * config.head_dim * 4 // 8
    return {"mesh": "data=4,model=2", "batch": layout.batch, "length": length, "lengths": layout.lengths,
            "bytes_per_device": measured, "theory_bytes_per_device": theory, "ratio": measured / theory}


def main() -> None:
    if SPEED:
        print(json.dumps(speed()))
        return
    alone = {key: value for key, value in os.environ.items() if key != POOL_VARIABLE}  # its default pool
    out = subprocess.run([sys.executable, __file__, "--speed"], capture_output=True, text=True, check=True,
                         env=alone)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    result = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__}",
              "model": "small (6 layers, width 384), rotary, seq_len 2304, float32", "rows": rows,
              "cache": cache_bytes(get_preset("small").config(positions="rotary", seq_len=2304)),
              "ring": ring_bytes(get_preset("small").config(positions="rotary", seq_len=2304,
                                                            **MODELS["window 256, alternate layers"]))}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "generation.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
