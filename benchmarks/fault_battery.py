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
Writes ``benchmarks/results/fault_battery.json``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))
WORK = Path(tempfile.mkdtemp(prefix="shardax-faults-"))
CACHE = WORK / "jax-cache"
QUICK = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "16", "--sample-bytes", "0", "--eval-every", "0",
         "--log-every", "1"]
STEPS = 8
CORPUS = WORK / "corpus"  # the json package's source: a small real text
BIG_CORPUS = WORK / "big"  # enough text that a BPE prepare takes a few seconds
BASE = WORK / "base"  # the uninterrupted run, checkpointed every 2 steps
SHARDS = WORK / "shards"


def env(**extra: str) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    values.update(PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", SHARDAX_DATA_CACHE=str(WORK / "data-cache"))
    values.update(extra)
    return values


def shardax(*args: object, cwd: Path | None = None, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardax.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=kwargs.pop("environ", env()), cwd=cwd, **kwargs)


def start(*args: object, stall: tuple[int, float] | None = None, compiling: bool = False) -> subprocess.Popen:
    """``shardax`` running; ``compiling``: returns once it has said what it runs and is compiling
    its step (the compilation cache off, so that the compile takes a while)."""
    command = [sys.executable, "-m", "shardax.cli", *map(str, args)]
    if stall:
        command = [sys.executable, str(ROOT / "tests" / "workers" / "stall.py"), str(stall[0]), str(stall[1]), "shardax",
                   *map(str, args)]
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
    return max((json.loads(line).get("step", 0) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()),
               default=0)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen | None = None, seconds: float = 300) -> bool:
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
            steps[folder.name] = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
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


_REFERENCE: dict[str, np.ndarray] = {}


def same_as_uninterrupted(checkpoints: Path) -> str | None:
    got = final_params(checkpoints)
    for key, value in _REFERENCE.items():
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


def kill_after(step: int, how: str = "step"):
    def run(folder: Path) -> tuple[str | None, int]:
        process = start(*train_args(folder), stall=(step, 60) if how == "step" else None, compiling=how == "compile")
        if how == "step":
            wait_for(lambda: logged(folder / "metrics.jsonl") >= step, process)
        elif how == "writing":
            wait_for(lambda: any((folder / "ckpt").glob("*.orbax-checkpoint-tmp*")), process, 300)
        elif how == "sealing":
            wait_for(lambda: any((folder / "ckpt").glob("*.orbax-checkpoint-tmp*/shardax_manifest.process_*")),
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
                            capture_output=True, text=True, timeout=600, env=env(JAX_ENABLE_COMPILATION_CACHE="false"),
                            preexec_fn=limit)
    return one_line(result, 2, "could not write the checkpoint of step"), lost(before, folder / "ckpt")


case("disk full while writing a checkpoint")(disk_full)


def bad_directory(target: Callable[[Path], Path], says: str):
    def run(folder: Path) -> tuple[str | None, int]:
        result = shardax(*["train", *QUICK, "--steps", 2, "--data", CORPUS, "--checkpoint-dir", target(folder)])
        return one_line(result, 2, says), 0
    return run


case("--checkpoint-dir is a file")(bad_directory(lambda f: (f / "file").write_text("x") and f / "file", "is a file"))
case("--checkpoint-dir cannot be created")(bad_directory(lambda f: Path("/proc/shardax/ckpt"), "cannot be created"))


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


def second_run(extra: tuple[str, ...]):
    def run(folder: Path) -> tuple[str | None, int]:
        first = start(*train_args(folder), stall=(2, 120))
        wait_for(lambda: logged(folder / "metrics.jsonl") >= 2, first)
        before = committed(folder / "ckpt")
        other = shardax("train", *QUICK, "--steps", STEPS, "--seed", 7, "--data", CORPUS, "--checkpoint-dir",
                        folder / "ckpt", *extra)
        problem = one_line(other, 2, "is being written by")
        problem = problem or (None if committed(folder / "ckpt") == before else "the second run changed checkpoints")
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


def prepared(folder: Path) -> Path:
    shutil.copytree(SHARDS, folder / "shards")
    return folder / "shards"


def data_case(damage: Callable[[Path], None], says: str):
    def run(folder: Path) -> tuple[str | None, int]:
        shards = prepared(folder)
        damage(shards)
        result = shardax("train", *QUICK, "--steps", 2, "--data", shards)
        return one_line(result, 2, says), 0
    return run


def first_shard(shards: Path) -> Path:
    return sorted(shards.rglob("*.tokens"))[0]


def index_without(key: str):
    def damage(shards: Path) -> None:
        index = json.loads((shards / "index.json").read_text())
        index.pop(key)
        (shards / "index.json").write_text(json.dumps(index))
    return damage


