"""The data formats ``shardax train`` and ``prepare`` read: a small registry of ``DataFormat`` plug-ins.

A format says everything that is its own: how its records are recognised (``recognises``), how
``shardax prepare`` turns one into token sequences and the spans the loss learns (``sequences``),
how many sequences make one example, and, an instance being the data of one run, how batches are
drawn, what the run trains (``procedure``: a loss, or a step over the model beside a frozen copy
of its first weights), what its loss is set beside (``baselines``, in ``unit``), the header's line
and the closing sample's prompt. The core (``prepare``, the LM job) never tells formats apart:
shardax's own (``shardax.data.formats``: text, documents, conversations, preferences) register
themselves as a user registers theirs::

    from shardax.data.formats.conversations import Conversations
    from shardax.data.registry import register_format

    class QuestionAnswer(Conversations):
        name, what, example = "qa", "questions and answers", "question"

        @staticmethod
        def recognises(record, field):
            return isinstance(record, dict) and {"question", "answer"} <= set(record)

        @staticmethod
        def sequences(record, template, where):
            question, answer = record["question"], record["answer"]
            return [(question + answer, [(len(question), len(question) + len(answer))])]

    register_format(QuestionAnswer)

or name it where a format is named: ``shardax train --format my_formats:QuestionAnswer`` (imported
from the current directory or ``PYTHONPATH``, and registered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardax.data.documents import file_kind, first_record
from shardax.errors import UsageError
from shardax.plugins import import_named

TEXT = "text"  # a run without a tokenizer: its documents' bytes held in memory
DOCUMENTS = "documents"  # what a record no format claims is, and a text file


@dataclasses.dataclass(frozen=True)
class Procedure:
    """What a run trains on a format's batches: one model and its ``loss`` (``loss_fn(model,
    batch)``; ``eval_loss`` evaluates), or ``step(parts, batch)`` over the model, trained as part
    ``trained``, beside a frozen copy of its first weights, part ``frozen`` (a reference model;
    ``eval_step`` evaluates)."""

    loss: Callable[..., Any] | None = None
    eval_loss: Callable[..., Any] | None = None
    step: Callable[..., Any] | None = None
    eval_step: Callable[..., Any] | None = None
    trained: str = "policy"
    frozen: str = "reference"


class DataFormat:
    """One kind of data (a base to subclass; ``Conversations`` is a whole one to change a part of).
    The class describes the format and prepares its records; an instance is the data of one run.

    ``name``: as ``--format`` and a prepared directory's ``index.json`` name it; ``what``: what
    ``--data`` holds, in messages (``"preference pairs"``); ``example``: one example, in messages;
    ``examples``: records become examples with a loss mask (False: documents, every token
    learned); ``sequences_per_example``: token sequences of one example, kept together (a pair:
    2); ``prepared``: written by ``shardax prepare``; ``options``: the settings of ``shardax
    train`` that this format alone takes (``dpo_beta``), ``purpose`` what they tune and ``give``
    how to give data of this format, for the message refusing them beside other data."""

    name: str = ""
    what: str = ""
    example: str = "document"
    examples: bool = True
    sequences_per_example: int = 1
    prepared: bool = True
    options: tuple[str, ...] = ()
    purpose: str = ""
    give: str = ""

    # what a run's data has
    batch_keys: tuple[str, ...] = ()  # each batch's (batch, seq_len + 1) int32 arrays
    unit: str = "nats/token"  # of the loss and of its baselines
    counted: str = "tokens"  # what a sequence's length counts
    end_of_turn: str = ""  # where the closing sample's reply ends ("": it does not)
    template: Any = None  # the chat template its examples were rendered with (written beside the run)
    tokenizer: Any = None
    tokenizer_fingerprint: str | None = None
    vocab: int = 0  # the tokenizer's tokens
    model_vocab: int = 0  # rounded up: the model's

    @staticmethod
    def recognises(record: Any, field: str) -> bool:
        """Whether ``record`` (the first of a JSON-lines or Parquet file) is of this format."""
        return False

    @staticmethod
    def sequences(record: Any, template: Any, where: str) -> list[tuple[str, list[tuple[int, int]]]]:
        """``record``'s ``sequences_per_example`` token sequences, each as text and the ``[start,
        end)`` character spans the loss learns; refused in one line naming ``where``."""
        raise NotImplementedError

    def header(self) -> str:
        """The run header's line on the data."""
        raise NotImplementedError

    def baselines(self) -> dict[str, float]:
        """Losses, in ``unit``, the run's summary and plot set the model's beside; the first is the
        one a validation loss should end below."""
        return {}

    def batches(self, seq_len: int, batch: int, seed: int, sharding: Any) -> Callable[[int], Any]:
        """The batch of a step, as global arrays: a function of the step alone."""
        raise NotImplementedError

    def validation(self, seq_len: int, batch: int, count: int, sharding: Any) -> list[Any]:
        """Up to ``count`` fixed held-out batches."""
        raise NotImplementedError

    def procedure(self, options: dict[str, Any], adapters: bool) -> Procedure:
        """What the run trains on these batches; ``options``: the settings of ``options`` given;
        ``adapters``: whether the model holds LoRA adapters."""
        raise NotImplementedError

    def use_packing(self, packing: bool) -> None:
        """``--no-packing`` (``packing`` False), which only a format of whole examples in shared
        rows takes."""
        raise UsageError(f"--no-packing lays conversations one a row, and --data holds {self.what}; leave it "
                         "out")

    def prompt(self, length: int) -> list[int]:
        """The closing sample's prompt, of about ``length`` tokens."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


_FORMATS: dict[str, type[DataFormat]] = {}


def _builtins() -> None:
    import shardax.data.formats  # noqa: F401  (shardax's formats register themselves, in their order)


def register_format(kind: type[DataFormat], *, replace: bool = False) -> type[DataFormat]:
    """Make the ``DataFormat`` subclass ``kind`` the format of its ``name`` (a candidate for
    reading records off files); ``replace=True`` replaces a format registered under that name."""
    name = getattr(kind, "name", None)
    if not (isinstance(kind, type) and issubclass(kind, DataFormat) and isinstance(name, str) and name):
        raise UsageError(f"register_format({kind!r}): a format is a subclass of shardax.data.registry."
                         "DataFormat with a name (e.g. class QA(Conversations): name = 'qa')")
    if name in _FORMATS and not replace and _FORMATS[name] is not kind:
        raise UsageError(f"a data format named {name!r} is registered already ({_FORMATS[name].__name__}); "
                         "give replace=True to replace it, or another name")
    _FORMATS[name] = kind
    return kind


def unregister_format(name: str) -> None:
    """Forget the format ``name`` (nothing if there is none)."""
    _FORMATS.pop(name, None)


def registered() -> tuple[type[DataFormat], ...]:
    """Every registered format, in the order they were registered."""
    _builtins()
    return tuple(_FORMATS.values())


def format_names() -> tuple[str, ...]:
    """The names ``--format`` takes: the formats ``shardax prepare`` writes."""
    return tuple(kind.name for kind in registered() if kind.prepared)


def get_format(name: str, flag: str = "--format") -> type[DataFormat]:
    """The format ``name`` names: a registered one, or ``module:Class`` (imported and registered);
    one line naming ``flag`` when there is none."""
    _builtins()
    if ":" in name:
        return load_format(name, flag)
    if name in _FORMATS and _FORMATS[name].prepared:
        return _FORMATS[name]
    raise UsageError(f"{flag} {name!r} is not one of auto, {', '.join(format_names())}; or give a format of "
                     "your own as module:Class (a shardax.data.registry.DataFormat)")


def prepared_format(kind: str | None, root: Path) -> type[DataFormat]:
    """The format of the prepared directory ``root`` (its index's ``kind``; none: documents)."""
    _builtins()
    kind = kind or DOCUMENTS
    if kind not in _FORMATS:
        raise UsageError(f"--data {root} holds data of the format {kind!r}, which is not registered here; "
                         f"name it with --format module:Class (as it was prepared with)")
    return _FORMATS[kind]


def text_format() -> type[DataFormat]:
    """The format of a run given no tokenizer: its documents' bytes held in memory."""
    _builtins()
    return _FORMATS[TEXT]


def load_format(spec: str, flag: str = "--format") -> type[DataFormat]:
    """The format class ``spec`` (``module:Class``) names, imported and registered."""
    kind, module_name, attribute = import_named(spec, flag, "Class", "my_formats:QuestionAnswer")
    if not isinstance(kind, type) or not issubclass(kind, DataFormat):
        what = ("nothing" if kind is None else f"the class {kind.__name__}" if isinstance(kind, type)
                else f"a {type(kind).__name__}")
        raise UsageError(f"{flag} {spec}: {module_name}.{attribute} is {what}, not a data format; give a "
                         "subclass of shardax.data.registry.DataFormat (e.g. of shardax.data.formats."
                         "conversations.Conversations)")
    existing = _FORMATS.get(kind.name)
    again = existing is not None and (existing.__module__, existing.__qualname__) == (kind.__module__,
                                                                                      kind.__qualname__)
    return register_format(kind, replace=again)  # (the same class, imported again, replaces itself)


def record_format(record: Any, field: str) -> type[DataFormat]:
    """The format of ``record``: documents where it holds the text ``field`` (or is not a
    mapping), else the latest registered format that recognises it, else documents."""
    _builtins()
    documents = _FORMATS[DOCUMENTS]
    if documents.recognises(record, field):
        return documents
    claims = (kind for kind in reversed(_FORMATS.values()) if kind.prepared and kind is not documents
              and kind.recognises(record, field))
    return next(claims, documents)


def detect_format(files: Sequence[Path], field: str) -> type[DataFormat]:
    """The format of ``files``, read off each one's first record (a text file holds a document);
    inputs of two formats are refused in one line naming one file of each."""
    _builtins()
    found: dict[str, Path] = {}
    kinds: dict[str, type[DataFormat]] = {}
    for path in files:
        kind = record_format(first_record(path), field) if file_kind(path) != "text" else _FORMATS[DOCUMENTS]
        found.setdefault(kind.name, path)
        kinds[kind.name] = kind
    if len(found) > 1:
        (one, first), (other, second) = list(found.items())[:2]
        raise UsageError(f"--data mixes {kinds[one].what} ({first}) and {kinds[other].what} ({second}); "
                         "prepare them into separate directories")
    return kinds[next(iter(found))]
