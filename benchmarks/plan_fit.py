"""Fit ``shardax plan``'s working-set factors, then say how well they predict shapes never fitted.

The plan predicts a step's peak memory per device as the state (exact), the residuals autodiff
keeps (traced) and one layer's backward working set, taken to be linear in a few quantities
per class of model (``shardax.analysis.memory.WORKING_SET_TERMS``: scanned layers by remat
policy, and blocks in a Python loop). This script compiles the ``training_cases`` on 8 fake
CPU devices, fits each class's factors by minimax relative error (a linear program), and
reports the error of those factors on ``benchmarks/suite.py``'s ``HELD_OUT_SHAPES``, which were
fixed before any result was seen and are never fitted on. The factors go into
``memory.WORKING_SET`` by hand; ``suite.py plan_held_out`` then checks the shipped code end to
end on the held-out shapes.

    python benchmarks/plan_fit.py            # compile what is not in the cache (minutes), fit, report
    python benchmarks/plan_fit.py --fresh    # compile everything again (after a model change)
    python benchmarks/plan_fit.py --target tpu-v5p-16   # the same, compiled by XLA:TPU for 8 chips
    python benchmarks/plan_fit.py --target tpu-v5p-16 --heap   # fitted to XLA:TPU's heap-based peak

The figures are XLA:CPU's, or with ``--target`` XLA:TPU's (compared with the shipped factors,
``memory.WORKING_SET_TPU``; needs ``pip install "shardax[tpu-plan]"``): its training cases are fewer
(``tpu_training_cases``, chosen before any XLA:TPU fit), its held-out cases the same shapes and
``suite.HELD_OUT_TPU_SHAPES`` and ``HELD_OUT_TPU_SHAPES_2`` (sized above the floor, each fixed
before the refit it checked), and both keep to steps above ``TPU_FLOOR``. What a chip keeps in its
own memory is taken off as the shipped prediction takes it off (``memory.held_on_chip``), so the
held-out errors here are the shipped plan's. Cached cases get their terms from today's code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from shardax.cpu_devices import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from scipy.optimize import linprog  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from suite import (  # noqa: E402
    HELD_OUT_SHAPES,
    STRATEGY_MESHES,
    held_out_large_rows,
    held_out_tpu_cases,
    held_out_tpu_cases_2,
    save,
)

from shardax import DeviceMeshManager, parallelize  # noqa: E402
from shardax.analysis.memory import (  # noqa: E402
    WORKING_SET,
    WORKING_SET_TERMS,
    WORKING_SET_TPU,
    held_on_chip,
    predict_memory,
    working_set_class,
    working_set_factors,
    working_set_terms,
)
from shardax.analysis.plan import compile_step, compiled_memory, transformer_for  # noqa: E402
from shardax.analysis.targets import parse_target  # noqa: E402
from shardax.models.presets import PRESETS_0_1  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "plan_fit.json"
# the presets the fit was made on: shardax 0.1's (GELU MLPs); see PRESETS_0_1
PRESET_NAMES = ("tiny", "gpt-style", "small", "medium", "large", "1b")
# Presets whose model changed after the fit was made, as they were (the tiny preset's default run now
# trains on 64-token sequences; the fit and its held-out checks were made at 128).
AS_FITTED = {"tiny": {"seq_len": 128}}
SEQUENCES = [dict(d_model=256, n_heads=4, n_layers=4, d_ff=1024, seq_len=seq) for seq in (512, 1024)]
WIDE = dict(d_model=1024, n_heads=16, n_layers=4, d_ff=4096, seq_len=128)
WIDER = dict(d_model=2048, n_heads=16, n_layers=3, d_ff=8192, seq_len=256)
# XLA:TPU places part of a step's temporaries in the chip's own memory, not HBM (memory space 1
# of its buffer assignment: 46 MB for a 3-layer, 320-wide model's dp step on 8 v5p chips, whose
# memory analysis counts 54 MB of temporaries), and no model of HBM alone describes a step that
# small: the TPU fit and its errors keep to steps whose compiled peak is above this many bytes per
# chip (those below stay in the report's rows, neither fitted nor scored).
TPU_FLOOR = 300e6


def training_cases() -> list[tuple[dict, str, str, int, int]]:
    """(model settings, strategy, mesh, batch size, microbatches): presets and shapes of every
    class, and the shapes tests/test_plan.py checks."""
    every, some = STRATEGY_MESHES, [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2")]
    cases = [({"d_model": 512, "n_heads": 4, "n_layers": 2, "d_ff": 2048, "seq_len": 16, "vocab_size": 256,
               "positions": "learned"}, "hsdp", "replica=2,data=4", 16, 1),
             ({"d_model": 128, "n_heads": 4, "n_layers": 2, "d_ff": 512, "seq_len": 512, "vocab_size": 256,
               "positions": "learned", "remat": "dots_saveable"}, "fsdp", "data=8", 16, 1)]
    for name in ("tiny", "gpt-style", "small"):
        for remat in ("none", "full"):
            cases += [({"preset": name, "remat": remat, "scan_layers": False}, s, m,
                       PRESETS_0_1[name].batch_size, 1)
                      for s, m in every]
    for name in PRESET_NAMES:
        preset = PRESETS_0_1[name]
        for remat in ("none", "full", "dots_saveable"):
            pairs = every if name in ("tiny", "small", "medium") or remat == "none" else some
            cases += [({"preset": name, "remat": remat}, s, m, preset.batch_size, 1) for s, m in pairs]
    for shape in [*SEQUENCES, WIDE]:
        for remat in ("none", "full", "dots_saveable"):
            cases += [({**shape, "remat": remat}, s, m, 16, 1) for s, m in some]
    for remat in ("none", "full"):
        cases += [({"preset": name, "remat": remat}, "fsdp_tp", "data=2,model=4", 32, 1)
                  for name in ("small", "medium")]
        cases += [({"preset": "small", "remat": remat}, s, m, 64, 4)
                  for s, m in [("zero2", "data=8"), *some[:2]]]
        cases += [({"preset": "large", "remat": remat}, s, m, 16, 1) for s, m in every]
    # many rows per device (one device holding the whole batch, as on a single GPU)
    for name in ("tiny", "gpt-style", "small"):
        batch = PRESETS_0_1[name].batch_size
        for remat in ("none", "full", "dots_saveable"):
            cases += [({"preset": name, "remat": remat}, s, m, batch, 1)
                      for s, m in (("dp", "data=1"), ("fsdp", "data=2"))]
        cases += [({"preset": name, "remat": remat, "scan_layers": False}, "dp", "data=1", batch, 1)
                  for remat in ("none", "full")]
    for shape in [*SEQUENCES, WIDE]:
        cases += [({**shape, "remat": remat}, "dp", "data=1", 16, 1)
                  for remat in ("none", "full", "dots_saveable")]
    return cases


def tpu_training_cases() -> list[tuple[dict, str, str, int, int]]:
    """The cases fitted to XLA:TPU, fewer than XLA:CPU's (a shorter compile budget) and chosen
    before any XLA:TPU fit was made: blocks in a loop (tiny, small) and scanned layers (tiny,
    small) under every strategy, ``medium`` and the long and wide shapes under a few, one chip
    holding the whole batch, and gradient accumulation."""
    every, some = STRATEGY_MESHES, [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2")]
    policies = ("none", "full", "dots_saveable")
    cases = []
    for name in ("tiny", "small"):
        batch = PRESETS_0_1[name].batch_size
        cases += [({"preset": name, "remat": remat, "scan_layers": False}, s, m, batch, 1)
                  for remat in ("none", "full") for s, m in every]
        cases += [({"preset": name, "remat": remat}, s, m, batch, 1) for remat in policies for s, m in every]
        cases += [({"preset": name, "remat": remat}, "dp", "data=1", batch, 1) for remat in policies]
    cases += [({"preset": "medium", "remat": remat}, s, m, 64, 1) for remat in policies for s, m in some]
    cases += [({**shape, "remat": remat}, "fsdp", "data=8", 16, 1) for shape in [*SEQUENCES, WIDE]
              for remat in policies]
    cases += [({"preset": "small", "remat": remat}, "fsdp", "data=8", 64, 4) for remat in ("none", "full")]
    # Added with the floor (TPU_FLOOR), before the refit, so that every class has steps above it:
    # four times small's batch under every strategy and policy, blocks in a loop too, and the long
    # sequences at batch 64 under a few.
    cases += [({"preset": "small", "remat": remat}, s, m, 256, 1) for remat in policies for s, m in every]
    cases += [({"preset": "small", "remat": remat, "scan_layers": False}, s, m, 256, 1)
              for remat in ("none", "full") for s, m in every]
    cases += [({**shape, "remat": remat}, s, m, 64, 1) for shape in SEQUENCES for remat in ("none", "full")
              for s, m in some]
    # Added with the fit to XLA:TPU's heap, after benchmark 21's 1b (one row per chip, 2048 wide)
    # read 0.91-0.94 under fsdp and pp_fsdp: layers whose weights rival their activations, which
    # no case above had, at one and four rows per chip.
    cases += [({**WIDER, "remat": remat}, s, m, batch, 1) for remat in policies for s, m in some
              for batch in (8, 32)]
    return cases


def model_of(settings: dict) -> TransformerConfig:
    settings = dict(settings)
    if "preset" in settings:
        name = settings.pop("preset")
        return PRESETS_0_1[name].config(**{**AS_FITTED.get(name, {}), **settings})
    return TransformerConfig(**{"vocab_size": 256, "positions": "rotary", **settings})


def measure(settings: dict, strategy: str, mesh: str, batch: int, microbatches: int, target=None) -> dict:
    """One compiled case (for fake CPU devices or ``target``): its peak, the prediction without
    the working set, and the terms."""
    model = model_of(settings)
    parallel = transformer_for(model, strategy, mesh, target=target)
    memory = compiled_memory(compile_step(parallel, batch, model.seq_len, microbatches))
    peak = memory["peak"]
    print(f"{settings} {strategy} {mesh} batch {batch}/{microbatches}: {peak / 1e6:.1f} MB", flush=True)
    row = {"settings": settings, "strategy": strategy, "mesh": mesh, "batch_size": batch,
           "grad_accum": microbatches, "peak": peak}
    if "hbm_peak" in memory:  # XLA:TPU's heap-based peak (shardax.analysis.heap), kept for a fit to it
        row["hbm_peak"] = memory["hbm_peak"]
    return with_terms(row, *compiler_of(target))


def compiler_of(target=None) -> tuple[str, int]:
    """(the compiler, the bytes of temporaries each chip may keep in its own memory) of ``target``."""
    return ("cpu", 0) if target is None else (target.chip.platform, target.chip.on_chip_bytes)


def measured(cases: list[tuple], cache: dict[str, dict], target=None, keep: Path | None = None) -> list[dict]:
    """Each case measured, or taken from ``cache`` (keyed by the case) when it is there; with
    ``keep``, every case measured is written there at once (a stopped run resumes from it)."""
    rows = []
    for case in cases:
        key = json.dumps(case, sort_keys=True)  # the same form as case_key
        fresh = key not in cache
        rows.append(measure(*case, target=target) if fresh else with_terms(cache[key], *compiler_of(target)))
        cache[key] = rows[-1]
        if fresh and keep is not None:
            keep.write_text(json.dumps({"training": list(cache.values())}) + "\n")
    return rows


def with_terms(row: dict, compiler: str = "cpu", on_chip: int = 0) -> dict:
    """A case with its terms and the prediction without the working set (``base``: the state,
    gradients and kept residuals), worked out by today's code from its shapes (no compile); and
    what the prediction takes off for the temporaries the chip keeps in its own memory, as
    ``memory.held_on_chip`` does: up to ``on_chip`` bytes, a fifth of the temporaries (the
    gradients and kept residuals, ``temporaries``, and the working set)."""
    model = model_of(row["settings"])
    parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), optax.adamw(1e-3),
                           DeviceMeshManager().create_device_mesh(row["mesh"]), row["strategy"])
    prediction = predict_memory(parallel, model, row["batch_size"], model.seq_len, row["grad_accum"],
                                compiler=compiler)
    terms = working_set_terms(parallel.layout, model, row["batch_size"], row["grad_accum"], compiler)
    kept = terms.pop("kept")
    return {**row, "class": working_set_class(model, compiler),
            "base": prediction.total - prediction.activations + kept,
            "temporaries": prediction.gradients + kept, "on_chip": on_chip, "terms": terms}


def working_set(row: dict, factors: list[float], names: tuple[str, ...] | None = None) -> float:
    """``row``'s working set: ``factors`` times its terms (``names``; default: its class's)."""
    return sum(f * row["terms"][name] for f, name in zip(factors, names or WORKING_SET_TERMS[row["class"]]))


def held(row: dict, factors: list[float], names: tuple[str, ...] | None = None) -> int:
    """What of ``row``'s temporaries the chip keeps in its own memory with these factors."""
    return held_on_chip(row["on_chip"], int(row["temporaries"] + working_set(row, factors, names)))


