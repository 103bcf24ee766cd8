"""Benchmark 19: generating with the key/value cache against recomputing the prefix.

    python benchmarks/generation.py

The ``small`` preset with rotary positions and a context of 2,304 (random weights; greedy, so
both ways must give the same tokens, which is checked), one prompt of 16 tokens on one CPU
device: tokens per second of ``shardax.generate`` (prefill, then one decode step per token from
the cache) and of the way without a cache (the whole sequence so far run again for every new
token, in windows of 128 so that a window's shape compiles once), at 128, 512 and 2,048 new
tokens; each timed on a second run, after its compiles. Then the cache's bytes per device as
they are while decoding (the live arrays of the cache's shape, device 0's shards), 8 prompts on
``data=4,model=2``, against 2 L B T kv_heads head_dim bytes / devices.
Writes ``benchmarks/results/generation.json`` (``--cache-only`` measures the cache again and
keeps the speed rows already there).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
from shardax.cpu_devices import simulate_cpu_devices

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
WINDOW = 128


FORWARD = jax.jit(lambda model, tokens: model(tokens))


def compile_windows(model: TransformerLM, longest: int) -> None:
    for width in range(WINDOW, longest + WINDOW, WINDOW):
        FORWARD(model, np.zeros((1, width), np.int32)).block_until_ready()


def recompute(model: TransformerLM, prompt: list[int], new: int) -> list[int]:
    forward = FORWARD
    tokens = list(prompt)
    for _ in range(new):
        width = -(-len(tokens) // WINDOW) * WINDOW
        window = np.zeros((1, width), np.int32)
        window[0, :len(tokens)] = tokens
        tokens.append(int(jnp.argmax(forward(model, window)[0, len(tokens) - 1])))
    return tokens[len(prompt):]


def timed(run, warm=None) -> tuple[float, list[int]]:
    (warm or run)()  # compiles
    began = time.perf_counter()
    out = run()
    return time.perf_counter() - began, out


def main() -> None:
    config = get_preset("small").config(positions="rotary", seq_len=2304)
    with jax.default_device(jax.devices()[0]):
        model = TransformerLM(config, rngs=nnx.Rngs(0))
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, 16)]
    rows = []
    if "--cache-only" in sys.argv:  # keep the speed rows of the last full run (minutes of recomputing)
        rows = json.loads((RESULTS / "generation.json").read_text())["rows"]
    for new in LENGTHS if not rows else ():
        cached_s, cached = timed(lambda: generate(model, [prompt], max_new_tokens=new)[0])
        again_s, again = timed(lambda: recompute(model, prompt, new),
                               lambda: compile_windows(model, len(prompt) + new))
        assert cached == again, f"the cache and the full forward disagree at {new} new tokens"
        rows.append({"new_tokens": new, "cache_tokens_per_s": new / cached_s, "recompute_tokens_per_s": new / again_s,
                     "speedup": again_s / cached_s})
        print(rows[-1], flush=True)
    mesh = DeviceMeshManager().create_device_mesh("data=4,model=2")
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.identity(), mesh, "fsdp_tp")
    sharded = parallel.merge(parallel.init(0))
    prompts = [prompt] * 8
    seen = []
    layout = cache_layout(sharded, 8, 16, 64)
    cache_shape = (config.n_layers, layout.batch, layout.length, config.kv_heads, config.head_dim)

    def measure(step: int, _: list[int]) -> None:
        if step == 1:
            live = [a for a in jax.live_arrays() if a.shape == cache_shape]
            assert len(live) == 2, [a.shape for a in live]  # keys and values
            seen.append(sum(shard.data.nbytes for a in live for shard in a.addressable_shards
                            if shard.device == jax.devices()[0]))

    generate(sharded, prompts, max_new_tokens=64, on_token=measure)
    theory = 2 * config.n_layers * layout.batch * layout.length * config.kv_heads * config.head_dim * 4 // 8
    result = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, jax {jax.__version__}",
              "model": "small, rotary, seq_len 2304", "rows": rows,
              "cache": {"mesh": "data=4,model=2", "batch": layout.batch, "length": layout.length,
                        "bytes_per_device": seen[0], "theory_bytes_per_device": theory, "ratio": seen[0] / theory}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "generation.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
