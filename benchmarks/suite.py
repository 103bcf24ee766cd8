"""shardax's benchmark suite: overhead, memory, communication, compile time, largest model,
and how close ``shardax plan``'s predicted peak comes beyond the tiny preset.

    python benchmarks/run_all.py            # everything, then the markdown table
    python benchmarks/suite.py overhead     # one benchmark

Each benchmark writes ``benchmarks/results/<name>.json``. Speeds are ratios measured in one
run with the two sides interleaved (never absolute numbers compared across runs).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import DeviceMeshManager, parallelize  # noqa: E402
from shardax.analysis.plan import plan_strategy  # noqa: E402
from shardax.models.presets import get_preset, parameter_count  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STRATEGY_MESHES = [("dp", "data=8"), ("zero1", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"),
                   ("tp", "data=4,model=2"), ("fsdp_tp", "data=4,model=2"), ("hsdp", "replica=2,data=4")]


def machine() -> str:
    return f"{platform.machine()} CPU, {jax.device_count()} simulated {jax.devices()[0].platform} devices, jax {jax.__version__}"


def save(name: str, result: dict) -> dict:
    RESULTS.mkdir(exist_ok=True)
    result = {"benchmark": name, "machine": machine(), **result}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def hand_written_step(parallel, tx):
    """The same step written directly with jax.jit and optax: no shardax in the loop."""
    graphdef = parallel.graphdef

    def step(state, batch):
        def loss_of(params):
            return next_token_loss(nnx.merge(graphdef, params, state.rest), batch)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state), loss

    replicated = jax.sharding.NamedSharding(parallel.mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, in_shardings=(parallel.state_shardings, parallel.layout.batch()),
                   out_shardings=(parallel.state_shardings, replicated), donate_argnums=(0,))


def overhead(steps: int = 30) -> dict:
    """shardax's train step vs a minimal hand-written jit step, same model, mesh and shardings."""
    model = get_preset("tiny").config(seq_len=64)
    tx = optax.adamw(1e-3)
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), tx, mesh, "dp")
    tokens = np.random.default_rng(0).integers(0, 256, size=(32, 65)).astype(np.int32)
    batch = parallel.place_batch({"tokens": tokens})
    ours, theirs = parallel.train_step(next_token_loss), hand_written_step(parallel, tx)
    states = {"shardax": parallel.init(), "hand-written": parallel.init()}
    runners = {"shardax": ours, "hand-written": theirs}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(steps + 3):
        for name, run in runners.items():
            start = time.perf_counter()
            states[name], out = run(states[name], batch)
            jax.block_until_ready(out)
            if index >= 3:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return save("overhead", {"shardax_step_s": medians["shardax"], "hand_written_step_s": medians["hand-written"],
                             "ratio": medians["shardax"] / medians["hand-written"], "target": "<= 1.03"})


def memory_and_communication() -> dict:
    """Per strategy on 8 devices: compiled bytes and collectives against theory (tiny preset).

    Memory twice: the state the step takes as arguments (parameters, optimizer state, batch),
    and the whole peak (plus gradients, activations and temporaries) with and without remat.
    """
    preset = get_preset("tiny")
    rows = []
    for strategy, mesh in STRATEGY_MESHES:
        plan = plan_strategy(preset.config(), strategy, mesh, batch_size=preset.batch_size)
        rematted = plan_strategy(preset.config(remat="full"), strategy, mesh, batch_size=preset.batch_size)
        rows.append({"strategy": strategy, "mesh": plan.mesh,
                     "state_bytes_predicted": plan.predicted["state"], "state_bytes_compiled": plan.compiled["arguments"],
                     "memory_ratio": plan.compiled["arguments"] / plan.predicted["state"],
                     "peak_bytes_compiled": plan.compiled["peak"], "peak_bytes_predicted": plan.predicted["total"],
                     "peak_ratio": plan.compiled["peak"] / plan.predicted["total"],
                     "remat_full_peak_bytes_compiled": rematted.compiled["peak"],
                     "remat_full_peak_bytes_predicted": rematted.predicted["total"],
                     "remat_full_peak_ratio": rematted.compiled["peak"] / rematted.predicted["total"],
                     "collective_bytes": plan.collective_bytes, "theoretical_collective_bytes": plan.theoretical_collective_bytes,
                     "communication_ratio": plan.collective_bytes / plan.theoretical_collective_bytes,
                     "collectives": plan.collectives})
    return save("memory_and_communication", {"preset": "tiny", "batch_size": preset.batch_size, "strategies": rows,
                                             "targets": {"memory_ratio": "within 2%", "peak_ratio": "within 5%",
                                                         "communication_ratio": "<= 1.05"}})


