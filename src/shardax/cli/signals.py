"""Stop signals outside the training loop: one line, the shell's exit code, no crash.

The command line owns its process. From its first line, SIGINT and SIGTERM stop the command
(before JAX starts, while data is tokenized, while a model is laid out or exported); while
``Trainer.fit`` runs, its own handlers take them (finish the step, checkpoint, exit 75) and
hand them back after. A signal raises ``Stopped`` where Python code runs, except while JAX
and the libraries with compiled extensions are imported and started (``deferred``): an
exception raised inside an extension's initialisation crashed the process (a segmentation
fault), so there the signal is noted and raised once the imports are done, a second or two
later. A second signal ends the process at once, wherever it is.

A stopped command ends the process right after its line (``end``): JAX's compiler and orbax's
writers may still run in other threads, and the interpreter's teardown of them crashed too. A
signal whose exception something swallowed (a finalizer, a callback, an import) is remembered
here, and the command ends by it all the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

from shardax.errors import EXIT_STOPPED, Stopped

received: list[str] = []  # every stop signal this process received through these handlers
_command = ["shardax"]  # how the lines name the command (``shardax train``)
_deferring = [0]  # how deep inside ``deferred`` the main thread is


def install() -> None:
    """SIGINT and SIGTERM stop the command (in the main thread, the only one signals reach)."""
    received.clear()
    _command[0] = "shardax"
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, _stop)


def name_command(command: str) -> None:
    """How the lines name the command, once it is parsed (``shardax train``)."""
    _command[0] = f"shardax {command}"


def _stop(number: int, frame: FrameType | None) -> None:
    name = signal.Signals(number).name
    received.append(name)
    if len(received) > 1:  # asked again: now, from wherever the process is
        os.write(2, f"{_command[0]}: stopped by {name} at once (asked twice)\n".encode())
        os._exit(EXIT_STOPPED[name])
    if not _deferring[0]:
        raise Stopped(name)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A stretch (imports, JAX's start) where a signal is noted, then raised as it ends."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
    if not _deferring[0] and received:
        raise Stopped(received[-1])


def end(stop: BaseException) -> NoReturn:
    """Say in one line how the command stopped, and end the process with the signal's exit code."""
    if isinstance(stop, Stopped):
        line = str(stop)
    else:  # KeyboardInterrupt: the Trainer's answer to a second SIGINT
        line = ("stopped by SIGINT at once (asked twice): the step in progress is lost; checkpoints written "
                "before stay")
    name = stop.signal_name if isinstance(stop, Stopped) else "SIGINT"
    print(f"{_command[0]}: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STOPPED[name])
