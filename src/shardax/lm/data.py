"""The LM job's data: bytes of text held in memory (the default), or token shards read lazily,
each read as its data format says (``shardax.data.registry``; shardax's own in
``shardax.data.formats``).

``open_data`` chooses: a ``--data`` directory written by ``shardax prepare`` is read in the
format its index names; ``--tokenizer`` (or records of a format of examples: conversations,
preference pairs) tokenizes the inputs into shards first (in a cache directory, once); otherwise
the text is read into memory as bytes, as the two-command default run does with the standard
library. Every format gives the Trainer a batch function of the step, fixed validation batches,
what to train (a loss, or a step over the model and a frozen copy of it) and the baselines its
loss is set beside.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import jax

from shardax.data.corpus import default_sources
from shardax.data.documents import input_files
from shardax.data.index import INDEX, read_index
from shardax.data.prepare import prepare
from shardax.data.registry import DataFormat, detect_format, get_format, prepared_format, text_format
from shardax.errors import UsageError


def cache_root() -> Path:
    return Path(os.environ.get("SHARDAX_DATA_CACHE") or Path.home() / ".cache" / "shardax" / "data")


def _prepared_directory(paths: list[str] | None) -> Path | None:
    if paths and len(paths) == 1 and (Path(paths[0]) / INDEX).is_file():
        return Path(paths[0])
    return None


def _opened(root: Path, source: str | None = None) -> DataFormat:
    """A prepared directory as the data of a run, in the format its index names."""
    index = read_index(root) or {}
    return prepared_format(index.get("kind"), root)(root, source)


def _check_tokenizer_matches(data: DataFormat, prepared: Path, tokenizer: str,
                             vocab_size: int | None) -> None:
    wanted = {"kind": "file"} if tokenizer not in ("bytes", "bpe") else {"kind": tokenizer}
    made = data.data.index["settings"]["tokenizer"]
    if made["kind"] != wanted["kind"] or (vocab_size and made.get("vocab_size") != vocab_size):
        raise UsageError(f"--data {prepared} holds shards made with {data.data.index['tokenizer_name']}, not "
                         f"--tokenizer {tokenizer}" + (f" --vocab-size {vocab_size}" if vocab_size else "")
                         + "; drop --tokenizer to train on them, or prepare the text again")


def _read_format(paths: list[str] | None, field: str) -> type[DataFormat] | None:
    """The format of ``--data``'s records (None: none told; what else it may be, the text reader says)."""
    try:
        return detect_format(input_files(paths)[0], field) if paths else None
    except UsageError:
        return None


def open_data(paths: list[str] | None, tokenizer: str | None, vocab_size: int | None, field: str | None,
              seq_len: int, template: str | None = None,
              data_format: str | None = None) -> DataFormat:
    """The data a run reads (see the module docstring); ``data_format``: a format's name or
    ``module:Class`` (None: read off the files). Examples (conversations of ``messages`` or
    ``prompt``/``completion``, preference pairs) render with ``template`` (default: the
    tokenizer's own, else the built-in one). Only process 0 prepares; the others wait for it and
    then read the same shards, which must be on storage they share."""
    given = get_format(data_format) if data_format else None  # (a format of the user's: imported here)
    prepared = _prepared_directory(paths)
    if prepared is not None:
        data = _opened(prepared)
        if tokenizer is not None:
            _check_tokenizer_matches(data, prepared, tokenizer, vocab_size)
        return data
    kind = given or _read_format(paths, field or "text")
    if tokenizer is None and paths and kind is not None and kind.examples:
        tokenizer = "bytes"  # conversations and pairs are read as examples, from shards
    if tokenizer is None:
        if vocab_size is not None:
            raise UsageError(f"--vocab-size {vocab_size} needs --tokenizer bpe")
        return text_format()(paths, seq_len)
    inputs = [str(p) for p in default_sources() if p.stat().st_size] if not paths else paths
    key = json.dumps([sorted(str(Path(p).resolve()) for p in inputs), tokenizer, vocab_size, field or "text"]
                     + ([str(Path(template).resolve())] if template else [])
                     + ([data_format] if data_format else []))
    root = cache_root() / hashlib.sha256(key.encode()).hexdigest()[:16]
    if jax.process_index() == 0:
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.with_name(root.name + ".lock"), "w") as lock:  # two runs on one machine prepare once
            fcntl.flock(lock, fcntl.LOCK_EX)
            prepare(inputs, root, tokenizer=tokenizer, vocab_size=vocab_size, field=field or "text",
                    template=template, data_format=data_format or "auto")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("shardax data prepared")
    return _opened(root, None if paths else "the Python standard library")
