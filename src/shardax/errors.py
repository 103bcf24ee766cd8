"""The one error type for what a user gave wrong.

Every check of user input in shardax (settings, meshes, shapes that do not divide, data,
checkpoint directories) raises ``UsageError``: one line saying what was given, what was
expected and how to fix it. The command line prints it as that line and exits 2. Any other
exception is a bug, in shardax or below it, and keeps its traceback. ``UsageError`` is a
``ValueError``, so code that catches ``ValueError`` keeps working.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Something the user gave is wrong; the message says what, what was expected, and the fix."""


class ClusterError(RuntimeError):
    """The JAX cluster could not form (a coordinator that does not answer, a peer that never
    joined); the message says what was expected. The command line exits with ``EXIT_CLUSTER``."""


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient norm was NaN or infinite; its update was not applied."""


class Preempted(SystemExit):
    """The run stopped on SIGTERM/SIGINT after checkpointing; resume it to go on.

    A ``SystemExit`` with code ``EXIT_PREEMPTED`` (75): a script that does not catch it exits
    with that code and no traceback, which schedulers and ``shardax launch`` read as "resume me".
    """

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM where no step can be finished and checkpointed first (before training
    starts, or after it ended). ``where`` says what that means for the run's files."""

    def __init__(self, signal_name: str, where: str = "") -> None:
        super().__init__(signal_name)
        self.signal_name, self.where = signal_name, where

    def __str__(self) -> str:
        return f"stopped by {self.signal_name}" + (f" {self.where}" if self.where else "")


EXIT_CLUSTER = 3
EXIT_NONFINITE = 4
EXIT_PREEMPTED = 75
# the shell's codes for a process that SIGINT or SIGTERM ended (128 + the signal's number)
EXIT_STOPPED = {"SIGINT": 130, "SIGTERM": 143}
