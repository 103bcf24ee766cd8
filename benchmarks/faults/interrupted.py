"""Runs stopped from outside: kill -9 at every moment of a run, and signals."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

from faults.battery import (
    BASE,
    STEPS,
    case,
    committed,
    logged,
    lost,
    resume_to_the_end,
    shardax,
    start,
    train_args,
    wait_for,
)


def kill_after(step: int, how: str = "step"):
    def run(folder: Path) -> tuple[str | None, int]:
        process = start(*train_args(folder), stall=(step, 60) if how == "step" else None,
                        compiling=how == "compile")
        if how == "step":
            wait_for(lambda: logged(folder / "metrics.jsonl") >= step, process)
        elif how == "writing":
            wait_for(lambda: any((folder / "ckpt").glob("*.orbax-checkpoint-tmp*")), process, 300)
        elif how == "sealing":
            wait_for(lambda: any((folder / "ckpt").glob("*.orbax-checkpoint-tmp*/"
                                                        "shardax_manifest.process_*")),
                     process, 300)
        before = committed(folder / "ckpt") if (folder / "ckpt").exists() else {}
        process.kill()
        process.communicate()
        problem = resume_to_the_end(folder)
        return problem, lost(before, folder / "ckpt") if before else 0
    return run


for moment in (1, 2, 3, 4, 5, 6, 7):
    case(f"kill -9 after step {moment}")(kill_after(moment))
case("kill -9 while compiling")(kill_after(0, "compile"))
case("kill -9 while a checkpoint is written")(kill_after(0, "writing"))
case("kill -9 while the writers hash their files")(kill_after(0, "sealing"))


def signal_case(number: int, when: str):
    def run(folder: Path) -> tuple[str | None, int]:
        process = start(*train_args(folder), stall=(3, 60) if when in ("step", "thrice") else None,
                        compiling=when == "compile")
        if when in ("step", "thrice"):
            wait_for(lambda: logged(folder / "metrics.jsonl") >= 3, process)
        elif when == "writing":
            wait_for(lambda: any((folder / "ckpt").glob("*.orbax-checkpoint-tmp*")), process)
        for _ in range(3 if when == "thrice" else 1):
            process.send_signal(number)
        _, stderr = process.communicate(timeout=600)
        if process.returncode not in (75, 130, -number):
            return f"exit code {process.returncode}: {stderr[-600:]}", 0
        if "Traceback" in stderr:
            return f"a traceback: {stderr[-600:]}", 0
        before = committed(folder / "ckpt") if (folder / "ckpt").exists() else {}
        return resume_to_the_end(folder), lost(before, folder / "ckpt") if before else 0
    return run


case("SIGTERM after step 3")(signal_case(signal.SIGTERM, "step"))
case("SIGINT after step 3")(signal_case(signal.SIGINT, "step"))
case("SIGTERM while compiling")(signal_case(signal.SIGTERM, "compile"))
case("SIGTERM while a checkpoint is written")(signal_case(signal.SIGTERM, "writing"))
case("SIGTERM three times after step 3")(signal_case(signal.SIGTERM, "thrice"))


def killed_resume(folder: Path) -> tuple[str | None, int]:
    """A resume killed while it loads its checkpoint, then resumed again."""
    shutil.copytree(BASE / "ckpt", folder / "ckpt")
    before = committed(folder / "ckpt")
    process = start(*train_args(folder, "--resume", "--extend-to", STEPS + 2, steps=None), compiling=True)
    process.kill()
    process.communicate()
    result = shardax(*train_args(folder, "--resume", "--extend-to", STEPS + 2, steps=None))
    return (None if result.returncode == 0 else result.stderr[-600:]), lost(before, folder / "ckpt")


case("kill -9 while a resume loads, then resume again")(killed_resume)
