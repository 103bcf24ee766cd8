"""Documents from text files, JSON lines and Parquet files, cut into units of work for ``prepare``.

A text file is one document; a JSON-lines file holds one document per line (its ``field``);
a Parquet file one per row (its ``field`` column). JSON lines and Parquet rows may instead hold
conversations or other records of a data format (``shardax.data.registry.detect_format`` tells which).
Units are cut at fixed input sizes (never by the number of workers), so the shards ``prepare``
writes do not depend on how many processes wrote them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from shardax.data.corpus import TEXT_SUFFIXES
from shardax.data.python_chats import BUILT_IN_SETS, built_in_file
from shardax.errors import UsageError

JSON_LINES = {".jsonl", ".ndjson"}
PARQUET = {".parquet"}
UNIT_BYTES = 16 << 20  # input bytes per unit of work (one shard per split)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A whole text file, a byte range of a JSON-lines file (whole lines), or a Parquet row group."""

    path: str
    kind: str  # "text", "jsonl" or "parquet"
    start: int = 0  # bytes (jsonl) or row group (parquet)
    stop: int = -1
    size: int = 0  # input bytes, for progress and unit sizes


def file_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSON_LINES else "parquet" if suffix in PARQUET else "text"


def input_files(paths: Sequence[str | Path]) -> tuple[list[Path], list[str]]:
    """The files to read (folders searched), and the files skipped in folders with the reason.

    An empty file named on its own is an error; in a folder, empty files are skipped and listed.
    A binary or non-UTF-8 file is an error either way (``read_piece``), naming the file."""
    files, skipped = [], []
    for given in paths:
        path = Path(given)
        if str(given) in BUILT_IN_SETS and not path.exists():  # a built-in set of conversations or pairs
            path = built_in_file(str(given))
        if not path.exists():
            raise UsageError(f"--data {str(given)!r} does not exist; give text, .jsonl or .parquet files or "
                             f"folders of them (or {' or '.join(BUILT_IN_SETS)}, the built-in conversations "
                             "and pairs)")
        if path.is_file():
            if path.stat().st_size == 0:
                raise UsageError(f"{path} is empty; remove it from the inputs")
            files.append(path)
            continue
        suffixes = TEXT_SUFFIXES | JSON_LINES | PARQUET
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
        for file in found:
            if file.stat().st_size == 0:
                skipped.append(f"{file}: empty")
            else:
                files.append(file)
        if not found:
            raise UsageError(f"--data folder {str(given)!r} holds no text, .jsonl or .parquet files")
    if not files:
        raise UsageError(f"--data {' '.join(map(str, paths))}: every file is empty")
    return files, skipped


def _jsonl_pieces(path: Path, size: int) -> list[Piece]:
    """Line-aligned byte ranges of about ``UNIT_BYTES``."""
    cuts = [0]
    with path.open("rb") as handle:
        while cuts[-1] + UNIT_BYTES < size:
            handle.seek(cuts[-1] + UNIT_BYTES)
            handle.readline()
            if handle.tell() >= size:
                break
            cuts.append(handle.tell())
    cuts.append(size)
    return [Piece(str(path), "jsonl", a, b, b - a) for a, b in zip(cuts, cuts[1:])]


def _parquet_pieces(path: Path, field: str | None) -> list[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"{path}: Parquet needs pyarrow; pip install 'shardax[parquet]'") from None
    try:
        meta = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's own exception types
        raise UsageError(f"{path}: not a readable Parquet file ({str(error)[:100]})") from None
    columns = meta.schema_arrow.names
    if field is not None and field not in columns:
        raise UsageError(f"{path} has no column {field!r} (it has {', '.join(columns)}); pass --field NAME")
    groups = meta.metadata.num_row_groups
    size = path.stat().st_size
    return [Piece(str(path), "parquet", g, g + 1, size // max(groups, 1)) for g in range(groups)]


def plan_units(files: Sequence[Path], field: str | None) -> list[list[Piece]]:
    """The inputs as units of about ``UNIT_BYTES`` each, in input order (``field`` None: records
    of conversations, no text column to check)."""
    pieces: list[Piece] = []
    for path in files:
        kind, size = file_kind(path), path.stat().st_size
        if kind == "jsonl":
            pieces.extend(_jsonl_pieces(path, size))
        elif kind == "parquet":
            pieces.extend(_parquet_pieces(path, field))
        else:
            pieces.append(Piece(str(path), "text", size=size))
    units: list[list[Piece]] = [[]]
    filled = 0
    for piece in pieces:
        if units[-1] and filled + piece.size > UNIT_BYTES:
            units.append([])
            filled = 0
        units[-1].append(piece)
        filled += piece.size
    return units


def _decoded(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{where} is not UTF-8 text (byte {error.start}: "
                         f"{data[error.start:error.start + 1]!r}); convert it (e.g. iconv -t utf-8) or leave "
                         "it out") from None


def first_record(path: Path) -> Any:
    """The first record of a JSON-lines or Parquet file (None when there is none, or it is not JSON)."""
    if file_kind(path) == "parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).iter_batches(batch_size=1)
        first = next(rows, None)
        return first.to_pylist()[0] if first is not None and first.num_rows else None
    with path.open("rb") as handle:
        for line in handle:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def read_records(piece: Piece) -> Iterator[tuple[str, Any]]:
    """The records of a JSON-lines byte range or a Parquet row group, each with where it is
    (``file line N``, or ``file row N``) for one-line errors."""
    path = Path(piece.path)
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path).read_row_group(piece.start)
        first = sum(pq.ParquetFile(path).metadata.row_group(g).num_rows for g in range(piece.start))
        for number, record in enumerate(table.to_pylist(), first + 1):
            yield f"{path} row {number}", record
        return
    if piece.kind != "jsonl":
        raise UsageError(f"{path} is text; conversations are read from .jsonl or .parquet files")
    yield from _json_lines(piece)


def _json_lines(piece: Piece) -> Iterator[tuple[str, Any]]:
    """The JSON objects of a JSON-lines byte range (blank lines skipped), each with where it is."""
    path = Path(piece.path)
    with path.open("rb") as handle:
        handle.seek(piece.start)
        lines = handle.read(piece.stop - piece.start).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}" + (f" after byte {piece.start}" if piece.start else "")
        try:
            yield where, json.loads(_decoded(line, where))
        except json.JSONDecodeError as error:
            raise UsageError(f"{where} is not JSON ({error.msg}); give one JSON object per line") from None


def read_piece(piece: Piece, field: str) -> Iterator[str]:
    """The documents of one piece (empty ones left out)."""
    path = Path(piece.path)
    if piece.kind == "text":
        data = path.read_bytes()
        if b"\x00" in data[:8192]:
            raise UsageError(f"{path} is binary (it holds NUL bytes), not text; leave it out")
        text = _decoded(data, str(path))
        if text.strip():
            yield text
        return
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(path).read_row_group(piece.start, columns=[field]).column(field)
        for number, value in enumerate(column.to_pylist()):
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{path}: column {field!r} holds {type(value).__name__}, not text "
                                 f"(row group {piece.start}, row {number}); pass --field with a text column")
            if value and value.strip():
                yield value
        return
    for where, record in _json_lines(piece):
        if not isinstance(record, dict) or field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise UsageError(f"{where} has no field {field!r} (it has {keys}); pass --field NAME")
        if not isinstance(record[field], str):
            raise UsageError(f"{where}: field {field!r} is {type(record[field]).__name__}, not text")
        if record[field].strip():
            yield record[field]
