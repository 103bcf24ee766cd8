"""How much of the analytic plan's miss on XLA:TPU is XLA:TPU's collective matmuls.

On 8 v5p chips XLA:TPU turns some matmuls whose result is reduce-scattered into collective
matmuls (windowed einsums: loops of partial matmuls and collective-permutes), and these can hold
far more HBM than the same step without them. This compiles ``plan_fit.py``'s XLA:TPU cases
(its training and held-out steps above its floor) under the strategies given, with collective
matmuls off (``shardax.analysis.plan.WHOLE_MATMULS``), takes their peak with them (XLA:TPU's
default) from ``plan_fit.py``'s cache, and reports per class of model how many steps the shipped
analytic plan predicts within 5% of each. Then each class's factors are fitted again (as
``plan_fit.py`` fits them) to the peaks without collective matmuls, on its fitting steps, and
scored on its held-out steps: steps of strategies not compiled here count with their default
peak (none of the 47 hsdp and fsdp_tp steps had costly collective matmuls; dp, zero1 and tp
reduce-scatter no matmul's result).

    python benchmarks/collective_matmuls.py                                         # zero2 and fsdp
    python benchmarks/collective_matmuls.py --strategies zero2,fsdp,hsdp,fsdp_tp    # (minutes each)

Needs ``pip install "shardax[tpu-plan]"`` and ``benchmarks/results/plan_fit_tpu_heap.json``.
Compiled peaks are kept in ``results/collective_matmuls.json``; a rerun compiles only what is
missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from shardax.cpu_devices import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(8)

sys.path.insert(0, str(Path(__file__).parent))
from plan_fit import TPU_FLOOR, case_key, fit, held_out_sets, model_of, ratio, with_terms  # noqa: E402
from suite import save  # noqa: E402

from shardax.analysis.memory import WORKING_SET_TERMS, working_set_factors  # noqa: E402
from shardax.analysis.plan import WHOLE_MATMULS, compile_step, compiled_memory, transformer_for  # noqa: E402
from shardax.analysis.targets import parse_target  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TARGET = "tpu-v5p-16"  # 8 chips, as plan_fit.py's XLA:TPU cases


def whole_peak(row: dict, target) -> int:
    """The heap-based peak per chip of ``row``'s step compiled without collective matmuls."""
    model = model_of(row["settings"])
    parallel = transformer_for(model, row["strategy"], row["mesh"], target=target)
    compiled = compile_step(parallel, row["batch_size"], model.seq_len, row["grad_accum"],
                            compiler_options=WHOLE_MATMULS)
    return compiled_memory(compiled)["hbm_peak"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="zero2,fsdp", help="comma-separated (default zero2,fsdp)")
    options = parser.parse_args()
    target = parse_target(TARGET)
    target.devices()  # libtpu starts here, with the flags that write the heap
    fitted = json.loads((RESULTS / "plan_fit_tpu_heap.json").read_text())
    done_path = RESULTS / "collective_matmuls.json"
    whole = json.loads(done_path.read_text()).get("whole_peaks", {}) if done_path.exists() else {}
    labels = {json.dumps(case, sort_keys=True): label for label, cases in held_out_sets(True).items()
              for case in cases}
    strategies = options.strategies.split(",")
    rows = []
    for part in ("training", "held_out"):
        for cached in fitted[part]:
            if cached["strategy"] not in strategies or cached["hbm_peak"] < TPU_FLOOR:
                continue
            key = case_key(cached)
            if key not in whole:
                whole[key] = whole_peak(cached, target)
                save("collective_matmuls", {"whole_peaks": whole})  # a stopped run resumes from here
            row = with_terms(cached, "tpu", target.chip.on_chip_bytes)
            factors = working_set_factors(row["class"], "tpu")
            rows.append({"set": "training" if part == "training" else labels.get(key, "held_out"),
                         "class": row["class"], "strategy": row["strategy"], "settings": row["settings"],
                         "batch_size": row["batch_size"], "peak": cached["hbm_peak"],
                         "whole_peak": whole[key],
                         "predicted_over_peak": ratio({**row, "peak": cached["hbm_peak"]}, factors),
                         "predicted_over_whole_peak": ratio({**row, "peak": whole[key]}, factors)})
            print(f"{row['class']:12} {row['strategy']:6} {row['batch_size']:4} {row['settings']}: "
                  f"{cached['hbm_peak'] / 1e6:.0f} MB, {whole[key] / 1e6:.0f} MB without collective matmuls; "
                  f"predicted {rows[-1]['predicted_over_peak']:.3f}x, "
                  f"{rows[-1]['predicted_over_whole_peak']:.3f}x",
                  flush=True)
    summary = summarize([row for row in rows if row["set"] != "training"])
    steps = {without: {part: [with_terms({**row, "peak": whole.get(case_key(row), row["hbm_peak"]) if without
                                          else row["hbm_peak"]}, "tpu", target.chip.on_chip_bytes)
                              for row in fitted[part] if row["hbm_peak"] >= TPU_FLOOR]
                       for part in ("training", "held_out")} for without in (False, True)}
    refits = {name: refit(steps, name) for name in WORKING_SET_TERMS}
    save("collective_matmuls", {"target": TARGET, "strategies": strategies, "whole_peaks": whole,
                                "rows": rows, "held_out_within_5_percent": summary,
                                "refit_without_collective_matmuls": refits})
    print(json.dumps({"held_out_within_5_percent": summary, "refit_without_collective_matmuls": refits},
                     indent=1))


def refit(steps: dict[bool, dict[str, list[dict]]], name: str) -> dict:
    """One class's factors fitted on its fitting steps to the peaks with collective matmuls and to
    those without (``steps[without]``, where compiled here), each scored on its held-out steps
    against the same peaks."""
    result = {}
    for label, without in (("with_collective_matmuls", False), ("without_collective_matmuls", True)):
        training = [row for row in steps[without]["training"] if row["class"] == name]
        held_out = [row for row in steps[without]["held_out"] if row["class"] == name]
        factors, worst = fit(training, WORKING_SET_TERMS[name])
        errors = [abs(ratio(row, factors) - 1) for row in held_out]
        result[label] = {"factors": factors, "training_worst": round(worst, 3), "held_out": len(held_out),
                         "held_out_within_5_percent": sum(error <= 0.05 for error in errors),
                         "held_out_worst": round(max(errors), 3)}
    return result


def summarize(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per class: steps, those with collective matmuls that cost 2% or more, and how many the
    plan predicts within 5% of the peak with them and of the peak without."""
    counts: dict[str, Counter] = {}
    for row in rows:
        count = counts.setdefault(row["class"], Counter())
        count["steps"] += 1
        count["costly_collective_matmuls"] += row["peak"] > 1.02 * row["whole_peak"]
        count["within_5_percent"] += abs(row["predicted_over_peak"] - 1) <= 0.05
        count["within_5_percent_without_collective_matmuls"] += (abs(row["predicted_over_whole_peak"] - 1)
                                                                 <= 0.05)
    return {name: dict(count) for name, count in counts.items()}


if __name__ == "__main__":
    main()
