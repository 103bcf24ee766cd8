"""What a run finds damaged or in use: checkpoints, the metrics file, locks, the disk, its directories."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from faults.battery import (
    BASE,
    CORPUS,
    QUICK,
    STEPS,
    case,
    committed,
    env,
    logged,
    lost,
    one_line,
    resume_to_the_end,
    same_as_uninterrupted,
    shardax,
    start,
    train_args,
    wait_for,
)


def damaged_latest(how: Callable[[Path], None]):
    def run(folder: Path) -> tuple[str | None, int]:
        shutil.copytree(BASE / "ckpt", folder / "ckpt")
        shutil.copy(BASE / "metrics.jsonl", folder / "metrics.jsonl")
        before = committed(folder / "ckpt")
        latest = max(int(s) for s in before)
        how(folder / "ckpt" / str(latest))
        result = shardax(*train_args(folder, "--resume", "--extend-to", STEPS + 2, steps=None))
        problem = None if result.returncode == 0 else f"resume failed: {result.stderr[-600:]}"
        if problem is None and f"checkpoint step {latest} " not in result.stdout:
            problem = "no warning names the damaged step"
        return problem, lost(before, folder / "ckpt", damaged={str(latest)})
    return run


def largest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file() and p.name != "shardax_manifest.json"),
               key=lambda p: p.stat().st_size)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "a file missing": lambda step: largest(step).unlink(),
    "a file truncated": lambda step: os.truncate(largest(step), largest(step).stat().st_size // 2),
    "a file zeroed": lambda step: largest(step).write_bytes(bytes(largest(step).stat().st_size)),
    "one bit flipped": lambda step: flip(largest(step)),
    "the seal removed": lambda step: (step / "shardax_manifest.json").unlink(),
    "the seal garbage": lambda step: (step / "shardax_manifest.json").write_text("{not json"),
    "orbax's metadata removed": lambda step: (step / "_CHECKPOINT_METADATA").unlink(),
    "the state folder removed": lambda step: shutil.rmtree(step / "state"),
    "a small file changed": lambda step: (step / "record" / "metadata").write_text(
        (step / "record" / "metadata").read_text().replace("1", "2", 1)),
}
for what, how in DAMAGE.items():
    case(f"damaged latest checkpoint: {what}")(damaged_latest(how))


def disk_full(folder: Path) -> tuple[str | None, int]:
    shutil.copytree(BASE / "ckpt", folder / "ckpt")
    before = committed(folder / "ckpt")

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    result = subprocess.run([sys.executable, "-m", "shardax.cli",
                             *map(str, train_args(folder, "--resume", "--extend-to", STEPS + 4, steps=None))],
                            capture_output=True, text=True, timeout=600,
                            env=env(JAX_ENABLE_COMPILATION_CACHE="false"), preexec_fn=limit)
    return one_line(result, 2, "could not write the checkpoint of step"), lost(before, folder / "ckpt")


case("disk full while writing a checkpoint")(disk_full)


def bad_directory(target: Callable[[Path], Path], says: str):
    def run(folder: Path) -> tuple[str | None, int]:
        result = shardax(*["train", *QUICK, "--steps", 2, "--data", CORPUS, "--checkpoint-dir",
                           target(folder)])
        return one_line(result, 2, says), 0
    return run


case("--checkpoint-dir is a file")(bad_directory(lambda f: (f / "file").write_text("x") and f / "file",
                                                 "is a file"))
case("--checkpoint-dir cannot be created")(bad_directory(lambda f: Path("/proc/shardax/ckpt"),
                                                         "cannot be created"))


def second_run(extra: tuple[str, ...]):
    def run(folder: Path) -> tuple[str | None, int]:
        first = start(*train_args(folder), stall=(2, 120))
        wait_for(lambda: logged(folder / "metrics.jsonl") >= 2, first)
        before = committed(folder / "ckpt")
        other = shardax("train", *QUICK, "--steps", STEPS, "--seed", 7, "--data", CORPUS, "--checkpoint-dir",
                        folder / "ckpt", *extra)
        problem = one_line(other, 2, "is being written by")
        problem = problem or (None if committed(folder / "ckpt") == before
                              else "the second run changed checkpoints")
        os.kill(first.pid, signal.SIGTERM)
        first.communicate(timeout=600)
        return problem or resume_to_the_end(folder), lost(before, folder / "ckpt")
    return run


case("a second run into the same --checkpoint-dir")(second_run(()))
case("a second run resuming the same --checkpoint-dir")(second_run(("--resume",)))


def stale_lock(folder: Path) -> tuple[str | None, int]:
    process = start(*train_args(folder), stall=(2, 120))
    wait_for(lambda: logged(folder / "metrics.jsonl") >= 2, process)
    process.kill()
    process.communicate()
    before = committed(folder / "ckpt")
    if not before:
        (folder / "metrics.jsonl").unlink(missing_ok=True)
    result = shardax(*train_args(folder, *(["--resume"] if before else [])))
    problem = None if result.returncode == 0 else result.stderr[-600:]
    if problem is None and "took over" not in result.stdout + result.stderr:
        problem = "the new run did not say it took the dead run's lock over"
    return problem or same_as_uninterrupted(folder / "ckpt"), lost(before, folder / "ckpt")


case("a lock left by a killed run")(stale_lock)


def metrics_case(text: Callable[[str], str], recovers: bool, says: str = ""):
    def run(folder: Path) -> tuple[str | None, int]:
        shutil.copytree(BASE / "ckpt", folder / "ckpt")
        (folder / "metrics.jsonl").write_text(text((BASE / "metrics.jsonl").read_text()))
        before = committed(folder / "ckpt")
        result = shardax(*train_args(folder, "--resume", "--extend-to", STEPS + 1, steps=None))
        if recovers:
            return (None if result.returncode == 0 else result.stderr[-600:]), lost(before, folder / "ckpt")
        return one_line(result, 2, says), lost(before, folder / "ckpt")
    return run


case("a torn last line in --metrics")(metrics_case(lambda t: t + '{"step": 9, "lo', True))
case("a garbage line inside --metrics")(metrics_case(lambda t: t.replace("\n", "\nnot json\n", 1), False,
                                                      "is not a JSON record"))


def garbage_lock(folder: Path) -> tuple[str | None, int]:
    shutil.copytree(BASE / "ckpt", folder / "ckpt")
    (folder / "ckpt" / ".shardax-lock").write_bytes(os.urandom(64))
    before = committed(folder / "ckpt")
    result = shardax(*train_args(folder, "--resume", "--extend-to", STEPS + 1, steps=None))
    return (None if result.returncode == 0 else result.stderr[-600:]), lost(before, folder / "ckpt")


case("a lock file holding garbage")(garbage_lock)


def metrics_is_a_folder(folder: Path) -> tuple[str | None, int]:
    (folder / "metrics.jsonl").mkdir()
    result = shardax(*train_args(folder))
    return one_line(result, 2, "metrics"), 0


case("--metrics names a directory")(metrics_is_a_folder)


def resume_mismatch(extra: tuple[object, ...], says: str, extend_to: int = STEPS + 2, fresh: bool = False):
    def run(folder: Path) -> tuple[str | None, int]:
        shutil.copytree(BASE / "ckpt", folder / "ckpt")
        before = committed(folder / "ckpt")
        how = ("--steps", 2) if fresh else ("--extend-to", extend_to, "--resume")
        result = shardax("train", *QUICK, *how, "--checkpoint-dir", folder / "ckpt", *extra)
        return one_line(result, 2, says), lost(before, folder / "ckpt")
    return run


case("--resume with another model")(resume_mismatch(("--preset", "small"), ""))
case("--resume to a step already passed")(resume_mismatch((), "--extend-to", extend_to=2))
case("a fresh run into a directory holding checkpoints")(resume_mismatch(("--data", CORPUS), "--resume",
                                                                         fresh=True))
case("--resume with no checkpoint")(
    lambda folder: (one_line(shardax("train", *QUICK, "--steps", 2, "--resume", "--checkpoint-dir",
                                     folder / "x"), 2,
                             "no checkpoint"), 0))
