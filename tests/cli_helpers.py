"""Run ``shardax`` as a user does: a real process, its exit code, what it printed."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# Subprocesses share JAX's persistent compilation cache: the many short runs of the same small
# programs compile once per test session instead of once per process. pytest-xdist's workers
# share one run id, hence one cache; a plain run gets a fresh folder of its own.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
COMPILATION_CACHE = (os.path.join(tempfile.gettempdir(), f"shardax-test-jax-cache-{_RUN}") if _RUN
                     else tempfile.mkdtemp(prefix="shardax-test-jax-cache-"))
os.makedirs(COMPILATION_CACHE, exist_ok=True)
# Token shards that `shardax train --tokenizer ...` prepares go to a cache of the test session's own,
# and the run directories of runs given no --run-dir to a folder of its own (not the checkout's runs/).
os.environ.setdefault("SHARDAX_DATA_CACHE", COMPILATION_CACHE.replace("jax-cache", "data-cache"))
os.environ.setdefault("SHARDAX_RUNS_DIR", COMPILATION_CACHE.replace("jax-cache", "runs"))


SHARED = Path(COMPILATION_CACHE.replace("jax-cache", "shared"))


def built_once(name: str, build: Callable[[Path], None]) -> Path:
    """``SHARED/name``, built by ``build(folder)`` once per test session: the first worker to ask
    builds it under a lock while any other waits, and every later fixture, on any pytest-xdist
    worker, reuses it (a failed build leaves nothing behind, and the next one tries again)."""
    folder = SHARED / name
    SHARED.mkdir(parents=True, exist_ok=True)
    with open(SHARED / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (SHARED / f"{name}.built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (SHARED / f"{name}.built").touch()
    return folder


# The tests compile over a thousand small programs, and compiling is most of their time: LLVM
# optimising XLA:CPU's machine code. The level changes neither XLA's program (its HLO after
# partitioning, collectives and buffers: a circular pipeline's temporaries are the same at levels
# 0 and 1) nor what the tests compare; it changes how long a compile takes and how fast the code
# runs. The tests themselves compile at level 0 (the strategy families' first-step comparison:
# 2.3-6 s a case against 7-9 s at level 1); the `shardax` processes they start compile at
# level 1, since many of those train for hundreds of steps (the default run: 317 s at level 0,
# 89 s at level 1 as at the default level 3). XLA:CPU's older fusion emitter
# (--xla_cpu_use_fusion_emitters=false) compiled faster still but fuses differently, so the
# memory analysis changed: it is left alone.
QUICK_COMPILE = "--xla_backend_optimization_level=0"  # the tests' own compiles (conftest.py)
RUNS_COMPILE = "--xla_backend_optimization_level=1"  # the processes they start


def subprocess_env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=RUNS_COMPILE,
               PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return env


def shardax(*args, timeout=300, check=True, env=None):
    env = dict(subprocess_env(), **(env or {}))
    result = subprocess.run([sys.executable, "-m", "shardax.cli", *map(str, args)], capture_output=True,
                            text=True, timeout=timeout, env=env)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def last_logged_step(path) -> int:
    """The highest step in a metrics file that a running process may be appending to (0 if none yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    complete = text[: text.rfind("\n") + 1]  # a line still being written is not read
    return max((json.loads(line).get("step", 0) for line in complete.splitlines() if line.strip()), default=0)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """The `json` package's source: ~40 KB of real text, quick to read."""
    folder = tmp_path_factory.mktemp("corpus")
    source = Path(sysconfig.get_paths()["stdlib"]) / "json"
    for path in source.glob("*.py"):
        shutil.copy(path, folder / path.name)
    return folder


# Small, quick runs: the tiny model on short sequences.
QUICK = ("--preset", "tiny", "--seq-len", "32", "--batch-size", "16", "--sample-bytes", "8")


WORKERS = Path(__file__).parent / "workers"


def stalled(step, seconds, *command):
    """``command`` (``shardax ...`` or a script and its arguments) with the Trainer pausing after ``step``."""
    return [sys.executable, str(WORKERS / "stall.py"), str(step), str(seconds), *map(str, command)]


def sealed(checkpoints, step) -> bool:
    """Whether checkpoint ``step`` is committed and sealed (its manifest written)."""
    return (Path(checkpoints) / str(step) / "shardax_manifest.json").is_file()
