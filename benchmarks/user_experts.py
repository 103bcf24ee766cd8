"""Benchmark 28: a user's own mixture of experts, split over an ``expert`` axis read off its program,
compiled by XLA:TPU (no TPU needed).

    python benchmarks/user_experts.py                 # tpu-v5p-16: 8 chips
    python benchmarks/user_experts.py --target tpu-v5e-8

The Switch-style model of ``tests/zoo_models.py`` (no annotations: a router, one-hot dispatch and
combine tensors with a capacity of tokens x top-k / experts per expert, stacked expert weights
``[experts, d_model, hidden]`` applied by einsum), sized as a real layer: 8 experts, 2 per token,
1024 wide, 4096 hidden, 2 layers, batch 32 x 256, float32 weights (XLA:TPU computes in bfloat16).
Compiled for the train step under dp (every chip holds every expert) and ep on
``data=4,expert=2`` and ``data=1,expert=8`` (shardax reads the experts' dimension off the
program and splits the stacked weights over ``expert``; the step is GSPMD's, no shard_map).
Per layout: the experts' bytes each chip stores
(from the layout's shards) against their total / X, XLA:TPU's compiled peak per chip, the
all-to-all bytes each chip sends per step, and the bytes of expert weights all-gathered (zero
when tokens travel to the experts rather than experts to the tokens). Needs
``pip install "shardax[tpu-plan]"``. Writes ``benchmarks/results/user_experts.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardax import parallelize  # noqa: E402
from shardax.analysis.collectives import find_collectives  # noqa: E402
from shardax.analysis.plan import compiled_memory  # noqa: E402
from shardax.analysis.targets import parse_target  # noqa: E402
from shardax.analysis.traffic import wire_bytes  # noqa: E402
from shardax.sharding.place import spec_axes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo_models  # noqa: E402  (the test suite's Switch-style model, resized below)

RESULTS = Path(__file__).parent / "results" / "user_experts.json"
SIZES = dict(D_MODEL=1024, HIDDEN=4096, EXPERTS=8, TOP_K=2, VOCAB=1024, HEADS=8, KV_HEADS=8, HEAD_DIM=128,
             LAYERS=2)
BATCH, LENGTH = 32, 256
LAYOUTS = [("dp", (8,), ("data",)), ("ep", (4, 2), ("data", "expert")), ("ep", (1, 8), ("data", "expert"))]


def measure(devices: list, strategy: str, shape: tuple[int, ...], names: tuple[str, ...]) -> dict:
    mesh = jax.make_mesh(shape, names, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    batch = {"tokens": np.zeros((BATCH, LENGTH + 1), np.int32)}
    parallel = parallelize(zoo_models.SwitchStyle, optax.adamw(1e-4), mesh, strategy,
                           loss_fn=zoo_models.lm_loss, example_batch=batch)
    experts = [leaf for path, leaf in parallel.layout.leaves.items() if path.endswith(("/wi", "/wo"))]
    total = sum(math.prod(leaf.shape) * 4 for leaf in experts)
    held = sum(math.prod(leaf.shape) * 4 // math.prod(mesh.shape[axis] for entry in leaf.spec
                                                       for axis in spec_axes(entry)) for leaf in experts)
    sharding = parallel.layout.batch()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch)
    compiled = parallel.train_step(zoo_models.lm_loss).lower(parallel.abstract_state, abstract).compile()
    collectives = find_collectives(compiled.as_text())
    expert_shapes = {f"[{','.join(map(str, leaf.shape))}]" for leaf in experts}
    gathered = sum(wire_bytes(c, len(devices)) * c.executions for c in collectives
                   if c.kind == "all-gather" and any("[" + shape.split("[", 1)[1] in expert_shapes
                                                     for shape in c.shapes))
    sent = sum(wire_bytes(c, len(devices)) * c.executions for c in collectives if c.kind == "all-to-all")
    memory = compiled_memory(compiled)
    return {"strategy": strategy, "mesh": ",".join(f"{n}={s}" for n, s in zip(names, shape)),
            "experts_bytes_total": total, "experts_bytes_per_chip": held,
            "peak_bytes_per_chip": memory.get("hbm_peak", memory["peak"]), "all_to_all_bytes": sent,
            "expert_weight_gather_bytes": gathered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu-v5p-16")
    args = parser.parse_args()
    for name, value in SIZES.items():
        setattr(zoo_models, name, value)
    target = parse_target(args.target)
    devices = target.devices()
    rows = []
    for strategy, shape, names in LAYOUTS:
        row = measure(devices, strategy, shape, names)
        rows.append(row)
        held = row['experts_bytes_per_chip'] / 1e6
        print(f"{target.name} {strategy:<3} {row['mesh']:<16} experts {held:7.1f} "
              f"of {row['experts_bytes_total'] / 1e6:.1f} MB a chip, "
              f"peak {row['peak_bytes_per_chip'] / 1e9:.3f} GB, "
              f"all-to-all {row['all_to_all_bytes'] / 1e6:.1f} MB, expert weights gathered "
              f"{row['expert_weight_gather_bytes'] / 1e6:.1f} MB", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"target": target.name, "model": SIZES, "batch": BATCH, "length": LENGTH,
                                   "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
