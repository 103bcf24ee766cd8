"""The data: damaged token shards and index, a killed prepare, relative paths."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from faults.battery import (
    BIG_CORPUS,
    CORPUS,
    QUICK,
    SHARDS,
    case,
    env,
    final_params,
    one_line,
    shardax,
    wait_for,
)


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
        again = shardax("train", *QUICK, "--extend-to", 3, "--resume", "--checkpoint-dir",
                        folder / checkpoints, cwd=folder / where)
        if again.returncode != 0:
            return again.stderr[-600:], 0
    a, b = final_params(folder / "ckpt", 3), final_params(folder / "ckpt2", 3)
    return (None if all(np.array_equal(a[k], b[k]) for k in a) else "the resume read other data"), 0


case("--data relative, resumed from another directory")(relative_data)
