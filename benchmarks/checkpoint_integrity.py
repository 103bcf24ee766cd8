"""Benchmark 15: sealing and checking checkpoints, against checkpoint size.

    python benchmarks/checkpoint_integrity.py

For states of 64 MiB, 256 MiB and 1 GiB of random float32 (incompressible) on one process:
- how long ``Checkpointer.save`` blocks the training loop, and how long until the checkpoint is
  committed in the background (written, hashed by the process that wrote it, sealed);
- the time spent hashing while sealing (the writers' parts and what process 0 hashes itself);
- checking the checkpoint at resume: the blocks shared over the process's threads, against
  hashing every file whole on one thread (how checkpoints were checked before);
- checking shared over P processes (P = 1, 2; separate OS processes, one hashing thread each,
  started together): the wall time and the bytes each hashes;
- a training loop's step time (a jitted matmul chain) while a save is written and hashed in
  the background, against the same loop with nothing saving (median of steps).

The page cache is warm for every check (the files were just written or read); a cold read is
bounded by the disk instead. Writes ``benchmarks/results/checkpoint_integrity.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from shardax.trainer import manifest
from shardax.trainer.checkpoint import Checkpointer

RESULTS = Path(__file__).parent / "results"
SIZES_MIB = [64, 256, 1024]
CHECK = """
import sys, time
from pathlib import Path
from shardax.trainer import manifest
start = float(sys.argv[3])
while time.time() < start:
    time.sleep(0.001)
began = time.perf_counter()
problem = manifest.damage(Path(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[4])), workers=1)
print(time.perf_counter() - began, problem)
"""


def state_of(mib: int) -> dict[str, jax.Array]:
    rows = mib * (1 << 20) // 4 // 1024
    key = jax.random.key(mib)
    return {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (rows // 4, 1024)) for i in range(4)}


def timed_hashing() -> list[float]:
    """Wrap ``manifest.hash_files`` to record how long each call takes (sealing's hashing)."""
    spent: list[float] = []
    original = manifest.hash_files

    def hashing(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    manifest.hash_files = hashing
    return spent


def whole_files_one_thread(checkpoint: Path) -> float:
    began = time.perf_counter()
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        manifest._digest(path)
    return time.perf_counter() - began


def shared_over_processes(checkpoint: Path, processes: int) -> dict[str, float]:
    start = time.time() + 3.0  # every process imports first, then all begin together
    children = [subprocess.Popen([sys.executable, "-c", CHECK, str(checkpoint), str(i), str(start),
                                  str(processes)],
                                 stdout=subprocess.PIPE, text=True) for i in range(processes)]
    times = []
    for child in children:
        out, _ = child.communicate()
        seconds, problem = out.split(maxsplit=1)
        assert problem.strip() == "None", problem
        times.append(float(seconds))
    return {"wall_s": max(times), "per_process_s": times}


def step_times(seconds: float, during: threading.Event | None = None) -> list[float]:
    """Step times of a jitted matmul chain for ``seconds`` (or until ``during`` is cleared)."""
    x = jnp.ones((512, 512))

    @jax.jit
    def step(x):
        for _ in range(8):
            x = jnp.tanh(x @ x / 512)
        return x

    step(x).block_until_ready()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end and (during is None or during.is_set()):
        began = time.perf_counter()
        x = step(x).block_until_ready()
        times.append(time.perf_counter() - began)
    return times


def main() -> None:
    rows = []
    spent = timed_hashing()
    with tempfile.TemporaryDirectory(dir=os.environ.get("SHARDAX_BENCH_DIR")) as folder:
        for mib in SIZES_MIB:
            directory = Path(folder) / f"ckpt{mib}"
            state = state_of(mib)
            jax.block_until_ready(state)
            checkpointer = Checkpointer(directory)
            checkpointer.make_writable()
            spent.clear()
            began = time.perf_counter()
            checkpointer.save(1, state, {"size_mib": mib})
            blocked = time.perf_counter() - began
            saving = threading.Event()
            saving.set()
            waiter = threading.Thread(target=lambda: (checkpointer.wait(), saving.clear()))
            waiter.start()
            during = step_times(600, saving)
            waiter.join()
            committed = time.perf_counter() - began
            hashing = sum(spent)
            checkpointer.close()
            idle = step_times(max(1.0, committed - blocked))
            checkpoint = directory / "1"
            size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
            manifest._verified.clear()
            began = time.perf_counter()
            assert manifest.damage(checkpoint) is None
            shared = time.perf_counter() - began
            whole = whole_files_one_thread(checkpoint)
            processes = {str(p): shared_over_processes(checkpoint, p) for p in (1, 2)}
            row = {"state_mib": mib, "checkpoint_bytes": size, "save_blocks_s": blocked,
                   "committed_after_s": committed, "sealing_hash_s": hashing,
                   "check_threads": manifest._workers(), "check_shared_blocks_s": shared,
                   "check_whole_files_one_thread_s": whole, "check_over_processes": processes,
                   "step_s_while_saving": statistics.median(during) if during else None,
                   "steps_while_saving": len(during), "step_s_idle": statistics.median(idle)}
            rows.append(row)
            print(json.dumps(row))
    result = {"machine": f"{os.cpu_count()} cores, jax {jax.__version__}", "block_bytes": manifest.BLOCK,
              "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_integrity.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
