"""Benchmark 13: layer norm and GELU with shardax's custom VJPs against plain autodiff.

    python benchmarks/layer_vjps.py                  # 8 simulated CPU devices, dp
    python benchmarks/layer_vjps.py --preset medium  # on a machine with one GPU (bfloat16)

shardax's layer norm and GELU (``shardax.models.transformer``) keep only their input for the
backward pass and recompute the rest there; plain autodiff of the same formulas keeps several
intermediates. Issue 15 keeps them only if they help on an accelerator too. This compiles the
same training step twice, once as shardax writes it and once with both functions swapped for
their plain-JAX forms, and reports for each:

- the compiled step's peak memory per device (XLA's memory analysis), for the timed preset
  and, compile only, for ``--memory-presets``;
- step time, the two steps alternating (which goes first alternating too), as the median of
  the paired ratios, as in benchmark 5.

On a CPU the step runs data-parallel on 8 simulated devices in float32; on a GPU on one device
in bfloat16 with the attention kernel ``auto`` picks (cuDNN there). Writes
``benchmarks/results/layer_vjps[_gpu].json`` and prints a markdown row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--preset", default=None,
                    help="the timed preset (default: gpt-style on CPU, medium on GPU)")
parser.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
parser.add_argument("--steps", type=int, default=40, help="timed pairs after 3 warm-up pairs")
parser.add_argument("--memory-presets", default="small,medium", help="presets compiled for memory only")
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on a GPU)")
args = parser.parse_args()

import jax  # noqa: E402

from shardax.cpu_devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(args.devices)  # only the CPU backend reads it

import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardax import DeviceMeshManager, parallelize  # noqa: E402
from shardax.analysis.plan import compile_step, compiled_memory  # noqa: E402
from shardax.models import ops, transformer  # noqa: E402
from shardax.models.presets import GPT_STYLE, get_preset  # noqa: E402


def preset_named(name: str):
    """A preset, or ``gpt-style``: the GPT-2-style model (layer norms and GELU, the
    layers whose custom VJPs this times; the presets are Llama-shaped)."""
    return GPT_STYLE if name == "gpt-style" else get_preset(name)

ON_GPU = jax.devices()[0].platform == "gpu"


def autodiff_layer_norm(x, scale, bias):
    """The same layer norm, differentiated by JAX (no custom VJP)."""
    return ops._normalized(x)[0] * scale + bias


@contextlib.contextmanager
def plain_autodiff():
    """Trace the model with layer norm and GELU differentiated by JAX itself."""
    saved = ops.layer_norm, ops.gelu
    ops.layer_norm, ops.gelu = autodiff_layer_norm, jax.nn.gelu
    try:
        yield
    finally:
        ops.layer_norm, ops.gelu = saved


def build(preset: str, batch_size: int, plain: bool):
    overrides = {"compute_dtype": "bfloat16"} if ON_GPU else {}
    config = preset_named(preset).config(**overrides)
    mesh = DeviceMeshManager().create_device_mesh("data=1" if ON_GPU else "data=-1")
    parallel = parallelize(lambda rngs: transformer.TransformerLM(config, rngs=rngs), optax.adamw(1e-4), mesh,
                           "dp")
    with plain_autodiff() if plain else contextlib.nullcontext():
        compiled = compile_step(parallel, batch_size, config.seq_len)
    return config, parallel, compiled


def timed(compiled, holder, batch) -> float:
    start = time.perf_counter()
    holder["state"], metrics = compiled(holder["state"], batch)
    jax.block_until_ready(metrics["loss"])
    return time.perf_counter() - start


preset = args.preset or ("medium" if ON_GPU else "gpt-style")
batch_size = args.batch_size or preset_named(preset).batch_size
runs = {}
for name, plain in (("custom", False), ("autodiff", True)):
    config, parallel, compiled = build(preset, batch_size, plain)
    runs[name] = {"compiled": compiled, "holder": {"state": parallel.init(seed=0)},
                  "peak": compiled_memory(compiled)["peak"]}
tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(batch_size, config.seq_len + 1))
batch = parallel.place_batch({"tokens": tokens.astype(np.int32)})

times = {"custom": [], "autodiff": []}
for index in range(3 + args.steps):
    order = ("custom", "autodiff") if index % 2 == 0 else ("autodiff", "custom")
    for name in order:
        seconds = timed(runs[name]["compiled"], runs[name]["holder"], batch)
        if index >= 3:
            times[name].append(seconds)
# > 1: custom is faster
ratios = [plain / custom for custom, plain in zip(times["custom"], times["autodiff"])]
quartiles = statistics.quantiles(ratios, n=4)

memory = {}
for extra in [name for name in args.memory_presets.split(",") if name]:
    peaks = {}
    for name, plain in (("custom", False), ("autodiff", True)):
        peaks[name] = compiled_memory(build(extra, preset_named(extra).batch_size, plain)[2])["peak"]
    memory[extra] = peaks

device = jax.devices()[0]
result = {
    "benchmark": "layer_vjps",
    "machine": f"{device.device_kind}, {jax.device_count()} {device.platform} device(s), jax "
               f"{jax.__version__}",
    "preset": preset, "batch_size": batch_size, "compute_dtype": config.compute_dtype,
    "attention": transformer.attention_implementation(config)[0],
    "mesh": "data=1" if ON_GPU else f"data={jax.device_count()}",
    "custom_step_s": statistics.median(times["custom"]),
    "autodiff_step_s": statistics.median(times["autodiff"]),
    "speedup": statistics.median(ratios), "speedup_quartiles": [quartiles[0], quartiles[2]],
    "custom_peak_bytes": runs["custom"]["peak"], "autodiff_peak_bytes": runs["autodiff"]["peak"],
    "memory_only": memory, "steps": args.steps,
}
out = Path(__file__).parent / "results" / ("layer_vjps_gpu.json" if ON_GPU else "layer_vjps.json")
out.parent.mkdir(exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result, indent=2))
