"""``shardax prepare``: tokenize a corpus once into token shards on disk, with an index.

Layout of a prepared directory::

    index.json                 what was read, with which tokenizer; per split: shards, documents, tokens,
                               bytes
    tokenizer.json             the tokenizer itself (bytes, or a Hugging Face tokenizer)
    train-00000.tokens         the split's documents, each as [end-of-document, its tokens...], raw
                               uint16/uint32
    train-00000.docs.npy       int64 offsets of each document's start in that file, then the file's length
    validation-00000.tokens    documents held out by a hash of their text (the same split on every machine)
    train-00000.mask           conversations only: 1 for each token the loss learns (the assistant's), uint8
    chat_template.jinja        conversations only: the template they were rendered with

Every document starts with the end-of-document token, so a stream of them reads
``<eod> doc <eod> doc ...``: the token that ends one document begins the next, and a window cut
anywhere in the stream knows where documents start. Units of input (about 16 MB each) are
tokenized in parallel, one shard per unit and split, in input order. The shards are written in a
private folder beside the output (``.OUT.building-*``, hidden) and moved into place at the end, so a
refused or failed run leaves the output folder as it was (a new one, and the folders above it, are
not created). Running again on unchanged inputs with the same settings does nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardax.data.chat import ChatTemplate
from shardax.data.conversations import conversation_settings, supervised_tokens
from shardax.data.documents import Piece, input_files, plan_units, read_piece, read_records
from shardax.data.index import (
    FORMAT,
    INDEX,
    TOKENIZER,
    input_listing,
    make_index,
    publish,
    read_index,
    rebuild_reason,
    shard_digest,
    shard_files,
)
from shardax.data.registry import DataFormat, get_format
from shardax.data.staging import clear_abandoned, staging
from shardax.data.tokenizer import (
    END_OF_DOCUMENT,
    ByteTokenizer,
    Tokenizer,
    check_bpe_vocab,
    from_json,
    load_tokenizer,
    train_bpe,
)
from shardax.errors import UsageError

SPLITS = ("train", "validation")
BPE_SAMPLE_BYTES = 64 << 20  # text a BPE tokenizer is trained on, at most (from the training split)
ENCODE_BATCH = 512  # documents per call to the tokenizer


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What ``prepare`` did: the directory, its index, and whether it was (re)built."""

    root: Path
    index: dict[str, Any]
    built: bool
    reason: str  # why it was built, or why not