def case_key(row: dict) -> str:
    return json.dumps((row["settings"], row["strategy"], row["mesh"], row["batch_size"], row["grad_accum"]),
                      sort_keys=True)


def fit(rows: list[dict], names: tuple[str, ...]) -> tuple[list[float], float]:
    """Non-negative factors of ``names`` minimising the largest |predicted / compiled - 1| over
    ``rows``; of the factors that reach it (there are often many), those with the least mean error.
    What the chip keeps in its own memory depends on the working set, so on the factors: the fit
    starts from the most it may keep and is made again with what each fit's factors say it keeps,
    until the factors settle."""
    factors, worst = None, 0.0
    for _ in range(8):
        on_chip = [row["on_chip"] if factors is None else held(row, factors, names) for row in rows]
        fitted, worst = _fit_linear(rows, names, on_chip)
        if fitted == factors:
            break
        factors = fitted
    return factors, worst


def _fit_linear(rows: list[dict], names: tuple[str, ...], on_chip: list[int]) -> tuple[list[float], float]:
    """``fit`` with what each row's chip keeps in its own memory given."""
    # variables: one factor per term, then one error bound e_i per row, then t:
    # +-(base + terms . factors - peak) <= e_i * peak, e_i <= t; first minimise t, then sum(e_i)
    terms = np.array([[row["terms"][name] for name in names] for row in rows], float)
    peak = np.array([row["peak"] for row in rows], float)
    base = np.array([row["base"] for row in rows], float) - np.array(on_chip, float)
    scaled, offset, count = terms / peak[:, None], base / peak - 1, len(rows)
    errors = -np.eye(count)
    upper = np.vstack([np.hstack([scaled, errors, np.zeros((count, 1))]),
                       np.hstack([-scaled, errors, np.zeros((count, 1))]),
                       np.hstack([np.zeros((count, len(names))), np.eye(count), -np.ones((count, 1))])])
    bound = np.concatenate([-offset, offset, np.zeros(count)])
    worst = np.zeros(len(names) + count + 1)
    worst[-1] = 1
    first = linprog(worst, A_ub=upper, b_ub=bound, bounds=[(0, None)] * len(worst), method="highs")
    assert first.success, first.message
    mean = np.concatenate([np.zeros(len(names)), np.ones(count), [0]])
    limit = [(0, None)] * (len(names) + count) + [(0, first.x[-1] * 1.0001 + 1e-9)]
    second = linprog(mean, A_ub=upper, b_ub=bound, bounds=limit, method="highs")
    assert second.success, second.message
    return [round(float(x), 3) for x in second.x[:len(names)]], float(second.x[-1])


