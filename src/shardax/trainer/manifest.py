"""Sealed checkpoints: every file's size and SHA-256, written as the checkpoint is committed.

A checkpoint is sealed in orbax's commit step, after every process has written its files and
before the temporary directory is renamed into place, so a committed checkpoint carries its
manifest. At resume each file is checked against it: a file missing, truncated, zeroed or
otherwise changed marks the checkpoint damaged, and so does a checkpoint that was never
sealed (the run stopped while it was being committed).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "shardax_manifest.json"
# orbax's own bookkeeping, rewritten when the commit completes (after the seal): not state
BOOKKEEPING = {MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt"}
_CHUNK = 1 << 20


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in BOOKKEEPING)


def seal(directory: Path) -> None:
    """Write ``directory``'s manifest (atomically: a reader sees all of it or none)."""
    files = {str(path.relative_to(directory)): {"bytes": path.stat().st_size, "sha256": _digest(path)}
             for path in _files(directory)}
    partial = directory / (MANIFEST + ".partial")
    partial.write_text(json.dumps({"files": files}, indent=1))
    os.replace(partial, directory / MANIFEST)


def damage(directory: Path) -> str | None:
    """``None`` when every sealed file is as it was sealed, else what is wrong (a short phrase)."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        if not (directory / "_CHECKPOINT_METADATA").is_file():
            return "it is not a checkpoint written by shardax"
        return "it was never sealed: the run stopped while committing it"
    except (OSError, ValueError, KeyError):
        return f"its manifest {MANIFEST} is unreadable"
    for name, sealed in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != sealed["bytes"]:
            return f"{name} has {size} bytes, {sealed['bytes']} when sealed"
        if _digest(path) != sealed["sha256"]:
            return f"{name} changed since it was sealed"
    return None
