"""How every ``shardax`` command reports bad input: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """A problem with what the user gave; printed as one line, no traceback."""
