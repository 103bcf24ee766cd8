"""Where ``shardax prepare`` builds: a private folder beside the output, so that a refused or failed
prepare leaves the output folder, and the folders above it, as they were.

    data/.shards.building-1f2e3d4c/    shards being written for data/shards/, renamed into place
                                       (or moved into an existing data/shards/) once complete

A prepare holds a lock on its folder while it runs; the operating system drops it when the process
ends, however it ends, so a folder no one holds was left by a prepare killed mid-way, and the next
prepare into the same output clears it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

ABANDONED_AFTER_S = 60  # unheld for this long: left by a killed prepare (a live one locks its folder at once)


def _prefix(root: Path) -> str:
    return f".{root.absolute().name}.building-"


def _new_folder(root: Path) -> Path:
    """A folder of a name no other prepare has, beside ``root`` (with the usual permissions: it may
    become ``root`` itself)."""
    while True:
        folder = root.absolute().parent / f"{_prefix(root)}{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


@contextlib.contextmanager
def staging(root: Path) -> Iterator[Path]:
    """A new folder beside ``root`` to build in, held while the block runs; it goes at the end, with
    the folders made for it, unless the block renamed it (into ``root``)."""
    parent = root.absolute().parent
    made = [folder for folder in (parent, *parent.parents) if not folder.exists()]  # innermost first
    parent.mkdir(parents=True, exist_ok=True)
    try:
        folder = _new_folder(root)
        held = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # (gone already where it became root)
            os.close(held)
    finally:
        for above in made:
            with contextlib.suppress(OSError):  # not empty: something else is in it now
                above.rmdir()


def clear_abandoned(root: Path) -> None:
    """Remove the staging folders beside ``root`` that prepares killed mid-way left: those no
    process holds, unchanged for a minute."""
    for folder in root.absolute().parent.iterdir():
        if not folder.name.startswith(_prefix(root)) or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            held = os.open(folder, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused while a live prepare holds it
            if time.time() - folder.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue
        finally:
            os.close(held)
