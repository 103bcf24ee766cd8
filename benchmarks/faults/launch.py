"""Several processes under shardax launch."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from faults.battery import (
    BASE,
    STEPS,
    case,
    committed,
    env,
    logged,
    lost,
    resume_to_the_end,
    shardax,
    train_args,
    wait_for,
)
from faults.damaged import flip, largest


def launch_killed(folder: Path) -> tuple[str | None, int]:
    args = ["launch", "-n", 2, "--devices-per-process", 4, "--", "shardax", *train_args(folder)]
    process = subprocess.Popen([sys.executable, "-m", "shardax.cli", *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env(), start_new_session=True)
    wait_for(lambda: logged(folder / "metrics.jsonl") >= 2, process, 300)
    before = committed(folder / "ckpt")
    workers = subprocess.run(["pgrep", "-f", str(folder / "ckpt")], capture_output=True,
                             text=True).stdout.split()
    children = [int(pid) for pid in workers if int(pid) != process.pid]
    if not children:
        process.kill()
        return "found no worker to kill", 0
    os.kill(children[-1], signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    if process.returncode == 0 or "Traceback" in stderr.split("shardax launch")[-1]:
        return f"launch exit code {process.returncode}: {stderr[-600:]}", 0
    problem = resume_to_the_end(folder)
    return problem, lost(before, folder / "ckpt")


case("kill -9 a worker under shardax launch")(launch_killed)


def damaged_under_launch(folder: Path) -> tuple[str | None, int]:
    """Two processes resume a directory whose latest checkpoint has one bit flipped."""
    shutil.copytree(BASE / "ckpt", folder / "ckpt")
    shutil.copy(BASE / "metrics.jsonl", folder / "metrics.jsonl")
    before = committed(folder / "ckpt")
    flip(largest(folder / "ckpt" / str(STEPS)))
    result = shardax("launch", "-n", 2, "--devices-per-process", 4, "--", "shardax",
                     *train_args(folder, "--resume", "--extend-to", STEPS + 2, steps=None))
    problem = None if result.returncode == 0 else f"resume failed: {result.stderr[-600:]}"
    if problem is None and f"checkpoint step {STEPS} " not in result.stdout:
        problem = "no warning names the damaged step"
    return problem, lost(before, folder / "ckpt", damaged={str(STEPS)})


case("damaged latest checkpoint, resumed by 2 processes")(damaged_under_launch)
