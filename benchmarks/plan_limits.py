"""How close any factors of the plan's terms can come to XLA:TPU's peaks: the model's own floor.

``plan_fit.py`` fits each class's working-set factors on its fitting steps and scores them on
held-out steps. Where the held-out errors stay large (full remat, blocks in a loop) two causes
are possible: fitting steps that do not span the held-out ones, or terms that cannot describe
what XLA:TPU does at all. This tells them apart: each class's factors are fitted to *every* step
of the class at once (fitting and held-out together, so nothing is held out: an in-sample
bound, the best these terms can do), and again with one more factor per strategy on the class's
activation term (``layer``, or ``residuals`` for blocks in a loop), the most a per-strategy
table could buy. Both against XLA:TPU's default peaks and against the peaks without collective
matmuls (``collective_matmuls.py``, for the strategies it compiled). No compile: it reads
``results/plan_fit_tpu_heap.json`` and ``results/collective_matmuls.json``, and the terms come
from today's code.

    python benchmarks/plan_limits.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardax.cpu_devices import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(8)

sys.path.insert(0, str(Path(__file__).parent))
from plan_fit import TPU_FLOOR, case_key, fit, ratio, with_terms  # noqa: E402
from suite import save  # noqa: E402

from shardax.analysis.memory import WORKING_SET_TERMS, working_set_factors  # noqa: E402
from shardax.analysis.targets import CHIPS  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "hsdp")


def per_strategy(row: dict) -> dict:
    """``row`` with one more term per strategy: its activation term where the step runs that strategy."""
    main = row["terms"]["layer" if "layer" in row["terms"] else "residuals"]
    return {**row, "terms": row["terms"] | {s: main if row["strategy"] == s else 0 for s in STRATEGIES}}


def bound(rows: list[dict], names: tuple[str, ...]) -> dict:
    """Factors fitted to all ``rows`` at once, and how many of them they then predict within 5%."""
    factors, worst = fit(rows, names)
    errors = [abs(ratio(row, factors, names) - 1) for row in rows]
    return {"factors": factors, "worst": round(worst, 3), "within_5_percent": sum(e <= 0.05 for e in errors)}


def limits(rows: list[dict], name: str) -> dict:
    steps = [row for row in rows if row["class"] == name]
    shipped = [abs(ratio(row, working_set_factors(name, "tpu")) - 1) for row in steps]
    names = WORKING_SET_TERMS[name]
    return {"steps": len(steps),
            "shipped": {"worst": round(max(shipped), 3), "within_5_percent": sum(e <= 0.05 for e in shipped)},
            "all_steps_at_once": bound(steps, names),
            "with_a_factor_per_strategy": bound([per_strategy(row) for row in steps], names + STRATEGIES)}


def main() -> None:
    fitted = json.loads((RESULTS / "plan_fit_tpu_heap.json").read_text())
    whole = json.loads((RESULTS / "collective_matmuls.json").read_text())["whole_peaks"]
    on_chip = CHIPS["v5p"].on_chip_bytes  # plan_fit.py's XLA:TPU steps are compiled for a v5p-16
    cached = [row for part in ("training", "held_out") for row in fitted[part]
              if row["hbm_peak"] >= TPU_FLOOR]
    rows = [with_terms(row, "tpu", on_chip) for row in cached]
    report = {"target": fitted["target"], "floor": TPU_FLOOR, "classes": {}}
    for name in WORKING_SET_TERMS:
        report["classes"][name] = {
            "default_peaks": limits([{**row, "peak": row["hbm_peak"]} for row in rows], name),
            "peaks_without_collective_matmuls": limits(
                [{**row, "peak": whole.get(case_key(row), row["hbm_peak"])} for row in rows], name)}
        for label, result in report["classes"][name].items():
            print(f"{name:12} {label:32} {result['steps']:3} steps: shipped "
                  f"{result['shipped']['within_5_percent']} within 5% (worst {result['shipped']['worst']}); "
                  f"fitted to all at once: worst {result['all_steps_at_once']['worst']}, "
                  f"{result['all_steps_at_once']['within_5_percent']} within 5%; a factor per strategy too: "
                  f"worst {result['with_a_factor_per_strategy']['worst']}, "
                  f"{result['with_a_factor_per_strategy']['within_5_percent']} within 5%", flush=True)
    save("plan_limits", report)


if __name__ == "__main__":
    main()
