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
writers may still run in other threads, and the interpreter's teardown of them crashed too.

A signal's exception can be lost where it is raised: the handler ran inside a finalizer, a callback
such as JAX's garbage-collection hook, or code that catches everything. The signal is then raised
again every second (``RETRY_S``) until it ends the command (without the traceback Python prints for
an exception a finalizer lost), and the Trainer, as it takes the signals over, takes a stop still
pending (``take_pending_stop``) and honours it before training begins. A command that still runs to
its end exits by the signal all the same.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

from shardax.errors import EXIT_STOPPED, Stopped

received: list[str] = []  # every stop signal this process received through these handlers
_command = ["shardax"]  # how the lines name the command (``shardax train``)
_deferring = [0]  # how deep inside ``deferred`` the main thread is
_settled = [True]  # the received signal is acted upon (the command ends by it, or the Trainer took it over)
_again = [False]  # the next call of the handler raises the received signal again (not a second signal)
_retrying = [True]  # whether a swallowed signal is raised again (not where the command catches it itself)
_commands = [0]  # how many commands this process started (``install``): a retry serves its own only
_unraisable_hook = [sys.unraisablehook]  # the hook ``install`` replaced, put back by ``finish``
# commands that catch a signal's exception themselves: ``launch`` passes SIGTERM on to its processes
# on the first Ctrl-C and waits for them to checkpoint (a second one stops them at once)
CATCHING_COMMANDS = ("launch",)
RETRY_S = 1.0  # how often a signal whose exception was swallowed is raised again


def install() -> None:
    """SIGINT and SIGTERM stop the command (in the main thread, the only one signals reach)."""
    received.clear()
    _command[0] = "shardax"
    _settled[0], _again[0], _retrying[0] = False, False, True
    _commands[0] += 1
    if sys.unraisablehook is not _unraisable:
        _unraisable_hook[0], sys.unraisablehook = sys.unraisablehook, _unraisable
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, _stop)


def name_command(command: str) -> None:
    """How the lines name the command, once it is parsed (``shardax train``)."""
    _command[0] = f"shardax {command}"
    _retrying[0] = command not in CATCHING_COMMANDS


def finish() -> None:
    """The command is over (it returned, or ends by a signal): a received signal is not raised again."""
    _settled[0] = True
    if sys.unraisablehook is _unraisable:
        sys.unraisablehook = _unraisable_hook[0]


def _unraisable(unraisable: Any) -> None:
    """An exception a finalizer or callback lost: said as Python says it, except the signal's,
    which is raised again (``_raise_again``)."""
    if not (isinstance(unraisable.exc_value, Stopped) and _retrying[0] and not _settled[0]):
        _unraisable_hook[0](unraisable)


def _stop(number: int, frame: FrameType | None) -> None:
    name = signal.Signals(number).name
    if _again[0]:  # the received signal again (see _raise_again), not a second one
        _again[0] = False
        if not _deferring[0] and not _settled[0]:
            raise Stopped(received[-1])
        return
    received.append(name)
    if len(received) > 1:  # asked again: now, from wherever the process is
        os.write(2, f"{_command[0]}: stopped by {name} at once (asked twice)\n".encode())
        os._exit(EXIT_STOPPED[name])
    if _retrying[0]:
        threading.Thread(target=_raise_again, args=(number, _commands[0]), name="shardax-signal",
                         daemon=True).start()
    if not _deferring[0]:
        raise Stopped(name)


def _raise_again(number: int, command: int) -> None:
    """Until the received signal is acted upon, raise it again in the main thread every ``RETRY_S``
    (where its exception was swallowed, the command went on; inside ``deferred``, it waits)."""
    while True:
        time.sleep(RETRY_S)
        if _settled[0] or _commands[0] != command or signal.getsignal(number) is not _stop:
            return  # acted upon, or the command is over (and its handlers restored)
        if not _deferring[0]:
            _again[0] = True
            _thread.interrupt_main(number)  # the handler runs in the main thread, as for the signal


def take_pending_stop() -> str | None:
    """The name of a stop signal received and not yet acted upon (its exception was swallowed), for
    whoever takes the signals over to honour (the Trainer, as it starts); None when there is none.
    Taken, it is no longer raised again."""
    if _settled[0] or not received:
        return None
    _settled[0] = True
    return received[-1]


_stop.take_pending_stop = take_pending_stop  # type: ignore[attr-defined]  (found on the handler replaced)


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
    finish()
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
