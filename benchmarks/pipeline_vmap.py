"""How the pipeline applies its stages side by side: ``jax.vmap`` (what shardax runs) against
``nnx.vmap`` (MaxText measured 6.3x more compile-time memory with it), on one pipeline step.

    python benchmarks/pipeline_vmap.py [--rounds 3]

Each compile runs in a fresh process (8 simulated CPU devices), the two alternating, and
reports: trace-and-lower seconds, compile seconds, the process's peak resident memory while
lowering and compiling (growth of ``ru_maxrss``), the compiled program's temporaries, and the
loss of one step on the same batch (the two must compute the same thing). Medians over rounds.
Writes ``benchmarks/results/pipeline_vmap.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MESH, STRATEGY, MICROBATCHES, BATCH = "stage=4,data=2", "pp", 8, 16
MODEL = dict(vocab_size=512, seq_len=256, d_model=512, n_heads=8, n_layers=16, d_ff=2048)


def measure(variant: str) -> dict:
    """One fresh compile of the pipeline step with the stages applied by ``variant``."""
    import jax

    from shardax.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(8)
    import numpy as np
    import optax
    from flax import nnx

    import shardax.runtime.pipeline as pipeline
    from shardax import DeviceMeshManager, parallelize
    from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss

    if variant == "nnx.vmap":
        def nnx_vmap(stage, in_axes, spmd_axis_name):
            mapped = nnx.vmap(stage, in_axes=in_axes, spmd_axis_name=spmd_axis_name)

            def call(chunks, *rest):
                # nnx.vmap takes graph nodes made at its own trace level: the layers' Variables anew
                fresh = jax.tree.map(lambda v: type(v)(v.get_value(), **v.get_metadata()), chunks,
                                     is_leaf=lambda node: isinstance(node, nnx.Variable))
                return mapped(fresh, *rest)

            return call

        pipeline.vmap_stages = nnx_vmap
    config = TransformerConfig(**MODEL)
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(1e-3),
                           DeviceMeshManager().create_device_mesh(MESH), STRATEGY, microbatches=MICROBATCHES)
    step = parallel.train_step(next_token_loss, donate=False)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, config.seq_len + 1),
                                               dtype=np.int32)
    batch = parallel.place_batch({"tokens": tokens})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    lowered = step.lower(parallel.abstract_state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _, metrics = compiled(parallel.init(seed=0), batch)
    return {"variant": variant, "lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
            "peak_rss_growth_mb": (peak - before) / 1024,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "stablehlo_chars": len(lowered.as_text()), "loss": float(metrics["loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    runs: dict[str, list[dict]] = {"jax.vmap": [], "nnx.vmap": []}
    for round_ in range(options.rounds):
        order = ["jax.vmap", "nnx.vmap"] if round_ % 2 == 0 else ["nnx.vmap", "jax.vmap"]
        for variant in order:
            out = subprocess.run([sys.executable, __file__, "--one", variant], check=True,
                                 capture_output=True, text=True, cwd=Path(__file__).parent.parent).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            print(runs[variant][-1], flush=True)
    median = {variant: {key: statistics.median(run[key] for run in found) for key in found[0]
                        if key != "variant"}
              for variant, found in runs.items()}
    jax_, nnx_ = median["jax.vmap"], median["nnx.vmap"]
    import jax

    result = {"benchmark": "pipeline_vmap", "machine": f"{jax.__version__}; 8 simulated CPU devices",
              "mesh": MESH, "strategy": STRATEGY, "microbatches": MICROBATCHES, "batch": BATCH,
              "model": MODEL, "rounds": options.rounds, "median": median, "runs": runs,
              "nnx_over_jax": {key: nnx_[key] / jax_[key]
                               for key in ("lower_s", "compile_s", "peak_rss_growth_mb", "temp_bytes",
                                           "stablehlo_chars")},
              "same_loss": jax_["loss"] == nnx_["loss"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_vmap.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({key: result[key] for key in ("median", "nnx_over_jax", "same_loss")}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(measure(sys.argv[2])))
    else:
        main()
