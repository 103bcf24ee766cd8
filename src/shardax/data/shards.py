"""Training batches read lazily from ``prepare``'s token shards, packed across documents.

A split is one stream of tokens (its shards in order), read with ``os.pread``: nothing is loaded
or mapped beyond the rows a step needs, so resident memory does not grow with the corpus. The
stream is cut into windows of ``seq_len + 1`` tokens at multiples of ``seq_len``; each epoch
visits them in an order drawn from ``(seed, epoch)`` by Grain's index shuffle, which computes
a window's place without holding the permutation. The batch of step ``s`` is therefore a pure
function of ``(data, seed, s)``: the same under resume and with any number of processes, and
each process reads only the rows of its own devices.

A window holds whole documents and pieces of documents. ``segments`` numbers them from 1 (0 is
padding) and ``positions`` restart at 0 where each begins, so that attention never crosses a
document boundary and a packed document is computed as if it were alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from shardax.data.index import INDEX, TOKENIZER, read_index, shard_digest
from shardax.data.tokenizer import Tokenizer, from_json
from shardax.errors import UsageError


class TokenStream:
    """One split's shards as a single read-only sequence of tokens."""

    def __init__(self, root: Path, shards: list[dict[str, Any]], dtype: str, vocab_size: int | None = None,
                 suffix: str = ".tokens") -> None:
        self.dtype = np.dtype(dtype)
        self.vocab_size = vocab_size
        self.descriptors = []
        self.paths = []
        self.digests: list[str | None] = []
        for shard in shards:
            path = root / f"{shard['name']}{suffix}"
            try:
                size = path.stat().st_size
            except OSError:
                raise UsageError(f"{path} is missing; run shardax prepare again into {root}") from None
            if size != shard["tokens"] * self.dtype.itemsize:
                raise UsageError(f"{path} holds {size} bytes, not the {shard['tokens']} tokens its index "
                                 f"lists; run shardax prepare again into {root}")
            self.descriptors.append(os.open(path, os.O_RDONLY))
            self.paths.append(path)
            digest = "blake2b" if suffix == ".tokens" else f"{suffix[1:]}_blake2b"  # checked when first read
            self.digests.append(shard.get(digest))
        self.starts = np.concatenate([[0], np.cumsum([shard["tokens"] for shard in shards])]).astype(np.int64)
        self.length = int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` as int32 (fewer at the end of the stream)."""
        pieces = []
        end = min(start + count, self.length)
        while start < end:
            shard = int(np.searchsorted(self.starts, start, side="right")) - 1
            take = min(end, int(self.starts[shard + 1])) - start
            offset = (start - int(self.starts[shard])) * self.dtype.itemsize
            if self.digests[shard] is not None:
                self._verify(shard)
            data = os.pread(self.descriptors[shard], take * self.dtype.itemsize, offset)
            piece = np.frombuffer(data, self.dtype)
            if self.vocab_size is not None and piece.size and int(piece.max()) >= self.vocab_size:
                at = int(np.argmax(piece >= self.vocab_size))
                raise UsageError(f"{self.paths[shard]} holds token id {int(piece[at])} at token "
                                 f"{start - int(self.starts[shard]) + at}, beyond the tokenizer's "
                                 f"{self.vocab_size} ids: the shard is damaged; run shardax prepare again "
                                 f"into {self.paths[shard].parent}")
            pieces.append(piece)
            start += take
        return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)

    def _verify(self, shard: int) -> None:
        """The shard's checksum against its index, once, when it is first read (a start never
        reads every shard of a large data set)."""
        path = self.paths[shard]
        if shard_digest(path) != self.digests[shard]:
            raise UsageError(f"{path} does not match the checksum its index records (it was changed after "
                             f"shardax prepare wrote it); run shardax prepare again into {path.parent}")
        self.digests[shard] = None

    def close(self) -> None:
        for descriptor in self.descriptors:
            os.close(descriptor)
        self.descriptors = []


def _check_index(index: Any, path: Path) -> None:
    """One line naming what a prepared directory's index lacks (an edited or truncated file)."""
    missing = [key for key in ("tokenizer", "tokenizer_name", "dtype", "eod_id", "splits")
               if not isinstance(index, dict) or key not in index]
    if not missing:
        for split in ("train", "validation"):
            entry = index["splits"].get(split) if isinstance(index["splits"], dict) else None
            missing += [f"splits.{split}.{key}" for key in ("shards", "documents", "tokens", "bytes")
                        if not isinstance(entry, dict) or key not in entry]
    if missing:
        raise UsageError(f"{path} lacks {', '.join(missing)}; it was not written whole by shardax prepare: "
                         f"run shardax prepare again into {path.parent}")


class PreparedData:
    """A directory written by ``shardax prepare``: its tokenizer and its two splits."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        index = read_index(self.root) if self.root.is_dir() else None
        if index is None:
            raise UsageError(f"{self.root} holds no prepared data ({INDEX} missing); run shardax prepare "
                             "first")
        _check_index(index, self.root / INDEX)
        self.index = index
        self.tokenizer: Tokenizer = from_json((self.root / TOKENIZER).read_text(), str(self.root / TOKENIZER))
        if self.tokenizer.fingerprint != index["tokenizer"]:
            raise UsageError(f"{self.root / TOKENIZER} is not the tokenizer its shards were made with; "
                             f"run shardax prepare again into {self.root}")
        vocab = self.tokenizer.vocab_size
        self.train = TokenStream(self.root, index["splits"]["train"]["shards"], index["dtype"], vocab)
        self.validation = TokenStream(self.root, index["splits"]["validation"]["shards"], index["dtype"],
                                      vocab)

    @property
    def eod_id(self) -> int:
        return int(self.index["eod_id"])

    def describe(self) -> str:
        splits = self.index["splits"]
        return (f"{self.root}: {self.index['tokenizer_name']} tokens, {splits['train']['documents']:,} train "
                f"/ {splits['validation']['documents']:,} validation documents, "
                f"{splits['train']['tokens']:,} / {splits['validation']['tokens']:,} tokens "
                f"({splits['train']['bytes'] / max(splits['train']['tokens'], 1):.2f} bytes per token)")


def packed(tokens: np.ndarray, eod_id: int, valid: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``tokens`` (rows of a stream) with ``segments`` (documents numbered from 1 in each row, 0 for
    padding) and ``positions`` (restarting at 0 where each document starts)."""
    starts = tokens == eod_id
    starts[:, 0] = True
    segments = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    if valid is not None:
        segments = np.where(valid, segments, 0)
        positions = np.where(valid, positions, 0)
    return {"tokens": tokens.astype(np.int32), "segments": segments, "positions": positions.astype(np.int32)}


class PackedBatches:
    """``batch_size`` windows of ``seq_len + 1`` tokens per step, in a seeded order, epoch after epoch."""

    def __init__(self, stream: TokenStream, seq_len: int, batch_size: int, seed: int, eod_id: int) -> None:
        import grain

        self.stream, self.seq_len, self.batch_size, self.eod_id = stream, seq_len, batch_size, eod_id
        self.windows = (stream.length - 1) // seq_len
        if self.windows < 1:
            raise UsageError(f"the training split has {stream.length} tokens, fewer than one window of "
                             f"--seq-len {seq_len} + 1; give more text or a shorter --seq-len")
        self.order = grain.MapDataset.range(self.windows).shuffle(seed=seed)  # a new order each epoch

    def window_ids(self, step: int) -> np.ndarray:
        first = step * self.batch_size
        return np.asarray([self.order[i] for i in range(first, first + self.batch_size)], np.int64)

    def rows(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.stack([self.stream.read(int(w) * self.seq_len, self.seq_len + 1) for w in window_ids])
        return packed(tokens, self.eod_id)

    def global_batch(self, step: int, sharding: Sharding) -> dict[str, jax.Array]:
        """The batch of ``step`` as global arrays; this process reads only the rows its devices hold."""
        ids = self.window_ids(step)
        read: dict[tuple[int, int], dict[str, np.ndarray]] = {}

        def rows(key: str, index: tuple[slice, ...]) -> np.ndarray:
            span = index[0].indices(len(ids))[:2]
            if span not in read:
                read[span] = self.rows(ids[span[0] : span[1]])
            return read[span][key][:, index[1]]

        shape = (self.batch_size, self.seq_len + 1)
        return {key: jax.make_array_from_callback(shape, sharding, lambda index, key=key: rows(key, index))
                for key in ("tokens", "segments", "positions")}

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.windows


def validation_rows(stream: TokenStream, seq_len: int, batch_size: int, count: int, eod_id: int,
                    token_bytes: np.ndarray) -> list[dict[str, np.ndarray]]:
    """Up to ``count`` batches of consecutive validation windows (the same every evaluation), the
    last one padded; ``target_bytes`` is the text each target token stands for (0 for padding)."""
    windows = max(1, -(-(stream.length - 1) // seq_len))
    batches = []
    for first in range(0, min(count, -(-windows // batch_size)) * batch_size, batch_size):
        tokens = np.zeros((batch_size, seq_len + 1), np.int32)
        valid = np.zeros(tokens.shape, bool)
        for row in range(min(batch_size, windows - first)):
            part = stream.read((first + row) * seq_len, seq_len + 1)
            tokens[row, : part.size] = part
            valid[row, : part.size] = True
        batch = packed(tokens, eod_id, valid)
        batch["target_bytes"] = np.where(valid[:, 1:] & valid[:, :-1], token_bytes[tokens[:, 1:]],
                                         0).astype(np.int32)
        batches.append(batch)
    return batches