def is_validation(text: str, fraction: float) -> bool:
    """Held out by a hash of the document's text: the same on every machine, in any input order."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _tokenizer_request(tokenizer: str, vocab_size: int | None) -> dict[str, Any]:
    if tokenizer == "bytes":
        if vocab_size is not None:
            raise UsageError(f"--vocab-size {vocab_size} applies to --tokenizer bpe; bytes have 256 (+1)")
        return {"kind": "bytes"}
    if tokenizer == "bpe":
        check_bpe_vocab(vocab_size or 4096)
        return {"kind": "bpe", "vocab_size": vocab_size or 4096}
    if vocab_size is not None:
        raise UsageError(f"--vocab-size {vocab_size} applies to --tokenizer bpe, not to a tokenizer file")
    path = Path(tokenizer)
    if not path.is_file():
        raise UsageError(f"--tokenizer {tokenizer!r} is neither 'bytes', 'bpe' nor a tokenizer.json file")
    return {"kind": "file", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16], "path": str(path)}


def _documents(units: Sequence[Sequence[Piece]], field: str) -> Iterator[str]:
    for unit in units:
        for piece in unit:
            yield from read_piece(piece, field)


def _bpe_sample(units: Sequence[Sequence[Piece]], field: str, fraction: float) -> Iterator[str]:
    taken = 0
    for text in _documents(units, field):
        if is_validation(text, fraction):
            continue
        yield text
        taken += len(text)
        if taken >= BPE_SAMPLE_BYTES:
            return


_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


def _encoded(unit: Sequence[Piece], tokenizer: Tokenizer, field: str, template: ChatTemplate | None,
             kind: type[DataFormat]) -> Iterator[tuple[str, str, np.ndarray, np.ndarray | None]]:
    """Each document of ``unit`` as (the text its split is drawn from, its text, its ids, None);
    for a format of examples, each sequence of each record as (..., its loss mask), the sequences
    of one example (a pair's chosen and rejected) in the split of the first one's text."""
    if kind.examples:
        for piece in unit:
            for where, record in read_records(piece):
                sides = kind.sequences(record, template, where)
                for text, spans in sides:
                    yield (sides[0][0], text, *supervised_tokens(tokenizer, text, spans))
        return
    pending: list[str] = []
    for piece in unit:
        for text in read_piece(piece, field):
            pending.append(text)
            if len(pending) >= ENCODE_BATCH:
                yield from ((text, text, ids, None)
                            for text, ids in zip(pending, tokenizer.encode_batch(pending)))
                pending = []
    yield from ((text, text, ids, None) for text, ids in zip(pending, tokenizer.encode_batch(pending)))


def _tokenize_unit(number: int, unit: Sequence[Piece], tokenizer_json: str, end_of_document: str, field: str,
                   fraction: float, folder: str, dtype: str, template: ChatTemplate | None = None,
                   kind: type[DataFormat] | None = None) -> dict[str, dict[str, int]]:
    """Write ``train-NNNNN`` and ``validation-NNNNN`` for one unit (with a ``.mask`` of the tokens
    the loss learns, for a format of examples; ``kind`` None: documents); their counts."""
    kind = kind or get_format("documents")
    if tokenizer_json not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[tokenizer_json] = from_json(tokenizer_json, "tokenizer.json", end_of_document)
    tokenizer = _WORKER_TOKENIZERS[tokenizer_json]
    eod = np.asarray([tokenizer.eod_id], dtype)
    counts = {split: {"tokens": 0, "documents": 0, "bytes": 0} for split in SPLITS}
    offsets: dict[str, list[int]] = {split: [] for split in SPLITS}
    names = {split: Path(folder) / f"{split}-{number:05d}" for split in SPLITS}
    handles = {split: open(names[split].with_suffix(".tokens"), "wb") for split in SPLITS}
    masks = {split: open(names[split].with_suffix(".mask"), "wb") for split in SPLITS} if template else {}
    try:
        for drawn, text, ids, mask in _encoded(unit, tokenizer, field, template, kind):
            split = "validation" if is_validation(drawn, fraction) else "train"
            offsets[split].append(counts[split]["tokens"])
            handles[split].write(eod.tobytes() + ids.astype(dtype).tobytes())
            if mask is not None:
                masks[split].write(b"\0" + mask.astype(np.uint8).tobytes())
                counts[split]["trained"] = counts[split].get("trained", 0) + int(mask.sum())
            counts[split]["tokens"] += 1 + ids.size
            counts[split]["documents"] += 1
            counts[split]["bytes"] += 1 + len(text.encode("utf-8"))
    finally:
        for handle in [*handles.values(), *masks.values()]:
            handle.close()
    for split in SPLITS:
        np.save(names[split].with_suffix(".docs.npy"),
                np.asarray(offsets[split] + [counts[split]["tokens"]], np.int64))
    return counts


def _all_in_train(folder: Path, splits: dict[str, list[dict[str, Any]]]) -> None:
    """When hashing held out every document, they are the training split (some are held out next)."""
    if splits["train"]:
        return
    splits["train"], splits["validation"] = splits["validation"], []
    for shard in splits["train"]:
        new = shard["name"].replace("validation-", "train-")
        for old_file, new_file in zip(shard_files(shard["name"]), shard_files(new)):
            if (folder / old_file).exists():
                (folder / old_file).rename(folder / new_file)
        shard["name"] = new


def _hold_out_examples(folder: Path, splits: dict[str, list[dict[str, Any]]], dtype: str,
                       kind: type[DataFormat]) -> None:
    """Examples of ``kind`` (each of its ``sequences_per_example`` sequences): when hashing held
    none out, the last one is the validation split, never a piece of one."""
    _all_in_train(folder, splits)
    last = splits["train"][-1]
    offsets = np.load(folder / f"{last['name']}.docs.npy")
    whole = kind.sequences_per_example
    if len(offsets) - 1 <= whole:
        raise UsageError(f"--data holds a single {kind.example}; give at least two (one is held out to "
                         "validate on)")
    cut, name = int(offsets[-1 - whole]), last["name"].replace("train-", "validation-")
    for suffix, kind in ((".tokens", dtype), (".mask", np.uint8)):
        values = np.fromfile(folder / f"{last['name']}{suffix}", kind)
        values[cut:].tofile(folder / f"{name}{suffix}")
        values[:cut].tofile(folder / f"{last['name']}{suffix}")
        if suffix == ".mask":
            held, kept = int(values[cut:].sum()), int(values[:cut].sum())
    np.save(folder / f"{name}.docs.npy", offsets[-1 - whole:] - cut)
    np.save(folder / f"{last['name']}.docs.npy", offsets[:-whole])
    share = (int(offsets[-1]) - cut) / max(int(offsets[-1]), 1)
    splits["validation"] = [{"name": name, "tokens": int(offsets[-1]) - cut, "documents": whole,
                             "bytes": int(round(last["bytes"] * share)), "trained": held}]
    last.update(tokens=cut, documents=last["documents"] - whole, trained=kept,
                bytes=int(round(last["bytes"] * (1 - share))))


def _hold_out_tail(folder: Path, splits: dict[str, list[dict[str, Any]]], dtype: str, eod: int) -> None:
    """When hashing held out no document (a tiny corpus), hold out the last one, or the last tenth of
    the only one, as the validation split."""
    _all_in_train(folder, splits)
    last = splits["train"][-1]
    tokens = np.fromfile(folder / f"{last['name']}.tokens", dtype)
    offsets = np.load(folder / f"{last['name']}.docs.npy")
    cut = int(offsets[-2]) if len(offsets) > 2 else max(1, int(tokens.size * 0.9))
    held = tokens[cut:] if len(offsets) > 2 else np.concatenate([np.asarray([eod], dtype), tokens[cut:]])
    kept = tokens[:cut]
    name = last["name"].replace("train-", "validation-")
    held.tofile(folder / f"{name}.tokens")
    np.save(folder / f"{name}.docs.npy", np.asarray([0, held.size], np.int64))
    kept.tofile(folder / f"{last['name']}.tokens")
    np.save(folder / f"{last['name']}.docs.npy", np.concatenate([offsets[:-2], [cut]]) if len(offsets) > 2
            else np.asarray([0, cut], np.int64))
    moved_docs = 1 if len(offsets) > 2 else 0
    share = held.size / max(tokens.size, 1)
    splits["validation"] = [{"name": name, "tokens": int(held.size), "documents": 1,
                             "bytes": int(round(last["bytes"] * share))}]
    last.update(tokens=int(kept.size), documents=last["documents"] - moved_docs,
                bytes=int(round(last["bytes"] * (1 - share))))


def _hold_out(folder: Path, splits: dict[str, list[dict[str, Any]]], dtype: str, eod: int,
              kind: type[DataFormat]) -> None:
    """A validation split where hashing made none: the last document's tail, or the last example."""
    if kind.examples:
        _hold_out_examples(folder, splits, dtype, kind)
    else:
        _hold_out_tail(folder, splits, dtype, eod)


def _run_units(units: list[list[Piece]], tokenizer: Tokenizer, field: str, fraction: float, folder: Path,
               dtype: str, workers: int, show_progress: bool,
               template: ChatTemplate | None = None,
               kind: type[DataFormat] | None = None) -> list[dict[str, dict[str, int]]]:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    sizes = [sum(piece.size for piece in unit) for unit in units]
    args = [(n, unit, tokenizer.to_json(), tokenizer.end_of_document, field, fraction, str(folder), dtype,
             template, kind) for n, unit in enumerate(units)]
    results: list[Any] = [None] * len(units)
    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), disable=not show_progress) as progress:
        task = progress.add_task("tokenize", total=sum(sizes))
        if workers <= 1 or len(units) == 1:
            for n, arg in enumerate(args):
                results[n] = _tokenize_unit(*arg)
                progress.advance(task, sizes[n])
            return results
        context = multiprocessing.get_context("spawn")  # the parent may hold JAX's threads
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(units)), mp_context=context) as pool:
            futures = {pool.submit(_tokenize_unit, *arg): n for n, arg in enumerate(args)}
            for future in concurrent.futures.as_completed(futures):
                n = futures[future]
                results[n] = future.result()  # a worker's UsageError comes back here, one line
                progress.advance(task, sizes[n])
    return results