case("index.json without dtype")(data_case(index_without("dtype"), "index.json"))
case("index.json garbage")(data_case(lambda s: (s / "index.json").write_text("{"), "index.json"))
case("a shard overwritten with garbage")(data_case(
    lambda s: first_shard(s).write_bytes(os.urandom(first_shard(s).stat().st_size)), ".tokens"))
case("a shard truncated")(data_case(lambda s: os.truncate(first_shard(s), 10), ".tokens"))
case("a shard removed")(data_case(lambda s: first_shard(s).unlink(), ".tokens"))


def killed_prepare(folder: Path) -> tuple[str | None, int]:
    prepare = ("prepare", BIG_CORPUS, "--out", folder / "out", "--tokenizer", "bpe", "--vocab-size", 1000)
    process = subprocess.Popen([sys.executable, "-m", "shardax.cli", *map(str, prepare)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    if not wait_for(lambda: (folder / "out" / ".building").exists(), process, 120):
        return "prepare ended before it could be killed mid-way", 0
    time.sleep(0.5)
    process.kill()
    process.communicate()
    if not (folder / "out" / ".building").exists():
        return "nothing of the killed prepare was left to clean up", 0
    again = shardax(*prepare)
    if again.returncode != 0:
        return f"prepare again failed: {again.stderr[-600:]}", 0
    trained = shardax("train", *QUICK, "--steps", 1, "--data", folder / "out")
    return (None if trained.returncode == 0 else trained.stderr[-600:]), 0


case("kill -9 during shardax prepare, then prepare again")(killed_prepare)


def relative_data(folder: Path) -> tuple[str | None, int]:
    """A run started with ``--data corpus`` in one directory, resumed from another directory that
    holds other text under that name: it goes on with its own data (as a resume from the first)."""
    (folder / "a").mkdir()
    shutil.copytree(CORPUS, folder / "a" / "corpus")
    first = shardax("train", *QUICK, "--steps", 2, "--data", "corpus", "--checkpoint-dir", folder / "ckpt",
                    cwd=folder / "a")
    if first.returncode != 0:
        return first.stderr[-600:], 0
    shutil.copytree(folder / "ckpt", folder / "ckpt2", ignore=shutil.ignore_patterns(".shardax-lock"))
    (folder / "b" / "corpus").mkdir(parents=True)
    (folder / "b" / "corpus" / "other.txt").write_text("other text entirely, " * 400)
    for where, checkpoints in (("b", "ckpt"), ("a", "ckpt2")):
        again = shardax("train", *QUICK, "--extend-to", 3, "--resume", "--checkpoint-dir", folder / checkpoints,
                        cwd=folder / where)
        if again.returncode != 0:
            return again.stderr[-600:], 0
    a, b = final_params(folder / "ckpt", 3), final_params(folder / "ckpt2", 3)
    return (None if all(np.array_equal(a[k], b[k]) for k in a) else "the resume read other data"), 0


case("--data relative, resumed from another directory")(relative_data)


def launch_killed(folder: Path) -> tuple[str | None, int]:
    args = ["launch", "-n", 2, "--devices-per-process", 4, "--", "shardax", *train_args(folder)]
    process = subprocess.Popen([sys.executable, "-m", "shardax.cli", *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env(), start_new_session=True)
    wait_for(lambda: logged(folder / "metrics.jsonl") >= 2, process, 300)
    before = committed(folder / "ckpt")
    workers = subprocess.run(["pgrep", "-f", str(folder / "ckpt")], capture_output=True, text=True).stdout.split()
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
case("a fresh run into a directory holding checkpoints")(resume_mismatch(("--data", CORPUS), "--resume", fresh=True))
case("--resume with no checkpoint")(
    lambda folder: (one_line(shardax("train", *QUICK, "--steps", 2, "--resume", "--checkpoint-dir", folder / "x"), 2,
                             "no checkpoint"), 0))


def main() -> None:
    chosen = [name for name in CASES if len(sys.argv) < 2 or sys.argv[1] in name]
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "json", CORPUS)
    for package in ("email", "asyncio", "json", "http", "xml", "unittest", "logging", "concurrent"):
        shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / package, BIG_CORPUS / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    reference = shardax(*train_args(BASE))  # the uninterrupted run every recovery is compared with
    assert reference.returncode == 0, reference.stderr
    _REFERENCE.update(final_params(BASE / "ckpt"))
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
        rows.append({"case": name, "passed": problem is None, "lost_checkpoints": lost_steps, "problem": problem,
                     "seconds": round(time.time() - began, 1)})
        print(f"{'PASS' if problem is None else 'FAIL'} {name} (lost {lost_steps}){'' if problem is None else ': ' + problem}",
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