def compile_time(depths: tuple[int, int] = (4, 32)) -> dict:
    """Compile time of the train step at two depths: scanned layers keep it flat."""
    seconds = {}
    for depth in depths:
        model = TransformerConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=depth, d_ff=512)
        plan = plan_strategy(model, "fsdp", "data=8", batch_size=32)
        seconds[depth] = plan.compile_s
    return save("compile_time", {"seconds": {str(k): v for k, v in seconds.items()},
                                 "ratio": seconds[depths[1]] / seconds[depths[0]], "target": "<= 1.5"})


def largest_model(budget_bytes: int = 2 * 10**9) -> dict:
    """The largest transformer whose compiled step fits ``budget_bytes`` per device, by strategy (remat full)."""
    candidates = [(d, layers) for d in (512, 768, 1024, 1536, 2048) for layers in (8, 16, 24)]
    candidates.sort(key=lambda c: parameter_count(TransformerConfig(d_model=c[0], n_layers=c[1], d_ff=4 * c[0],
                                                                    n_heads=c[0] // 64)))
    rows = []
    for strategy, mesh in STRATEGY_MESHES:
        best = None
        for d_model, layers in candidates:
            model = TransformerConfig(vocab_size=256, seq_len=512, d_model=d_model, n_heads=d_model // 64,
                                      n_layers=layers, d_ff=4 * d_model, remat="full", positions="rotary")
            plan = plan_strategy(model, strategy, mesh, batch_size=16)
            if plan.compiled["peak"] > budget_bytes:
                break
            best = {"d_model": d_model, "n_layers": layers, "parameters": parameter_count(model),
                    "peak_bytes": plan.compiled["peak"]}
        rows.append({"strategy": strategy, "mesh": mesh, "largest": best})
    return save("largest_model", {"budget_bytes_per_device": budget_bytes, "batch_size": 16, "seq_len": 512,
                                  "remat": "full", "strategies": rows})


def plan_accuracy() -> dict:
    """Predicted / compiled peak beyond the tiny preset: every other preset as it comes, then
    options. Each case is (name, preset, strategy and mesh pairs, the model overrides to try,
    batch size, microbatches)."""
    remat_none_and_full = [{}, {"remat": "full"}]
    fsdp_tp_4 = [("fsdp_tp", "data=2,model=4")]
    some = [("dp", "data=8"), ("fsdp", "data=8")]
    defaults = [(f"{name}, every strategy", name, STRATEGY_MESHES, [{}], get_preset(name).batch_size, 1)
                for name in ("notebook", "small", "medium", "large", "1b")]
    cases = [
        *defaults,
        ("medium, remat full, every strategy", "medium", STRATEGY_MESHES, [{"remat": "full"}], 16, 1),
        ("large, remat full, every strategy", "large", STRATEGY_MESHES, [{"remat": "full"}], 64, 1),
        ("fsdp_tp on data=2,model=4, remat none and full", "small", fsdp_tp_4, remat_none_and_full, 32, 1),
        ("fsdp_tp on data=2,model=4, remat none and full", "medium", fsdp_tp_4, remat_none_and_full, 32, 1),
        ("--grad-accum 4, remat none and full", "small", [("zero2", "data=8"), *some], remat_none_and_full, 64, 4),
        ("bfloat16, remat none and full", "small", [*some, ("tp", "data=4,model=2")],
         [{"compute_dtype": "bfloat16", **remat} for remat in remat_none_and_full], 64, 1),
    ]
    rows = []
    for name, preset, pairs, variants, batch, microbatches in cases:
        for overrides, (strategy, mesh) in ((o, p) for o in variants for p in pairs):
            plan = plan_strategy(get_preset(preset).config(**overrides), strategy, mesh, batch_size=batch,
                                 grad_accum=microbatches)
            rows.append({"case": name, "preset": preset, "strategy": strategy, "mesh": mesh, **overrides,
                         "batch_size": batch, "grad_accum": microbatches,
                         "peak_ratio": plan.predicted["total"] / plan.compiled["peak"]})
    summary = {}
    for row in rows:
        ratio = row["peak_ratio"]
        low, high = summary.get(row["case"], (ratio, ratio))
        summary[row["case"]] = (min(low, ratio), max(high, ratio))
    return save("plan_accuracy", {"cases": rows, "predicted_over_compiled_peak": summary})


BENCHMARKS = {"overhead": overhead, "memory_and_communication": memory_and_communication,
              "compile_time": compile_time, "largest_model": largest_model, "plan_accuracy": plan_accuracy}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(BENCHMARKS):
        print(json.dumps(BENCHMARKS[name](), indent=1)[:2000])
