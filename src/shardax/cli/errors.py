"""How every ``shardax`` command ends: its exit codes, and bad input as one line on stderr.

| code | meaning |
|---|---|
| 0 | done |
| 1 | a bug: an unexpected exception, printed with its traceback |
| 2 | bad input (a ``UsageError``): one line saying what was given, what was expected, the fix |
| 3 | the JAX cluster could not form (see ``shardax.distributed``) |
| 4 | a step's loss or gradient norm was not finite; the last good checkpoint is kept |
| 75 | stopped by SIGTERM/SIGINT after writing a checkpoint: run again with ``--resume`` |
"""

from __future__ import annotations

from shardax.errors import EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteError, Preempted, UsageError

EXIT_BAD_INPUT = 2

__all__ = ["EXIT_BAD_INPUT", "EXIT_NONFINITE", "EXIT_PREEMPTED", "NonFiniteError", "Preempted", "UsageError"]
