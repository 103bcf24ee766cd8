"""A small conversation set made from the Python standard library's own docstrings.

Supervised fine-tuning needs conversations, and nothing may be downloaded at run time. Each
conversation here asks what a standard-library function or class does and answers with the
first paragraph of its docstring (some with a system message, some with a second question):
about a thousand conversations, the same on every machine with the same Python. ``--data
python-chats`` names it wherever shardax reads data (``train``, ``prepare``); ``python-pairs``
names the same questions as preference pairs for DPO (the right answer chosen, another name's
rejected). Each JSON-lines file is written once into shardax's data cache.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import re
import sys
from pathlib import Path

NAME = "python-chats"
PAIRS = "python-pairs"
MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "configparser", "contextlib", "copy",
           "csv", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "glob",
           "gzip", "hashlib", "heapq", "html", "ipaddress", "itertools", "json", "logging", "math",
           "operator", "os.path", "pathlib", "pprint", "queue", "random", "re", "secrets", "shlex",
           "shutil", "statistics", "string", "struct", "tempfile", "textwrap", "threading", "traceback",
           "urllib.parse", "uuid", "zipfile", "zlib")
QUESTIONS = ("What does `{}` do?", "Explain `{}` in one paragraph.", "What is `{}` for?",
             "Can you tell me what `{}` does?")
SYSTEM = "You answer questions about Python's standard library in one short paragraph."


def _answer(thing: object) -> str | None:
    """The first paragraph of ``thing``'s docstring on one line, or None when it has none worth asking."""
    doc = inspect.getdoc(thing)
    if not doc:
        return None
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    if len(paragraph) < 20 or not re.search(r"[a-z]{3}", paragraph) or paragraph.endswith(":"):
        return None
    return paragraph[:400]


def _public(namespace: object) -> list[tuple[str, object]]:
    return [(name, value) for name, value in sorted(vars(namespace).items()) if not name.startswith("_")]


def questions() -> list[tuple[str, str]]:
    """``(qualified name, answer)`` for each public function, class and method of ``MODULES``
    with a docstring (of its own: a method's that only repeats its base class's is left out)."""
    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        own = (module.__name__, "_" + module.__name__, module_name)
        for name, thing in _public(module):
            named = inspect.isroutine(thing) or inspect.isclass(thing)
            if not named or getattr(thing, "__module__", None) not in own:
                continue  # a constant, or imported from elsewhere
            found += [(f"{module_name}.{name}", answer)] if (answer := _answer(thing)) else []
            if inspect.isclass(thing):
                for method, member in _public(thing):
                    inherited = any(method in vars(base) for base in thing.__mro__[1:])
                    if inspect.isroutine(member) and not inherited and (answer := _answer(member)):
                        found.append((f"{module_name}.{name}.{method}", answer))
    return found


def conversations() -> list[dict[str, list[dict[str, str]]]]:
    """The conversations, in a fixed order."""
    chooser = random.Random(0)
    pairs = questions()
    made = []
    for number, (name, answer) in enumerate(pairs):
        messages = [{"role": "system", "content": SYSTEM}] if number % 5 == 0 else []
        messages += [{"role": "user", "content": chooser.choice(QUESTIONS).format(name)},
                     {"role": "assistant", "content": answer}]
        if number % 7 == 3:  # a second turn, about the next name
            other, other_answer = pairs[(number + 1) % len(pairs)]
            messages += [{"role": "user", "content": f"And `{other}`?"},
                         {"role": "assistant", "content": other_answer}]
        made.append({"messages": messages})
    return made


def preference_pairs() -> list[dict[str, list[dict[str, str]]]]:
    """Pairs in TRL's conversational form: a question, its docstring's answer (chosen) and the
    answer about another name (rejected), in a fixed order."""
    pairs = questions()
    chooser = random.Random(1)
    made = []
    for number, (name, answer) in enumerate(pairs):
        other = pairs[(number + chooser.randrange(1, len(pairs))) % len(pairs)][1]
        if other == answer:
            continue
        made.append({"prompt": [{"role": "user", "content": chooser.choice(QUESTIONS).format(name)}],
                     "chosen": [{"role": "assistant", "content": answer}],
                     "rejected": [{"role": "assistant", "content": other}]})
    return made


BUILT_IN_SETS = {NAME: conversations, PAIRS: preference_pairs}


def built_in_file(name: str, folder: str | Path | None = None) -> Path:
    """The built-in set ``name`` (``python-chats`` or ``python-pairs``) as a JSON-lines file,
    written once per Python version in ``folder`` (default: shardax's data cache,
    ``$SHARDAX_DATA_CACHE`` or ``~/.cache/shardax/data``)."""
    folder = Path(folder or os.environ.get("SHARDAX_DATA_CACHE") or Path.home() / ".cache/shardax/data")
    path = folder / f"{name}-{sys.version_info.major}.{sys.version_info.minor}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text("".join(json.dumps(record) + "\n" for record in BUILT_IN_SETS[name]()))
        partial.replace(path)
    return path
