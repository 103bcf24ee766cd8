"""Where the Trainer's batches come from, and how each kind of source resumes exactly.

- A Grain dataset, DataLoader or their iterator: the iterator's own state is saved in the
  checkpoint (each process its own), so a resumed run reads the very next batch.
- A function of the step, ``data(step) -> batch``: the batch of a step never depends on the
  past, so resuming needs nothing saved.
- Any other iterable (a list, a generator function's result, a ``tf.data``/torch loader): the
  position is the number of batches read; a resumed run reads the iterable again from its start
  and skips them, so the iterable must give the same batches each time it is iterated.

With several processes each process's source yields only its own rows of every global batch
(Grain's ``ShardByJaxProcess``, or slicing by ``jax.process_index()``); batches that are already
global ``jax.Array`` objects are used as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardax.errors import UsageError


def _grain() -> Any:
    try:
        import grain
    except ImportError:
        return None
    return grain


def is_grain(data: Any) -> bool:
    grain = _grain()
    kinds = () if grain is None else (grain.MapDataset, grain.IterDataset, grain.DataLoader,
                                       grain.DatasetIterator, grain.DataLoaderIterator)
    return bool(kinds) and isinstance(data, kinds)


class BatchSource:
    """A stream of batches with a position that a checkpoint can hold."""

    kind = "batches"

    def __init__(self) -> None:
        self.batches_read = 0

    def next(self) -> Any | None:
        """The next batch, or ``None`` when the data has run out."""
        raise NotImplementedError

    def first_batch(self) -> Any | None:
        """A batch to check the step's shapes on, read without moving the position (None where
        that cannot be done: a one-pass iterator, a Grain iterator whose state is checkpointed)."""
        return None

    def record(self) -> dict[str, Any]:
        """The position, as JSON for the checkpoint's record."""
        return {"kind": self.kind, "batches_read": self.batches_read}

    def save_args(self) -> Any:
        """Orbax args saving this source's own state beside the arrays, or ``None``."""
        return None

    def restore_args(self) -> Any:
        """Orbax args restoring that state in place, or ``None``."""
        return None

    def resume(self, record: dict[str, Any], step: int) -> None:
        """Continue after the checkpoint's ``record`` (taken at ``step``)."""
        self.batches_read = int(record.get("batches_read", step))


class IterableSource(BatchSource):
    kind = "iterable"

    def __init__(self, data: Iterable[Any]) -> None:
        super().__init__()
        self.data = data
        self.iterator: Iterator[Any] | None = None

    def next(self) -> Any | None:
        if self.iterator is None:
            self.iterator = iter(self.data)
        batch = next(self.iterator, None)
        self.batches_read += batch is not None
        return batch

    def first_batch(self) -> Any | None:
        if iter(self.data) is self.data:  # one pass: reading it would lose the batch
            return None
        return next(iter(self.data), None)

    def resume(self, record: dict[str, Any], step: int) -> None:
        super().resume(record, step)
        if self.batches_read and iter(self.data) is self.data:
            raise UsageError(
                f"resuming after {self.batches_read} batches needs data that can be read again from its "
                f"start, but the data is a one-pass {type(self.data).__name__}; pass a list, a Grain "
                "dataset, a function of the step, or an object whose iter() starts over"
            )
        self.iterator = itertools.islice(iter(self.data), self.batches_read, None)


class StepSource(BatchSource):
    kind = "by_step"

    def __init__(self, data: Callable[[int], Any]) -> None:
        super().__init__()
        self.data = data

    def next(self) -> Any | None:
        batch = self.data(self.batches_read)
        self.batches_read += batch is not None
        return batch

    def first_batch(self) -> Any | None:
        return self.data(self.batches_read)


class GrainSource(BatchSource):
    kind = "grain"

    def __init__(self, data: Any) -> None:
        super().__init__()
        grain = _grain()
        if isinstance(data, grain.MapDataset):
            data = data.to_iter_dataset()
        self.iterator = (data if isinstance(data, (grain.DatasetIterator, grain.DataLoaderIterator))
                         else iter(data))

    def next(self) -> Any | None:
        batch = next(self.iterator, None)
        self.batches_read += batch is not None
        return batch

    def save_args(self) -> Any:
        return _grain().checkpoint.CheckpointSave(self.iterator)

    def restore_args(self) -> Any:
        return _grain().checkpoint.CheckpointRestore(self.iterator)


def batch_source(data: Any) -> BatchSource:
    """The right ``BatchSource`` for what the user passed (see the module docstring)."""
    if isinstance(data, BatchSource):
        return data
    if is_grain(data):
        return GrainSource(data)
    if isinstance(data, Iterable):
        return IterableSource(data)
    if callable(data):
        return StepSource(data)
    raise UsageError(
        f"data is a {type(data).__name__}; give an iterable of batches (a list, a generator, a data loader), "
        "a Grain dataset or DataLoader, or a function step -> batch"
    )


def evaluation_batches(data: Any) -> Callable[[], Iterable[Any]]:
    """A way to read the evaluation data again at every evaluation."""
    if callable(data) and not isinstance(data, Iterable):
        return data
    if isinstance(data, Iterable) and iter(data) is data:
        raise UsageError(
            f"eval_data is a one-pass {type(data).__name__}, read up at the first evaluation; pass a list, "
            "a Grain dataset, or a function returning a fresh iterable"
        )
    if not isinstance(data, Iterable):
        raise UsageError(f"eval_data is a {type(data).__name__}; give a list of batches, a Grain dataset, "
                         "or a function returning an iterable of batches")
    return lambda: data
