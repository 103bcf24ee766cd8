"""Sealed checkpoints: every file's size and SHA-256 digests, written as the checkpoint is committed.

Sealing scales with the number of processes. Each process hashes the files it wrote itself
(orbax puts them under ``ocdbt.process_<i>`` and ``process_<i>`` names), in its background
writer thread once its writes are done, so training goes on meanwhile, and leaves its part
of the manifest in the checkpoint's temporary directory. In orbax's commit step process 0
hashes what no part covers (the small files written when the checkpoint is finalized),
merges the parts and writes the manifest before the directory is renamed into place, so a
committed checkpoint carries its manifest.

Files are hashed in blocks of ``BLOCK`` bytes, each block on its own, so that checking a
checkpoint at resume is shared: every process hashes an equal share of all the blocks
(several at a time), and the processes agree on the first one that does not match. A file
missing, truncated, zeroed or otherwise changed marks the checkpoint damaged, and so does a
checkpoint that was never sealed (the run stopped while it was being committed).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MANIFEST = "shardax_manifest.json"
PART = "shardax_manifest.process_{}.json"
# orbax's own bookkeeping, rewritten when the commit completes (after the seal), and ours: not state
BOOKKEEPING = {MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt"}
BLOCK = 64 << 20
_OWNER = re.compile(r"(?:^|\.)process_(\d+)(?:\.|$)")
_PART = re.compile(r"shardax_manifest\.process_\d+\.json(\.partial)?$")


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _digest(path: Path, start: int = 0, length: int | None = None) -> str:
    """SHA-256 of ``length`` bytes of ``path`` from ``start`` (to the end when ``None``)."""
    sha = hashlib.sha256()
    with path.open("rb") as file:
        file.seek(start)
        left = length
        while ((left is None or left > 0)
                and (chunk := file.read(1 << 20 if left is None else min(left, 1 << 20)))):
            sha.update(chunk)  # hashlib lets go of the GIL on large chunks: blocks hash in parallel
            if left is not None:
                left -= len(chunk)
    return sha.hexdigest()


def _blocks(size: int) -> int:
    return max(1, -(-size // BLOCK))


def _is_state(path: Path) -> bool:
    return path.is_file() and path.name not in BOOKKEEPING and not _PART.match(path.name)


def owner(name: str) -> int | None:
    """The process that wrote the file ``name`` (a path inside a checkpoint), when its name says."""
    for part in Path(name).parts:
        match = _OWNER.search(part)
        if match:
            return int(match.group(1))
    return None


def hash_files(directory: Path, names: Iterable[str], by: int,
               workers: int | None = None) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "blocks": [sha256 of each BLOCK], "by": by}}``, the blocks hashed in
    parallel (``by``: the process that hashed them)."""
    sizes = {name: (directory / name).stat().st_size for name in names}
    units = [(name, index) for name, size in sizes.items() for index in range(_blocks(size))]
    with concurrent.futures.ThreadPoolExecutor(workers or _workers()) as pool:
        digests = list(pool.map(lambda unit: _digest(directory / unit[0], unit[1] * BLOCK, BLOCK), units))
    files: dict[str, dict[str, Any]] = {name: {"bytes": size, "blocks": [], "by": by}
                                         for name, size in sizes.items()}
    for (name, _), digest in zip(units, digests):
        files[name]["blocks"].append(digest)
    return files


def _write_json(path: Path, value: Any) -> None:
    """Atomically: a reader sees all of it or none."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=1))
    os.replace(partial, path)


_TEMPORARY = re.compile(r"\.orbax-checkpoint-tmp.*$")


def _final_name(name: str) -> str:
    """A file's name once orbax has renamed the temporary directories it is in."""
    return str(Path(*(_TEMPORARY.sub("", part) for part in Path(name).parts)))


def seal_part(checkpoint: Path, process: int) -> None:
    """Hash the files ``process`` wrote into ``checkpoint`` (its temporary directory) and leave
    them as that process's part of the manifest (run by each process once its writes are done)."""
    names = [str(p.relative_to(checkpoint)) for p in sorted(checkpoint.rglob("*"))
             if _is_state(p) and owner(str(p.relative_to(checkpoint))) == process]
    files = hash_files(checkpoint, names, by=process)
    _write_json(checkpoint / PART.format(process), {"files": {_final_name(n): e for n, e in files.items()}})