def ratio(row: dict, factors: list[float], names: tuple[str, ...] | None = None) -> float:
    return (row["base"] - held(row, factors, names) + working_set(row, factors, names)) / row["peak"]


def held_out_sets(tpu: bool = False) -> dict[str, list[tuple[dict, str, str, int, int]]]:
    """The held-out cases by set: XLA:CPU's shapes, the same with many rows per device, and for a
    TPU target the shapes fixed for XLA:TPU's fit (``suite.HELD_OUT_TPU_SHAPES``)."""
    sets = {"held_out": [(dict(shape), s, m, batch, 1) for shape, batch in HELD_OUT_SHAPES
                         for s, m in STRATEGY_MESHES],
            "held_out_large_rows": [(dict(shape), s, m, batch, 1)
                                    for shape, s, m, batch in held_out_large_rows()]}
    if tpu:
        sets["held_out_tpu"] = [(shape, s, m, batch, 1) for shape, s, m, batch in held_out_tpu_cases()]
        sets["held_out_tpu_2"] = [(shape, s, m, batch, 1) for shape, s, m, batch in held_out_tpu_cases_2()]
    return sets


def held_out_cases(tpu: bool = False) -> list[tuple[dict, str, str, int, int]]:
    return [case for cases in held_out_sets(tpu).values() for case in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true",
                        help="compile every case again (after a model change)")
    parser.add_argument("--no-held-out", action="store_true",
                        help="fit only; do not compile the held-out shapes")
    parser.add_argument("--target", help="compile for this TPU slice (8 chips, e.g. tpu-v5p-16) instead")
    parser.add_argument("--heap", action="store_true", help="with --target: fit to XLA:TPU's heap-based peak "
                        "(shardax.analysis.heap), compiling the cached cases that lack it")
    options = parser.parse_args()
    if options.heap and not options.target:
        parser.error("--heap needs --target: only XLA:TPU's compiles have a heap")
    target = parse_target(options.target) if options.target else None
    if target is not None:  # libtpu starts here, with the flags that write the heap (shardax.analysis.heap),
        target.devices()    # before anything else starts JAX's backends, libtpu among them, without them
    report_name = ("plan_fit" if target is None
                   else f"plan_fit_{target.chip.platform}" + ("_heap" if options.heap else ""))
    results = RESULTS.parent / f"{report_name}.json"
    saved = {} if options.fresh or not results.exists() else json.loads(results.read_text())
    cache = {case_key(row): row for row in saved.get("training", []) + saved.get("held_out", [])}
    partial = results.with_suffix(".partial.json")  # what a stopped run measured
    if partial.exists() and not options.fresh:
        cache |= {case_key(row): row for row in json.loads(partial.read_text())["training"]}
    if options.heap:
        cache = {key: row for key, row in cache.items() if "hbm_peak" in row}
    training = measured(training_cases() if target is None else tpu_training_cases(), cache, target, partial)
    held_out = ([] if options.no_held_out
                else measured(held_out_cases(target is not None), cache, target, partial))
    report = {"target": options.target, "training": training, "held_out": held_out, "factors": {},
              "errors": {}}
    if options.heap:  # fitted to the heap-based peak; the report keeps both
        training, held_out = ([{**row, "peak": row["hbm_peak"]} for row in rows]
                              for rows in (training, held_out))
    if target is not None:  # fitted and tested where HBM holds the temporaries
        report["floor"] = TPU_FLOOR
        training = [row for row in training if row["peak"] >= TPU_FLOOR]
        held_out = [row for row in held_out if row["peak"] >= TPU_FLOOR]
    compiler = "cpu" if target is None else target.chip.platform
    shipped_factors = {name: working_set_factors(name, compiler)
                       for name in (WORKING_SET_TPU if target else WORKING_SET)}
    for name in ("none", "full", "dots", "looped") + (("looped_remat",) if target is not None else ()):
        rows = [row for row in training if row["class"] == name]
        factors, worst = fit(rows, WORKING_SET_TERMS[name])
        report["factors"][name] = factors
        report["errors"][name] = {"training_cases": len(rows), "training_worst": worst,
                                  "shipped_factors": list(shipped_factors[name])}
        sets = held_out_sets(target is not None)
        for label, cases in sets.items():
            keys = {json.dumps(case, sort_keys=True) for case in cases}
            tested = [row for row in held_out if row["class"] == name and case_key(row) in keys]
            errors = [abs(ratio(row, factors) - 1) for row in tested]
            shipped = [abs(ratio(row, shipped_factors[name]) - 1) for row in tested]
            report["errors"][name] |= {
                f"{label}_cases": len(tested), f"{label}_worst": max(errors, default=None),
                f"{label}_median": statistics.median(errors) if errors else None,
                f"{label}_worst_with_shipped": max(shipped, default=None),
                f"{label}_median_with_shipped": statistics.median(shipped) if shipped else None}
        print(f"{name}: factors {factors}; training worst {worst:.3f} over {len(rows)}; "
              + "; ".join(f"{label} worst {report['errors'][name][label + '_worst']} (shipped "
                          f"{report['errors'][name][label + '_worst_with_shipped']}) over "
                          f"{report['errors'][name][label + '_cases']}" for label in sets),
              flush=True)
    save(report_name, report)
    partial.unlink(missing_ok=True)
    print(("WORKING_SET = " if target is None else "factors fitted to XLA:TPU: ")
          + json.dumps({k: tuple(v) for k, v in report["factors"].items()}))


if __name__ == "__main__":
    main()