def _choose_tokenizer(request: dict[str, Any], units: list[list[Piece]], field: str,
                      fraction: float) -> Tokenizer:
    """The tokenizer ``request`` names: bytes, one read from a file, or BPE trained on the training split."""
    if request["kind"] == "bytes":
        return ByteTokenizer()
    if request["kind"] == "file":
        return load_tokenizer(request["path"])
    return train_bpe(_bpe_sample(units, field, fraction), request["vocab_size"])


def _collect_splits(folder: Path, counts: list[dict[str, dict[str, int]]]) -> dict[str, list[dict[str, Any]]]:
    """Each split's shards with their counts, in unit order; the files of empty shards are deleted."""
    splits: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for number, unit_counts in enumerate(counts):
        for split in SPLITS:
            name = f"{split}-{number:05d}"
            if unit_counts[split]["documents"]:
                splits[split].append({"name": name, **unit_counts[split]})
            else:
                for file in shard_files(name):
                    (folder / file).unlink(missing_ok=True)
    return splits


def _write_tokenizer(folder: Path, chosen: Tokenizer, chat: ChatTemplate | None = None) -> None:
    """Write ``chosen`` into ``folder``, with its end-of-document token where it is not shardax's
    and the chat template conversations were rendered with (``chat_template.jinja``)."""
    (folder / TOKENIZER).write_text(chosen.to_json())
    config = {} if chat is None else {**chat.special_tokens}
    if chosen.end_of_document != END_OF_DOCUMENT:  # a model's own end-of-text token, read back from here
        config["eos_token"] = chosen.end_of_document
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if chat is not None:
        (folder / "chat_template.jinja").write_text(chat.source)


