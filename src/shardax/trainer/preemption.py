"""SIGTERM and SIGINT during ``Trainer.fit``: finish the step, checkpoint, exit 75 (resume me).

From the moment ``fit`` starts (a checkpoint being restored, the first step compiling) to its
final checkpoint, a signal is noted and said at once, and the run stops after the step in
progress (or, once the last step ran, after its checkpoint is written).

Clusters and spot machines preempt a job with SIGTERM. On one process the signal sets a flag
that the loop reads after each step. With several processes the step to stop at must be the
same everywhere: JAX's preemption service (started by ``jax.distributed.initialize``) catches
SIGTERM in any process, tells the others, and ``reached_preemption_sync_point(step)`` becomes
true at the same step on every process. SIGINT (Ctrl-C) is turned into that same SIGTERM. A
second SIGINT on one process interrupts at once (``KeyboardInterrupt``).

The handlers replaced may hold a stop they could not act upon: the command line's raise an
exception where the signal comes, and something (a finalizer, a library's callback) may have
swallowed it. A replaced handler with a ``take_pending_stop()`` that names a signal hands it over,
and training does not begin: ``Stopped`` is raised before anything of the run is done.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import jax

from shardax.errors import Stopped


class StopSignals:
    """A context in which SIGTERM/SIGINT ask the training loop to stop after the current step."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only; a loop elsewhere is stopped by its owner
        _honour_pending_stop()
        if jax.process_count() > 1:  # SIGTERM stays with JAX's preemption service
            self._install(signal.SIGINT, self._to_sigterm)
        else:
            self._install(signal.SIGTERM, self._note)
            self._install(signal.SIGINT, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _install(self, number: int, handler: Any) -> None:
        self._previous[number] = signal.signal(number, handler)

    def _note(self, number: int, frame: FrameType | None) -> None:
        if self.received is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.received = signal.Signals(number).name
        # said at once (a first step may still be compiling); a raw write, safe inside a handler
        os.write(2, f"{self.received}: stopping after the step in progress (SIGINT again stops "
                    "at once)\n".encode())

    def _to_sigterm(self, number: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(number).name
        os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """Whether to stop after ``step`` (the same answer on every process)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            stop = multihost_utils.reached_preemption_sync_point(step)
            if stop and self.received is None:
                self.received = "SIGTERM"
            return stop
        return self.received is not None


def _honour_pending_stop() -> None:
    """A stop signal the handlers about to be replaced received and could not act upon, now."""
    for number in (signal.SIGTERM, signal.SIGINT):
        take = getattr(signal.getsignal(number), "take_pending_stop", None)
        pending = take() if callable(take) else None
        if pending is not None:
            raise Stopped(pending)
