"""How every ``shardax`` command ends: its exit codes, and bad input as one line on stderr.

| code | meaning |
|---|---|
| 0 | done |
| 1 | a bug: an unexpected exception, printed with its traceback |
| 2 | bad input (a ``UsageError``): one line saying what was given, what was expected, the fix |
| 3 | the JAX cluster could not form (see ``shardax.distributed``) |
| 4 | a step's loss or gradient norm was not finite; the last good checkpoint is kept |
| 75 | stopped by SIGTERM/SIGINT after writing a checkpoint: run again with ``--resume`` |
| 130, 143 | stopped by SIGINT, SIGTERM where no step could be finished and saved first (before training began, after it ended, or a second signal): the line says what was written |
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
import warnings
from typing import Any

from shardax.errors import (
    EXIT_CLUSTER,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    ClusterError,
    NonFiniteError,
    Preempted,
    UsageError,
)

EXIT_BAD_INPUT = 2

__all__ = ["EXIT_BAD_INPUT", "EXIT_CLUSTER", "EXIT_NONFINITE", "EXIT_PREEMPTED", "ClusterError",
           "NonFiniteError", "Preempted", "UsageError", "end_cluster_wait", "in_flags",
           "quiet_failed_writers", "silence_abandoned_writers"]

# a library parameter given a value, as its errors write it: `seq_len=30`, `mesh='data=2,context=4'`
_PARAMETER = re.compile(r"`(?P<name>[a-z][a-z_]*)=(?P<value>[^`]+)`")
# library parameters a command's flag spells differently
_RENAMED = {"compute_dtype": "precision"}


def in_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """A library error as the command line says it: each `` `parameter=value` `` that one of
    ``parser``'s flags sets becomes ``--flag value`` (`` `seq_len=30` `` -> ``--seq-len 30``)."""
    flags = {}
    for action in parser._actions:  # noqa: SLF001 - argparse lists a parser's flags nowhere else
        long = [option for option in action.option_strings if option.startswith("--")]
        if long and action.nargs != 0:
            flags.setdefault(action.dest, long[0])
    for name, dest in _RENAMED.items():
        if dest in flags:
            flags.setdefault(name, flags[dest])

    def spell(match: re.Match) -> str:
        flag, value = flags.get(match["name"]), match["value"]
        if flag is None:
            return match[0]
        if value[:1] in "'\"" and " " not in value:
            value = value[1:-1]
        return f"{flag} {value}"

    return _PARAMETER.sub(spell, message)


def end_cluster_wait(message: str) -> None:
    """The command line owns its process: when the cluster does not form while JAX waits inside
    ``jax.distributed.initialize`` (which nothing can interrupt, and which would abort with a
    stack dump), say why in one line and end the process with ``EXIT_CLUSTER``."""
    print(f"shardax: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CLUSTER)


def quiet_failed_writers() -> None:
    """When a checkpoint write fails, orbax's other writer threads fail again as they wind down
    ("Event loop is closed", from threads and at interpreter exit). The command line installs
    this filter for the process it owns, so that the failure is said once; the library changes
    no process-wide state (hooks, logger levels, warning filters) itself."""
    previous, previous_unraisable = threading.excepthook, sys.unraisablehook

    def closed_loop(error: BaseException | None) -> bool:
        return isinstance(error, RuntimeError) and "Event loop is closed" in str(error)

    def hook(args: threading.ExceptHookArgs) -> None:
        if not closed_loop(args.exc_value):
            previous(args)

    def unraisable(info: Any) -> None:
        if not closed_loop(info.exc_value):
            previous_unraisable(info)

    threading.excepthook, sys.unraisablehook = hook, unraisable

    def not_a_failed_write(record: logging.LogRecord) -> bool:  # the failure is said once, by the command
        text = record.getMessage() + str(record.exc_info[1] if record.exc_info else "")
        return not ("never retrieved" in text and ("os_error_code" in text or "Failed to write" in text))

    logging.getLogger("asyncio").addFilter(not_a_failed_write)


def silence_abandoned_writers() -> None:
    """After the command line has said in one line that a write failed: orbax's abandoned writer
    tasks report it again as they are collected (unawaited coroutines, absl errors at exit)."""
    sys.unraisablehook = lambda unraisable: None
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", category=RuntimeWarning, message=".*was never awaited")