def prepare(inputs: Sequence[str | Path], out: str | Path, *, tokenizer: str = "bytes",
            vocab_size: int | None = None, field: str = "text", validation_fraction: float = 0.05,
            workers: int | None = None, overwrite: bool = False, show_progress: bool = True,
            data_format: str = "auto", template: str | None = None) -> Prepared:
    """Tokenize ``inputs`` into shards under ``out`` (see the module docstring); nothing to do when
    ``out`` already holds them for these inputs and settings. ``data_format``: a data format's
    name or ``module:Class`` (``shardax.data.registry``), or ``auto`` (read off the files);
    examples (conversations, pairs) render with ``template`` (a folder or ``.jinja`` file;
    default: the tokenizer's)."""
    if not 0 < validation_fraction < 1:
        raise UsageError(f"--validation-fraction {validation_fraction} must be between 0 and 1, e.g. 0.05")
    root = Path(out)
    request = _tokenizer_request(tokenizer, vocab_size)
    files, skipped = input_files(inputs)
    kind, extra, chat = conversation_settings(files, field, data_format, template, request)
    settings = {"format": FORMAT, "tokenizer": request, "field": field,
                "validation_fraction": validation_fraction, **extra}
    listing = input_listing(files)
    old = read_index(root) if root.is_dir() else None
    reason = rebuild_reason(root, old, settings, listing, tokenizer, overwrite)
    if reason is None and old is not None:
        return Prepared(root, old, False, "up to date: same inputs and settings")
    units = plan_units(files, None if chat else field)
    chosen = _choose_tokenizer(request, units, field, validation_fraction)
    dtype = "uint16" if chosen.vocab_size <= 2**16 else "uint32"
    with staging(root) as folder:
        counts = _run_units(units, chosen, field, validation_fraction, folder, dtype,
                            workers or os.cpu_count() or 1, show_progress, chat, kind)
        splits = _collect_splits(folder, counts)
        if not splits["train"] and not splits["validation"]:
            raise UsageError(f"--data {' '.join(map(str, inputs))}: no document holds any text")
        if not splits["validation"] or not splits["train"]:
            _hold_out(folder, splits, dtype, chosen.eod_id, kind)
        for shard in (shard for shards in splits.values() for shard in shards):
            shard["blake2b"] = shard_digest(folder / f"{shard['name']}.tokens")
            if chat is not None:
                shard["mask_blake2b"] = shard_digest(folder / f"{shard['name']}.mask")
        _write_tokenizer(folder, chosen, chat)
        index = make_index(settings, listing, skipped, chosen, dtype, splits, chat, extra.get("kind"))
        _put_in_place(root, folder, old, index)
    clear_abandoned(root)
    return Prepared(root, index, True, reason)


def _put_in_place(root: Path, folder: Path, old: dict[str, Any] | None, index: dict[str, Any]) -> None:
    """``folder``'s shards become ``root``'s: a new ``root`` appears whole, by renaming ``folder``;
    an existing one has its shards replaced and its index written last."""
    if old is None:
        (folder / INDEX).write_text(json.dumps(index, indent=1))
        try:
            folder.rename(root)  # (onto an empty folder too)
            return
        except OSError:  # root holds what a prepare killed mid-way left: cleared below
            (folder / INDEX).unlink()
    shutil.rmtree(root / ".building", ignore_errors=True)  # where earlier versions built: a killed one's
    publish(root, folder, old, index)
