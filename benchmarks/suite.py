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

from shardax.cpu_devices import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
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
    return (f"{platform.machine()} CPU, {jax.device_count()} simulated {jax.devices()[0].platform} devices, "
            f"jax {jax.__version__}")


def save(name: str, result: dict) -> dict:
    RESULTS.mkdir(exist_ok=True)
    result = {"benchmark": name, "machine": machine(), **result}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def hand_written_step(parallel, tx):
    """The same step written directly with jax.jit and optax, no shardax in the loop: loss and
    gradients, the gradient norm, and the update applied only when both are finite (what
    shardax's step computes too, so the two are the same work)."""
    graphdef = parallel.graphdef

    def step(state, batch):
        def loss_of(params):
            return next_token_loss(nnx.merge(graphdef, params, state.rest), batch)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        grad_norm = optax.tree.norm(grads)

        def update(params, opt_state):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.lax.cond(finite, update, lambda *kept: kept, state.params, state.opt_state)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), (loss, grad_norm)

    replicated = jax.sharding.NamedSharding(parallel.mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, in_shardings=(parallel.state_shardings, parallel.layout.batch()),
                   out_shardings=(parallel.state_shardings, replicated), donate_argnums=(0,))


def overhead(steps: int = 60) -> dict:
    """shardax's train step vs the same step hand-written with jit and optax: same model, mesh,
    shardings and work. The two alternate step by step (which goes first alternating too); the
    figure is the median of the paired ratios."""
    model = get_preset("tiny").config(seq_len=64)
    tx = optax.adamw(1e-3)
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), tx, mesh, "dp")
    tokens = np.random.default_rng(0).integers(0, 256, size=(32, 65)).astype(np.int32)
    batch = parallel.place_batch({"tokens": tokens})
    states = {"shardax": parallel.init(), "hand-written": parallel.init()}
    runners = {"shardax": parallel.train_step(next_token_loss),
               "hand-written": hand_written_step(parallel, tx)}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(steps + 3):
        for name in (list(runners) if index % 2 == 0 else list(runners)[::-1]):
            start = time.perf_counter()
            states[name], out = runners[name](states[name], batch)
            jax.block_until_ready(out)
            if index >= 3:
                times[name].append(time.perf_counter() - start)
    ratios = [ours / theirs for ours, theirs in zip(times["shardax"], times["hand-written"])]
    quartiles = statistics.quantiles(ratios, n=4)
    return save("overhead", {"shardax_step_s": statistics.median(times["shardax"]),
                             "hand_written_step_s": statistics.median(times["hand-written"]),
                             "ratio": statistics.median(ratios),
                             "ratio_quartiles": [quartiles[0], quartiles[2]],
                             "steps": steps, "target": "<= 1.03"})


def memory_and_communication() -> dict:
    """Per strategy on 8 devices: compiled bytes and collectives against theory (tiny preset).

    Memory twice: the state the step takes as arguments (parameters, optimizer state, batch),
    and the whole peak (plus gradients, activations and temporaries) with and without remat.
    """
    preset = get_preset("tiny")  # at 128-token sequences, as these rows were first measured
    rows = []
    for strategy, mesh in STRATEGY_MESHES:
        plan = plan_strategy(preset.config(seq_len=128), strategy, mesh, batch_size=preset.batch_size)
        rematted = plan_strategy(preset.config(remat="full", seq_len=128), strategy, mesh,
                                 batch_size=preset.batch_size)
        rows.append({"strategy": strategy, "mesh": plan.mesh,
                     "state_bytes_predicted": plan.predicted["state"],
                     "state_bytes_compiled": plan.compiled["arguments"],
                     "memory_ratio": plan.compiled["arguments"] / plan.predicted["state"],
                     "peak_bytes_compiled": plan.compiled["peak"],
                     "peak_bytes_predicted": plan.predicted["total"],
                     "peak_ratio": plan.compiled["peak"] / plan.predicted["total"],
                     "remat_full_peak_bytes_compiled": rematted.compiled["peak"],
                     "remat_full_peak_bytes_predicted": rematted.predicted["total"],
                     "remat_full_peak_ratio": rematted.compiled["peak"] / rematted.predicted["total"],
                     "collective_bytes": plan.collective_bytes,
                     "theoretical_collective_bytes": plan.theoretical_collective_bytes,
                     "communication_ratio": plan.collective_bytes / plan.theoretical_collective_bytes,
                     "collectives": plan.collectives})
    return save("memory_and_communication", {"preset": "tiny", "batch_size": preset.batch_size,
                                             "strategies": rows,
                                             "targets": {"memory_ratio": "within 2%",
                                                         "peak_ratio": "within 5%",
                                                         "communication_ratio": "<= 1.05"}})


