"""The data-parallel notebook vs shardax: step time and tokens/s of the notebook's model, same
devices, one run (benchmark 5 in docs/benchmarks.md).

The notebook's own implementation (flax.linen + TrainState, replicated state) is read from
its text at run time (``../shared/seeds/notebook-data-parallelism-in-jax.txt``, or
--notebook PATH) and executed as written; shardax trains its GPT-style model (``GPT_STYLE``, same
shapes: vocab 512, seq 64, d_model 256, 8 heads, 4 layers, d_ff 1024, batch 32) with strategy dp
and, like the notebook, its blocks applied in a Python loop (``scan_layers=False``).
The two are timed interleaved, step for step (which goes first alternating), so machine noise
hits both alike; the ratio is the median of the paired per-step ratios.

    python benchmarks/notebook_step_time.py [--devices 8] [--steps 30] [--profile]

With --profile it also profiles 5 steps of each and records where their compute goes per
device (XLA's instructions by kind, collectives left out: ``profile_ops.py``).

Writes benchmarks/results/notebook_step_time.json and prints a markdown row.
"""

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--notebook", default=str(Path(__file__).resolve().parents[2] / "shared" / "seeds"
                                                / "notebook-data-parallelism-in-jax.txt"))
parser.add_argument("--profile", action="store_true",
                    help="also profile 5 steps of each (where the compute goes)")
args = parser.parse_args()

import jax  # noqa: E402

from shardax.cpu_devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(args.devices)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from shardax import DeviceMeshManager, parallelize  # noqa: E402
from shardax.models.presets import GPT_STYLE  # noqa: E402
from shardax.models.transformer import TransformerLM, next_token_loss  # noqa: E402


def notebook_namespace(path):
    """Execute the notebook's definition cells (everything before its final `train()` call)."""
    text = Path(path).read_text()
    cells = re.split(r"\n\s*In \[\d+\]:\s*\n", text)[1:]
    code = "\n".join(cell.split("\n## ")[0] for cell in cells)
    code = code.split("\ntrain()")[0]
    namespace = {"__name__": "notebook"}
    exec(compile(code, path, "exec"), namespace)  # noqa: S102 - the seed's own code, on purpose
    return namespace


def notebook_stepper(nb, mesh):
    cfg = nb["TrainCfg"]()
    with jax.set_mesh(mesh):
        state, model = nb["create_train_state"](jax.random.PRNGKey(cfg.seed), cfg)
        state = state.replace(params=nb["replicate_tree_to_mesh"](state.params, mesh),
                              opt_state=nb["replicate_tree_to_mesh"](state.opt_state, mesh))
        step = nb["build_step_fn"](cfg, model)
    data = nb["make_toy_dataset"](cfg, 1234)
    holder = {"state": state, "i": 0}

    def run_one():
        batch = data[(holder["i"] * cfg.batch_size) % len(data):][: cfg.batch_size]
        holder["i"] += 1
        with jax.set_mesh(mesh):
            holder["state"], loss = step(holder["state"], nb["shard_batch_to_mesh"](batch, mesh, cfg.seq_len))
        return loss

    return run_one, cfg


def shardax_stepper(mesh, cfg):
    model = GPT_STYLE.config(scan_layers=False)
    parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), optax.adamw(cfg.lr), mesh, "dp")
    state = {"state": parallel.init(seed=0)}
    step = parallel.train_step(next_token_loss)
    tokens = np.random.RandomState(1234).randint(0, model.vocab_size,
                                                 size=(cfg.batch_size, model.seq_len + 1))

    def run_one():
        state["state"], metrics = step(state["state"],
                                       parallel.place_batch({"tokens": tokens.astype(np.int32)}))
        return metrics["loss"]

    return run_one


def timed(run_one):
    start = time.perf_counter()
    jax.block_until_ready(run_one())
    return time.perf_counter() - start


nb = notebook_namespace(args.notebook)
mesh = DeviceMeshManager().create_device_mesh("data=-1")
notebook_step, cfg = notebook_stepper(nb, mesh)
shardax_step = shardax_stepper(mesh, cfg)
for warm in range(3):  # compile and settle both
    timed(notebook_step), timed(shardax_step)
notebook_times, shardax_times = [], []
for index in range(args.steps):  # step for step, which goes first alternating
    if index % 2:
        shardax_times.append(timed(shardax_step))
        notebook_times.append(timed(notebook_step))
    else:
        notebook_times.append(timed(notebook_step))
        shardax_times.append(timed(shardax_step))
# tokens/s, shardax / notebook
ratios = [theirs / ours for theirs, ours in zip(notebook_times, shardax_times)]
tokens = cfg.batch_size * cfg.seq_len
result = {
    "benchmark": "notebook_step_time",
    "machine": f"{platform.processor() or platform.machine()}, {jax.device_count()} "
               f"{jax.devices()[0].platform} devices",
    "jax": jax.__version__,
    "config": "vocab 512, seq 64, d_model 256, 8 heads, 4 layers in a loop, d_ff 1024, global batch 32, dp",
    "notebook_step_s": statistics.median(notebook_times),
    "shardax_step_s": statistics.median(shardax_times),
    "notebook_tokens_per_s": tokens / statistics.median(notebook_times),
    "shardax_tokens_per_s": tokens / statistics.median(shardax_times),
}
result["tokens_per_s_ratio"] = statistics.median(ratios)  # the median of the paired ratios
quartiles = statistics.quantiles(ratios, n=4)
result["tokens_per_s_ratio_quartiles"] = [quartiles[0], quartiles[2]]
result["steps"] = args.steps
if args.profile:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from profile_ops import compute_by_kind, profile_top_ops

    for name, run_one in (("notebook", notebook_step), ("shardax", shardax_step)):
        kinds = compute_by_kind(profile_top_ops(run_one, "", steps=5, top=None))
        result[f"{name}_compute_ms_per_device_step"] = sum(kinds.values())
        result[f"{name}_compute_by_kind_ms"] = {kind: round(ms, 2) for kind, ms in list(kinds.items())[:10]}
        print(name, f"{sum(kinds.values()):.1f} ms of compute per device per step:",
              result[f"{name}_compute_by_kind_ms"])
out = Path(__file__).parent / "results" / "notebook_step_time.json"
out.parent.mkdir(exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
print(f"| notebook config, {result['machine']} | notebook {1000 * result['notebook_step_s']:.0f} ms/step "
      f"({result['notebook_tokens_per_s']:,.0f} tok/s) | shardax {1000 * result['shardax_step_s']:.0f} "
      f"ms/step ({result['shardax_tokens_per_s']:,.0f} tok/s) | ratio {result['tokens_per_s_ratio']:.2f} |")
