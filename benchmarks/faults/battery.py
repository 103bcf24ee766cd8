"""The battery itself: its registry of cases (``CASES``, ``case``), its working paths, running
shardax as a user does, and reading what a run committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))
WORK = Path(tempfile.mkdtemp(prefix="shardax-faults-"))
CACHE = WORK / "jax-cache"
QUICK = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "16", "--sample-bytes", "0", "--eval-every",
         "0", "--log-every", "1"]
STEPS = 8
CORPUS = WORK / "corpus"  # the json package's source: a small real text
BIG_CORPUS = WORK / "big"  # enough text that a BPE prepare takes a few seconds
BASE = WORK / "base"  # the uninterrupted run, checkpointed every 2 steps
SHARDS = WORK / "shards"


def env(**extra: str) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    values.update(PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(CACHE),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", SHARDAX_DATA_CACHE=str(WORK / "data-cache"))
    values.update(extra)
    return values


def shardax(*args: object, cwd: Path | None = None, timeout: float = 600,
            **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardax.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=kwargs.pop("environ", env()), cwd=cwd, **kwargs)


def start(*args: object, stall: tuple[int, float] | None = None, compiling: bool = False) -> subprocess.Popen:
    """``shardax`` running; ``compiling``: returns once it has said what it runs and is compiling
    its step (the compilation cache off, so that the compile takes a while)."""
    command = [sys.executable, "-m", "shardax.cli", *map(str, args)]
    if stall:
        command = [sys.executable, str(ROOT / "tests" / "workers" / "stall.py"), str(stall[0]), str(stall[1]),
                   "shardax", *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env(JAX_ENABLE_COMPILATION_CACHE="false") if compiling else env())
    if compiling:
        for line in process.stdout:
            if line.startswith("run:"):
                time.sleep(0.5)
                break
    return process


def logged(metrics: Path) -> int:
    try:
        text = metrics.read_text()
    except FileNotFoundError:
        return 0
    return max((json.loads(line).get("step", 0)
                for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()),
               default=0)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen | None = None,
             seconds: float = 300) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        if process is not None and process.poll() is not None:
            return condition()
        time.sleep(0.02)
    return False


def committed(checkpoints: Path) -> dict[str, dict[str, bytes]]:
    """Every committed, sealed step: its files' bytes."""
    steps = {}
    for folder in sorted(checkpoints.glob("*")):
        if folder.is_dir() and folder.name.isdigit() and (folder / "shardax_manifest.json").is_file():
            steps[folder.name] = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
                                  if p.is_file()}
    return steps


def lost(before: dict[str, dict[str, bytes]], checkpoints: Path, damaged: set[str] = frozenset()) -> int:
    """Committed steps gone or changed (those damaged on purpose must be kept as ``<step>.damaged``)."""
    after = committed(checkpoints)
    count = 0
    for step, files in before.items():
        if step in damaged:
            count += not (checkpoints / f"{step}.damaged").is_dir() and step not in after
        elif after.get(step) != files:
            count += 1
    return count


def one_line(result: subprocess.CompletedProcess | tuple[int, str], code: int | None = None,
             says: str = "") -> str | None:
    """``None`` when the command failed as it should: non-zero (or ``code``), one line, no traceback."""
    returncode, stderr = (result.returncode, result.stderr) if hasattr(result, "returncode") else result
    lines = [line for line in stderr.strip().splitlines() if line.strip() and not line.startswith("WARNING:")]
    if returncode == 0 or (code is not None and returncode != code):
        return f"exit code {returncode}"
    if "Traceback" in stderr or len(lines) != 1:
        return f"{len(lines)} lines on stderr: {stderr[-600:]!r}"
    if says not in lines[0]:
        return f"the line does not say {says!r}: {lines[0]!r}"
    return None


def final_params(checkpoints: Path, step: int = STEPS) -> dict[str, np.ndarray]:
    from shardax.trainer.checkpoint import saved_arrays

    return {k: v for k, v in saved_arrays(checkpoints, step).items() if k.startswith(("params", "opt_state"))}


REFERENCE_ARRAYS: dict[str, np.ndarray] = {}


def same_as_uninterrupted(checkpoints: Path) -> str | None:
    got = final_params(checkpoints)
    for key, value in REFERENCE_ARRAYS.items():
        if not np.array_equal(got[key], value):
            return f"{key} differs from the uninterrupted run's"
    return None


def train_args(case: Path, *extra: object, steps: int | None = STEPS) -> list[object]:
    """The battery's run (``steps`` None: ``extra`` says how far, with ``--extend-to``)."""
    length = [] if steps is None else ["--steps", steps]
    return ["train", *QUICK, *length, "--data", CORPUS, "--checkpoint-dir", case / "ckpt",
            "--metrics", case / "metrics.jsonl", "--checkpoint-every", 2, "--keep-checkpoints", 100, *extra]


def resume_to_the_end(case: Path) -> str | None:
    """What the user does next: resume (or start again, when nothing was committed) to the end."""
    again = committed(case / "ckpt") if (case / "ckpt").exists() else {}
    if not again:
        (case / "metrics.jsonl").unlink(missing_ok=True)
    result = shardax(*train_args(case, *(["--resume"] if again else [])))
    if result.returncode != 0:
        return f"{'resume' if again else 'the run again'} failed: {result.stderr[-800:]}"
    return same_as_uninterrupted(case / "ckpt")


# -- the cases ---------------------------------------------------------------------------------------------

CASES: dict[str, Callable[[Path], tuple[str | None, int]]] = {}


def case(name: str):
    def register(function):
        CASES[name] = function
        return function
    return register