def compile_time(depths: tuple[int, int] = (4, 32), rounds: int = 5) -> dict:
    """Compile time of the train step at two depths: scanned layers keep it flat.

    One compile of another shape first warms up the process (XLA's first compile in a process
    also pays for setting itself up); then ``rounds`` rounds each compile both depths afresh
    (new functions, no cache), alternating which goes first. The figure is the median of the
    paired ratios, with each depth's median seconds."""

    def seconds_for(depth: int) -> float:
        model = TransformerConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=depth,
                                  d_ff=512)
        return plan_strategy(model, "fsdp", "data=8", batch_size=32).compile_s

    seconds_for(2)
    times: dict[int, list[float]] = {depth: [] for depth in depths}
    ratios = []
    for round_ in range(rounds):
        for depth in (depths if round_ % 2 == 0 else depths[::-1]):
            times[depth].append(seconds_for(depth))
        ratios.append(times[depths[1]][-1] / times[depths[0]][-1])
    return save("compile_time", {"seconds": {str(k): statistics.median(v) for k, v in times.items()},
                                 "all_seconds": {str(k): v for k, v in times.items()}, "rounds": rounds,
                                 "ratio": statistics.median(ratios), "ratios": ratios, "target": "<= 1.5"})


PIPELINE_MESHES = [("pp", "stage=8"), ("pp", "stage=4,data=2"), ("pp_fsdp", "stage=2,data=4")]


