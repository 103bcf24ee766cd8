"""One writer per checkpoint directory: a lock the run that writes it holds.

Process 0 of a run takes an exclusive ``flock`` on ``<dir>/.shardax-lock`` and writes who holds
it (host, pid, when) into the file; the run's other processes share it through process 0, which
tells them whether it got it. The operating system drops the lock when its holder dies, however
it dies (SIGKILL included), so a lock left by a dead run is simply taken over (its name still in
the file: the new run says so); a live holder is refused in one line that names it. A run that
ends empties the file as it lets go. The file itself stays (removing it would let a second run
lock a fresh file while the first still holds the old one).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardax.errors import UsageError

LOCK_NAME = ".shardax-lock"


def _holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _agree(acquired: bool) -> bool:
    """Process 0's answer, on every process of the run."""
    if jax.process_count() == 1:
        return acquired
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(acquired)))


class DirectoryLock:
    """The lock on ``directory`` (created if need be); ``acquire`` refuses a live holder."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = None
        self._agreed = False
        self.took_over: dict[str, Any] | None = None  # the holder a dead run left, if any

    @property
    def held(self) -> bool:
        """Whether this run holds the lock (on every process: process 0 holds the file, and the
        others were told so)."""
        return self._agreed

    def check_free(self) -> None:
        """Refuse, as ``acquire`` would, while a live run holds the lock; take and keep nothing."""
        if self._agreed:
            return
        refusal = self._try(claim=False) if jax.process_index() == 0 and self.path.exists() else None
        self._settle(refusal)

    def acquire(self) -> None:
        if self._agreed:
            return
        refusal = self._try() if jax.process_index() == 0 else None
        self._settle(refusal)
        self._agreed = True

    def _settle(self, refusal: str | None) -> None:
        """Every process of the run learns process 0's answer (a collective: all of them call this)."""
        if not _agree(refusal is None):
            self.release()
            raise UsageError(refusal or f"checkpoint directory {self.directory} is being written by another "
                             "run (process 0 of this run was refused its lock); wait for it, stop it, or "
                             "choose another checkpoint directory")

    def _try(self, claim: bool = True) -> str | None:
        """Take the lock (process 0), or say who holds it; with ``claim`` False, let it go again."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            return (f"checkpoint directory {self.directory} cannot hold its lock file ({error.strerror}); "
                    "give a directory you can write to")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = _holder(self.path)
            who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
                   f"{holder.get('since', '?')}"
                   if holder else "a process that has not yet said who it is")
            return (f"checkpoint directory {self.directory} is being written by another run ({who}); two "
                    "runs writing one directory would replace each other's checkpoints: wait for it to "
                    "finish, stop it, or choose another checkpoint directory")
        if not claim:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return None
        previous = _holder(self.path)
        if previous:
            self.took_over = previous
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "processes": jax.process_count()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        self._agreed = False
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)  # an empty lock file: its last holder let go (a dead one leaves its name)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            finally:
                os.close(fd)
