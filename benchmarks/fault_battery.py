"""The fault battery: ``shardax train``, ``prepare`` and ``launch`` as a user runs them, with
faults injected, each case checked for what a careful user expects.

    python benchmarks/fault_battery.py            # every case (about 15 minutes on 2 cores)
    python benchmarks/fault_battery.py kill       # the cases whose name holds "kill"

Every case says: passed or not, how many committed checkpoints it lost (a committed, sealed
step that is gone or changed, other than one the case damaged on purpose, which must be kept
as ``<step>.damaged``), and what went wrong. What "passed" means:
- a fault the run can recover from: the resume succeeds and the final parameters are bit
  for bit those of an uninterrupted run of the same length;
- a fault that ends the command: a non-zero exit, one line on stderr naming the problem, no
  traceback, and nothing already saved changed.
The cases live in ``benchmarks/faults/``, one module per kind of fault (``interrupted``,
``damaged``, ``data``, ``launch``); ``faults/battery.py`` holds what they share.
Writes ``benchmarks/results/fault_battery.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from faults import damaged, data, interrupted, launch  # noqa: F401 - each registers its cases
from faults.battery import (
    BASE,
    BIG_CORPUS,
    CASES,
    CORPUS,
    REFERENCE_ARRAYS,
    RESULTS,
    SHARDS,
    WORK,
    final_params,
    shardax,
    train_args,
)


def main() -> None:
    chosen = [name for name in CASES if len(sys.argv) < 2 or sys.argv[1] in name]
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "json", CORPUS)
    for package in ("email", "asyncio", "json", "http", "xml", "unittest", "logging", "concurrent"):
        shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / package, BIG_CORPUS / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    reference = shardax(*train_args(BASE))  # the uninterrupted run every recovery is compared with
    assert reference.returncode == 0, reference.stderr
    REFERENCE_ARRAYS.update(final_params(BASE / "ckpt"))
    assert shardax("prepare", CORPUS, "--out", SHARDS).returncode == 0
    rows = []
    for name in chosen:
        folder = WORK / f"case{len(rows)}"
        folder.mkdir()
        began = time.time()
        try:
            problem, lost_steps = CASES[name](folder)
        except Exception as error:  # a case that cannot be carried out fails, with why
            problem, lost_steps = f"{type(error).__name__}: {error}", 0
        rows.append({"case": name, "passed": problem is None, "lost_checkpoints": lost_steps,
                     "problem": problem, "seconds": round(time.time() - began, 1)})
        print(f"{'PASS' if problem is None else 'FAIL'} {name} (lost {lost_steps})"
              f"{'' if problem is None else ': ' + problem}",
              flush=True)
    result = {"cases": len(rows), "passed": sum(r["passed"] for r in rows),
              "lost_checkpoints": sum(r["lost_checkpoints"] for r in rows), "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if len(chosen) == len(CASES):
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fault_battery.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