def largest_model(budget_bytes: int = 2 * 10**9, only: list[str] | None = None) -> dict:
    """The largest transformer whose compiled step fits ``budget_bytes`` per device, by strategy
    (remat full; pipelines with one sequence per microbatch). ``only``: strategies to (re)measure, keeping
    the saved rows of the others."""
    candidates = [(d, layers) for d in (512, 768, 1024, 1536, 2048) for layers in (8, 16, 24)]
    candidates.sort(key=lambda c: parameter_count(TransformerConfig(d_model=c[0], n_layers=c[1],
                                                                    d_ff=4 * c[0], n_heads=c[0] // 64)))
    saved = {} if not (RESULTS / "largest_model.json").exists() else {
        (row["strategy"], row["mesh"]): row
        for row in json.loads((RESULTS / "largest_model.json").read_text())["strategies"]}
    rows = []
    for strategy, mesh in STRATEGY_MESHES + PIPELINE_MESHES:
        if only is not None and strategy not in only and (strategy, mesh) in saved:
            rows.append(saved[(strategy, mesh)])
            continue
        best = None
        groups = DeviceMeshManager().create_device_mesh(mesh).shape.get("data", 1)
        schedule = {"microbatches": 16 // groups} if strategy.startswith("pp") else {}  # one row each
        for d_model, layers in candidates:
            model = TransformerConfig(vocab_size=256, seq_len=512, d_model=d_model, n_heads=d_model // 64,
                                      n_layers=layers, d_ff=4 * d_model, remat="full", positions="rotary")
            plan = plan_strategy(model, strategy, mesh, batch_size=16, **schedule)
            if plan.compiled["peak"] > budget_bytes:
                break
            best = {"d_model": d_model, "n_layers": layers, "parameters": parameter_count(model),
                    "peak_bytes": plan.compiled["peak"]}
        rows.append({"strategy": strategy, "mesh": mesh, "largest": best, **schedule})
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
                for name in ("gpt-style", "small", "medium", "large", "1b")]
    cases = [
        *defaults,
        ("medium, remat full, every strategy", "medium", STRATEGY_MESHES, [{"remat": "full"}], 16, 1),
        ("large, remat full, every strategy", "large", STRATEGY_MESHES, [{"remat": "full"}], 64, 1),
        ("fsdp_tp on data=2,model=4, remat none and full", "small", fsdp_tp_4, remat_none_and_full, 32, 1),
        ("fsdp_tp on data=2,model=4, remat none and full", "medium", fsdp_tp_4, remat_none_and_full, 32, 1),
        ("--grad-accum 4, remat none and full", "small", [("zero2", "data=8"), *some], remat_none_and_full,
         64, 4),
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


# Shapes the plan's constants were never fitted on, fixed here before their results were seen:
# other widths, head counts (odd ones too), sequence lengths, batch sizes, depths, MLP ratios,
# vocabularies, untied heads, learned positions, remat policies and blocks in a loop.
HELD_OUT_SHAPES = [
    (dict(d_model=320, n_heads=5, n_layers=3, d_ff=1280, seq_len=96), 24),
    (dict(d_model=448, n_heads=7, n_layers=5, d_ff=1344, seq_len=192, positions="learned",
          tie_embeddings=False), 16),
    (dict(d_model=640, n_heads=10, n_layers=4, d_ff=1600, seq_len=384, vocab_size=4096), 8),
    (dict(d_model=256, n_heads=2, n_layers=9, d_ff=768, seq_len=256), 40),
    (dict(d_model=576, n_heads=9, n_layers=6, d_ff=2304, seq_len=160, remat="full"), 32),
    (dict(d_model=384, n_heads=12, n_layers=7, d_ff=1536, seq_len=320, remat="dots_saveable"), 16),
    (dict(d_model=192, n_heads=3, n_layers=12, d_ff=960, seq_len=512, vocab_size=1024), 8),
    (dict(d_model=704, n_heads=11, n_layers=2, d_ff=2816, seq_len=128, scan_layers=False), 48),
]


# The same shapes with many rows per device (one device holding the whole batch, as on a single
# GPU), fixed before the refit that added such cases to the training set: dp on one device, fsdp
# on two, tp on data=2,model=4 with twice the batch.
def held_out_large_rows() -> list[tuple[dict, str, str, int]]:
    return [case for shape, batch in HELD_OUT_SHAPES for case in (
        (shape, "dp", "data=1", batch), (shape, "fsdp", "data=2", batch),
        (shape, "tp", "data=2,model=4", 2 * batch))]


# Held-out shapes for XLA:TPU's working-set fit, fixed (2026-11-26) before the change to its model
# that they then checked, and never fitted on: each under every strategy and remat policy, the
# first two with blocks in a loop too (remat none and full), at batches where the shipped plan put
# most of the steps above plan_fit.py's TPU floor of 300 MB per chip (those below it are not scored).
HELD_OUT_TPU_SHAPES = [
    (dict(d_model=512, n_heads=8, n_layers=5, d_ff=1536, seq_len=256, vocab_size=2048), 192, True),
    (dict(d_model=896, n_heads=7, n_layers=3, d_ff=3584, seq_len=192, vocab_size=4096), 128, True),
    (dict(d_model=320, n_heads=5, n_layers=8, d_ff=1152, seq_len=640), 64, False),
]


def held_out_tpu_cases() -> list[tuple[dict, str, str, int]]:
    layouts = [(remat, {}) for remat in ("none", "full", "dots_saveable")]
    looped = [(remat, {"scan_layers": False}) for remat in ("none", "full")]
    return [({**shape, "remat": remat, **layout}, strategy, mesh, batch)
            for shape, batch, loops in HELD_OUT_TPU_SHAPES
            for remat, layout in layouts + (looped if loops else [])
            for strategy, mesh in STRATEGY_MESHES]


# A second held-out set for XLA:TPU, fixed (2026-11-26, 20:32) after HELD_OUT_TPU_SHAPES had been
# read and before the on-chip memory term it then checked was fitted (docs/plan.md): two shapes
# under five strategies and the three remat policies, and the first with blocks in a loop under dp
# and fsdp.
HELD_OUT_TPU_SHAPES_2 = [
    (dict(d_model=768, n_heads=6, n_layers=4, d_ff=2048, seq_len=320, vocab_size=3072), 96),
    (dict(d_model=416, n_heads=13, n_layers=6, d_ff=1664, seq_len=448), 64),
]


def held_out_tpu_cases_2() -> list[tuple[dict, str, str, int]]:
    strategies = [("dp", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2"),
                  ("hsdp", "replica=2,data=4")]
    (first, batch), _ = HELD_OUT_TPU_SHAPES_2
    return [({**shape, "remat": remat}, strategy, mesh, batch) for shape, batch in HELD_OUT_TPU_SHAPES_2
            for remat in ("none", "full", "dots_saveable") for strategy, mesh in strategies] + [
        ({**first, "remat": "none", "scan_layers": False}, strategy, mesh, batch)
        for strategy, mesh in [("dp", "data=8"), ("fsdp", "data=8")]]


def plan_held_out() -> dict:
    """The plan's predicted / compiled peak (XLA:CPU) on ``HELD_OUT_SHAPES`` under every strategy,
    and on ``held_out_large_rows``: how well it predicts shapes it was not fitted on."""
    rows = []
    cases = [(overrides, strategy, mesh, batch) for overrides, batch in HELD_OUT_SHAPES
             for strategy, mesh in STRATEGY_MESHES]
    for (overrides, strategy, mesh, batch), large in [(case, False) for case in cases] + [
            (case, True) for case in held_out_large_rows()]:
        model = TransformerConfig(**{"vocab_size": 256, "positions": "rotary", **overrides})
        plan = plan_strategy(model, strategy, mesh, batch_size=batch)
        rows.append({**overrides, "batch_size": batch, "strategy": strategy, "mesh": mesh,
                     "large_rows": large,
                     "predicted_peak": plan.predicted["total"], "compiled_peak": plan.compiled["peak"],
                     "peak_ratio": plan.predicted["total"] / plan.compiled["peak"]})
        print(f"{overrides} batch {batch} {strategy} {mesh}: {rows[-1]['peak_ratio']:.3f}", flush=True)
    errors = sorted(abs(row["peak_ratio"] - 1) for row in rows)
    return save("plan_held_out", {
        "cases": rows, "ratio_range": [min(r["peak_ratio"] for r in rows),
                                       max(r["peak_ratio"] for r in rows)],
        "median_abs_error": statistics.median(errors),
        "within_5_percent": sum(e <= 0.05 for e in errors) / len(errors),
        "within_10_percent": sum(e <= 0.10 for e in errors) / len(errors)})


# Pipeline steps the plan's pipeline term was never worked out on, fixed here before their results
# were seen: (model overrides, strategy, mesh, batch, microbatches, repeats). Run on XLA:CPU's 8
# devices and, with the tpu-plan extra, on XLA:TPU's 8 chips of a v5p-16.
PIPELINE_HELD_OUT = [
    (dict(d_model=256, n_heads=4, n_layers=8, d_ff=1024, seq_len=128), "pp", "stage=2,data=4", 32, 4, 1),
    (dict(d_model=256, n_heads=4, n_layers=8, d_ff=1024, seq_len=128), "pp_fsdp", "stage=4,data=2", 32, 4, 1),
    (dict(d_model=384, n_heads=6, n_layers=6, d_ff=1536, seq_len=256), "pp_tp", "stage=2,data=2,model=2", 16,
     2, 1),
    (dict(d_model=512, n_heads=8, n_layers=8, d_ff=2048, seq_len=128), "pp", "stage=2,data=4", 32, 8, 1),
    (dict(d_model=320, n_heads=5, n_layers=4, d_ff=1280, seq_len=96), "pp_fsdp", "stage=2,data=4", 24, 3, 1),
    (dict(d_model=256, n_heads=4, n_layers=8, d_ff=1024, seq_len=128), "pp", "stage=4,data=2", 32, 4, 2),
    (dict(d_model=640, n_heads=10, n_layers=4, d_ff=2560, seq_len=256), "pp", "stage=2,data=4", 16, 2, 1),
    (dict(d_model=256, n_heads=4, n_layers=12, d_ff=1024, seq_len=64, remat="full"), "pp_fsdp",
     "stage=2,data=4", 64, 4, 1),
]


def pipeline_held_out(target_name: str | None = None) -> dict:
    """The plan's predicted / compiled peak of pipeline steps on ``PIPELINE_HELD_OUT``, on
    XLA:CPU or (``target_name``) XLA:TPU."""
    from shardax.analysis.targets import parse_target

    target = parse_target(target_name) if target_name else None
    rows = []
    for overrides, strategy, mesh, batch, microbatches, repeats in PIPELINE_HELD_OUT:
        model = TransformerConfig(**{"vocab_size": 256, "positions": "rotary", **overrides})
        plan = plan_strategy(model, strategy, mesh, batch_size=batch, microbatches=microbatches,
                             pipeline_repeats=repeats, target=target)
        rows.append({**overrides, "strategy": strategy, "mesh": mesh, "batch_size": batch,
                     "microbatches": microbatches, "repeats": repeats,
                     "predicted_peak": plan.predicted["total"],
                     "compiled_peak": plan.compiled_bytes_per_device, "estimated_peak": plan.compiled["peak"],
                     "peak_ratio": plan.predicted["total"] / plan.compiled_bytes_per_device})
        print(f"{overrides} {strategy} {mesh} M{microbatches} R{repeats}: {rows[-1]['peak_ratio']:.3f}",
              flush=True)
    name = "pipeline_held_out" + (f"_{target_name}" if target_name else "")
    return save(name.replace("-", "_"), {"target": target_name or "XLA:CPU, 8 devices", "cases": rows,
                                         "ratio_range": [min(r["peak_ratio"] for r in rows),
                                                         max(r["peak_ratio"] for r in rows)]})


def pipeline_bubble() -> dict:
    """The bubble of the pipeline as compiled: stage iterations of the compiled loops (XLA's trip
    counts) against the R*M that do work, for M = S, 2S, 4S on stage=4,data=2 (and a circular
    schedule), beside the formula (S-1)/(R*M+S-1)."""
    import re

    model = TransformerConfig(vocab_size=256, seq_len=128, d_model=256, n_heads=4, n_layers=8, d_ff=1024)
    rows = []
    for microbatches, repeats in [(4, 1), (8, 1), (16, 1), (8, 2)]:
        mesh = DeviceMeshManager().create_device_mesh("stage=4,data=2")
        parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), optax.adamw(1e-3), mesh, "pp")
        from shardax.analysis.plan import compile_step

        compiled = compile_step(parallel, 32, model.seq_len, microbatches=microbatches,
                                pipeline_repeats=repeats)
        trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', compiled.as_text())]
        iterations = max(trips)
        rows.append({"stages": 4, "microbatches": microbatches, "repeats": repeats,
                     "compiled_iterations": iterations,
                     "bubble_compiled": 1 - repeats * microbatches / iterations,
                     "bubble_formula": 3 / (repeats * microbatches + 3)})
        print(rows[-1], flush=True)
    return save("pipeline_bubble", {"mesh": "stage=4,data=2", "cases": rows})


def longest_sequence(budget_bytes: int = 2 * 10**9) -> dict:
    """The longest sequence whose compiled step fits ``budget_bytes`` per device, for the small
    preset (one sequence per step, remat none): one device (C=1), and the sequence split over a
    ``context`` axis of 8 with each attention variant. Sequence lengths are multiples of 256,
    found by doubling from 1024 and then bisection. Besides: each variant's communication per step,
    compiled against theory, at 8192 tokens."""
    from shardax.analysis.collectives import find_collectives
    from shardax.analysis.plan import compile_step, compiled_memory
    from shardax.analysis.theory import theoretical_collective_bytes
    from shardax.analysis.traffic import wire_bytes
    from shardax.models.presets import get_preset

    def parallel_for(length, shards):
        model = get_preset("small").config(seq_len=length)
        shape = "data=1" if shards == 1 else f"data=1,context={shards}"
        mesh = DeviceMeshManager(devices=jax.devices()[:shards]).create_device_mesh(shape)
        return model, parallelize(lambda rngs: TransformerLM(model, rngs=rngs), optax.adamw(1e-3), mesh, "dp")

    def peak(length, shards, variant):
        _, parallel = parallel_for(length, shards)
        options = {} if shards == 1 else {"context_attention": variant}
        peak_bytes = compiled_memory(compile_step(parallel, 1, length, **options))["peak"]
        print(f"  C={shards} {variant} T={length}: {peak_bytes / 1e9:.2f} GB", flush=True)
        return peak_bytes

    def longest(shards, variant):
        fits, length = 0, 1024
        while peak(length, shards, variant) <= budget_bytes:
            fits, length = length, length * 2
        low, high = fits, length  # low fits (or 0), high does not
        while high - low > 256:
            middle = (low + high) // 2 // 256 * 256
            if peak(middle, shards, variant) <= budget_bytes:
                low = middle
            else:
                high = middle
        return low

    rows = [{"context": 1, "attention": "xla (one device)", "longest_tokens": longest(1, "all-gather")}]
    for variant in ("all-gather", "ring"):
        rows.append({"context": 8, "attention": variant, "longest_tokens": longest(8, variant)})
    for row in rows[1:]:
        row["ratio_to_one_device"] = row["longest_tokens"] / rows[0]["longest_tokens"]
    communication = []
    for variant in ("all-gather", "ring"):
        model, parallel = parallel_for(8192, 8)
        collectives = find_collectives(compile_step(parallel, 1, 8192, context_attention=variant).as_text())
        sent = sum(wire_bytes(c, 8) * c.executions for c in collectives)
        theory = theoretical_collective_bytes(parallel.layout, model, 1, None, variant)
        communication.append({"attention": variant, "seq_len": 8192, "compiled_bytes": sent,
                              "theory_bytes": theory, "compiled_over_theory": sent / theory})
    return save("longest_sequence", {"preset": "small", "budget_bytes_per_device": budget_bytes,
                                     "batch_size": 1, "rows": rows, "communication": communication})


BENCHMARKS = {"overhead": overhead, "memory_and_communication": memory_and_communication,
              "compile_time": compile_time, "largest_model": largest_model, "plan_accuracy": plan_accuracy,
              "plan_held_out": plan_held_out, "pipeline_held_out": pipeline_held_out,
              "pipeline_held_out_tpu": lambda: pipeline_held_out("tpu-v5p-16"),
              "pipeline_bubble": pipeline_bubble, "longest_sequence": longest_sequence}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(BENCHMARKS):
        print(json.dumps(BENCHMARKS[name](), indent=1)[:2000])