def seal(checkpoint: Path, process: int = 0) -> None:
    """Write ``checkpoint``'s manifest: the processes' parts, and what they do not cover hashed here
    (by ``process``, the one committing it)."""
    files: dict[str, dict[str, Any]] = {}
    parts = sorted(p for p in checkpoint.glob(PART.format("*")))
    for part in parts:
        try:
            files.update(json.loads(part.read_text())["files"])
        except (OSError, ValueError, KeyError):
            pass  # that process's files are hashed here instead
    present = [str(p.relative_to(checkpoint)) for p in sorted(checkpoint.rglob("*")) if _is_state(p)]
    files = {name: entry for name, entry in files.items() if name in present}
    files.update(hash_files(checkpoint, [name for name in present if name not in files], by=process))
    _write_json(checkpoint / MANIFEST, {"files": dict(sorted(files.items())), "block_bytes": BLOCK})
    for part in parts:
        part.unlink(missing_ok=True)


def _read_manifest(checkpoint: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError
        return manifest, None
    except FileNotFoundError:
        if not (checkpoint / "_CHECKPOINT_METADATA").is_file():
            return None, "it is not a checkpoint written by shardax"
        return None, "it was never sealed: the run stopped while committing it"
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"its manifest {MANIFEST} is unreadable"


def _units(manifest: dict[str, Any]) -> list[tuple[str, int, str, int]]:
    """Every hashed unit, in one order all processes share: (file, block index, digest, block bytes).

    Manifests from before blocks hold one digest per whole file (block bytes 0: the whole file)."""
    block = int(manifest.get("block_bytes", BLOCK))
    units = []
    for name, entry in sorted(manifest["files"].items()):
        if "blocks" in entry:
            units += [(name, index, digest, block) for index, digest in enumerate(entry["blocks"])]
        else:
            units.append((name, 0, entry["sha256"], 0))
    return units


_verified: dict[str, tuple[Any, ...]] = {}  # checkpoints found intact, by what their files' stat said then


def _signature(checkpoint: Path, names: Iterable[str]) -> tuple[Any, ...]:
    stats = [(checkpoint / name).stat() for name in (MANIFEST, *names)]
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats)


def damage(checkpoint: Path, share: tuple[int, int] = (0, 1),
           agree: Callable[[int], int] | None = None, workers: int | None = None) -> str | None:
    """``None`` when every sealed file is as it was sealed, else what is wrong (a short phrase).

    ``share=(i, n)``: this process hashes every n-th block starting at the i-th; ``agree``
    takes this process's first bad unit (or -1) and returns the first over all processes (a
    collective all of them call). Missing files and sizes are checked by every process (cheap).
    A checkpoint found intact is not hashed again while its files' sizes and times are unchanged.
    """
    manifest, problem = _read_manifest(checkpoint)
    if problem is None and not (checkpoint / "_CHECKPOINT_METADATA").is_file():
        problem = "orbax's _CHECKPOINT_METADATA is missing"
    if problem is None:
        assert manifest is not None
        for name, sealed in sorted(manifest["files"].items()):
            path = checkpoint / name
            if not path.is_file():
                problem = f"{name} is missing"
                break
            size = path.stat().st_size
            if size != sealed.get("bytes"):
                problem = f"{name} has {size} bytes, {sealed.get('bytes')} when sealed"
                break
    units = _units(manifest) if problem is None and manifest is not None else []
    signature = _signature(checkpoint, manifest["files"]) if units and manifest is not None else None
    known = signature is not None and _verified.get(str(checkpoint)) == (share, signature)
    mine = [] if known else [k for k in range(len(units)) if k % share[1] == share[0]]

    def bad(k: int) -> bool:
        name, index, digest, block = units[k]
        try:
            return _digest(checkpoint / name, index * block, block or None) != digest
        except OSError:
            return True

    pool = concurrent.futures.ThreadPoolExecutor(workers or _workers())
    try:
        first = next((k for k, wrong in zip(mine, pool.map(bad, mine)) if wrong), -1)
    finally:
        pool.shutdown(cancel_futures=True)
    if first < 0 and signature is not None:  # its resume a moment later need not hash it again
        _verified[str(checkpoint)] = (share, signature)
    if agree is not None:
        first = agree(first)
    if problem is None and 0 <= first < len(units):
        problem = f"{units[first][0]} changed since it was sealed"
    return problem
