"""A plug-in named on the command line as ``module:name``: a model factory, a data format, a reward.

The module is imported as ``python -m`` would find it (the current directory or ``PYTHONPATH``);
whatever goes wrong is one line that says what was given and what was expected.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from shardax.errors import UsageError


def said(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return type(error).__name__ + (f": {text[0]}" if text else "")


def import_named(spec: str, flag: str, kind: str, example: str) -> tuple[Any, str, str]:
    """``(the attribute, its module's name, the attribute's name)`` that ``spec`` (``module:name``)
    names; None for the attribute when the module has no such name. ``flag``, ``kind`` and
    ``example`` (for instance ``"--model"``, ``"function"`` and ``"my_lm:build"``) word the errors."""
    module_name, colon, name = spec.partition(":")
    if not colon or not name.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
        module, attribute = example.split(":")
        raise UsageError(f"{flag} {spec}: expected module:{kind}, e.g. {example} (the {kind.lower()} "
                         f"{attribute} of {module}.py, in the current directory or on PYTHONPATH)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # as `python -m` would: a module beside the user is found
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module: whatever it raises is theirs, said in one line
        missing = (isinstance(error, ModuleNotFoundError)  # the module itself, not one it imports
                   and (error.name or "").split(".")[0] == module_name.split(".")[0])
        hint = " (is it in the current directory or on PYTHONPATH?)" if missing else ""
        raise UsageError(f"{flag} {spec}: the module {module_name} does not import: "
                         f"{said(error)}{hint}") from None
    return getattr(module, name, None), module_name, name
