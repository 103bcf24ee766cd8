"""A prepared directory's index: what was read with which settings, each split's shards, and
whether a directory is up to date (see ``shardax.data.prepare`` for the layout).

The index is written last, after every shard is in place, so a directory holding an index
holds every shard it lists; each shard's checksum is kept beside its counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardax.data.chat import ChatTemplate
from shardax.data.tokenizer import Tokenizer
from shardax.errors import UsageError

FORMAT = 1
INDEX = "index.json"
TOKENIZER = "tokenizer.json"


def input_listing(files: Sequence[Path]) -> list[list[Any]]:
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def describe_changes(old: list[list[Any]], new: list[list[Any]]) -> str:
    before, after = {p: (s, m) for p, s, m in old}, {p: (s, m) for p, s, m in new}
    added = len(after.keys() - before.keys())
    removed = len(before.keys() - after.keys())
    changed = sum(before[p] != after[p] for p in before.keys() & after.keys())
    return f"inputs changed ({added} added, {removed} removed, {changed} modified)"


def read_index(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / INDEX).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"{root / INDEX} is unreadable ({error}); run shardax prepare again into "
                         "it") from None


def shard_digest(path: Path) -> str:
    """A shard's checksum (BLAKE2b, 16 bytes), recorded in the index and verified when the shard is first
    read."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def shard_files(name: str) -> list[str]:
    return [f"{name}.tokens", f"{name}.docs.npy", f"{name}.mask"]  # (a mask for conversations only)


def rebuild_reason(root: Path, old: dict[str, Any] | None, settings: dict[str, Any],
                    listing: list[list[Any]], tokenizer: str, overwrite: bool) -> str | None:
    """Why ``root`` is to be (re)built with these settings and inputs; None when it is up to date."""
    if old is not None:
        if old.get("settings") == settings and old.get("inputs") == listing:
            return None
        if old.get("settings", {}).get("tokenizer") != settings["tokenizer"] and not overwrite:
            raise UsageError(f"{root} holds shards made with tokenizer {old.get('tokenizer_name')}, "
                             f"not {tokenizer!r}; prepare into another directory, "
                             "or pass --overwrite to replace them")
        if old.get("settings") != settings:
            return "settings changed"
        return describe_changes(old.get("inputs", []), listing)
    if root.exists() and (not root.is_dir() or any(p.name != ".building" for p in root.iterdir())):
        # (only the .building/ of a prepare that was killed: prepare clears it and builds anew)
        raise UsageError(f"{root} exists and is not a prepared data directory (no {INDEX}); "
                         "choose a new or empty one")
    return "new"


def make_index(settings: dict[str, Any], listing: list[list[Any]], skipped: list[str], chosen: Tokenizer,
                dtype: str, splits: dict[str, list[dict[str, Any]]],
                chat: ChatTemplate | None = None, kind: str | None = None) -> dict[str, Any]:
    """The contents of ``index.json``: settings, inputs, tokenizer and each split's totals and
    shards; for conversations, the template's name and the tokens the loss learns (``trained``)."""
    totals = ("tokens", "documents", "bytes") + (("trained",) if chat else ())
    return {"format": FORMAT, "settings": settings, "inputs": listing, "skipped": skipped,
            "tokenizer_name": chosen.name, "tokenizer": chosen.fingerprint, "vocab_size": chosen.vocab_size,
            "eod_id": chosen.eod_id, "dtype": dtype,
            **({"kind": kind, "chat_template": chat.where} if chat else {}),
            "splits": {split: {**{key: sum(s.get(key, 0) for s in shards) for key in totals},
                               "shards": shards}
                       for split, shards in splits.items()}}


def publish(root: Path, folder: Path, old: dict[str, Any] | None, index: dict[str, Any]) -> None:
    """Replace ``root``'s shards by those built in ``folder``, the index written last."""
    (root / INDEX).unlink(missing_ok=True)  # from here on the directory is not a complete prepared set
    for stale in (old or {}).get("splits", {}).values():
        for shard in stale.get("shards", []):
            for file in shard_files(shard["name"]):
                (root / file).unlink(missing_ok=True)
    for file in folder.iterdir():
        file.replace(root / file.name)
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    (folder / INDEX).replace(root / INDEX)
