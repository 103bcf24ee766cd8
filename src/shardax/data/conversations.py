"""Examples for supervised fine-tuning: token ids and which of them the loss is computed on.

One JSON object per line, in either form TRL reads:

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the checkpoint's chat
  template; the loss is on what the assistant wrote (its turns' content and end-of-turn tokens).
- ``{"prompt": ..., "completion": ...}``: two strings are joined as they are and the loss is on
  the completion; two lists of messages are rendered with the template (the prompt's turns, then
  the completion's) and the loss is on the completion's assistant turns.

    examples = supervised_examples("chats.jsonl", tokenizer, ChatTemplate.from_tokenizer_config(folder))
    for ids, mask in examples: ...

What cannot train is refused in one line naming the file and line: a line that is not JSON, a
record of neither form (a preference pair among them), an unknown role, a conversation with no
assistant turn, an empty completion, a template that fails to render it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardax.data.chat import ChatTemplate, chat_template, check_messages
from shardax.data.registry import detect_format, get_format
from shardax.errors import UsageError

FORMATS = ("messages", "prompt/completion")


def format_of(record: Any, where: str) -> str:
    """Which form ``record`` is in (one of ``FORMATS``), or a one-line error saying what it holds."""
    if isinstance(record, Mapping) and "messages" in record:
        return "messages"
    if isinstance(record, Mapping) and "prompt" in record and "completion" in record:
        return "prompt/completion"
    if isinstance(record, Mapping) and {"chosen", "rejected"} <= set(record):
        raise UsageError(f"{where} is a preference pair (chosen, rejected): supervised fine-tuning reads "
                         "'messages' or 'prompt' and 'completion'; train preference pairs with DPO")
    held = ", ".join(map(str, record)) if isinstance(record, Mapping) else type(record).__name__
    raise UsageError(f"{where} holds {held or 'nothing'}; give 'messages' (a list of {{'role', 'content'}}) "
                     "or 'prompt' and 'completion'")


def assistant_text(record: Mapping[str, Any], template: ChatTemplate | None,
                   where: str) -> tuple[str, list[tuple[int, int]]]:
    """The text one example trains on and the ``[start, end)`` character spans its loss covers."""
    if format_of(record, where) == "messages":
        messages = record["messages"]
        check_messages(messages, where)
        if not any(message["role"] == "assistant" for message in messages):
            raise UsageError(f"{where}: the conversation has no assistant turn, so nothing in it would be "
                             "learned; add the reply the model should give, or leave the line out")
        return _rendered(template, messages, 0, where)
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise UsageError(f"{where}: the completion is empty, so nothing in it would be learned; give the "
                             "text the model should write after the prompt")
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
    if not isinstance(prompt, Sequence) or not isinstance(completion, Sequence) or isinstance(
            prompt, str) or isinstance(completion, str):
        raise UsageError(f"{where}: 'prompt' is {type(prompt).__name__} and 'completion' "
                         f"{type(completion).__name__}; give two strings or two lists of messages")
    check_messages(list(prompt) + list(completion), where)
    if not any(message["role"] == "assistant" and str(message["content"]).strip() for message in completion):
        raise UsageError(f"{where}: the completion has no assistant turn with text, so nothing in it would "
                         "be learned; give the reply as {'role': 'assistant', 'content': ...}")
    return _rendered(template, list(prompt) + list(completion), len(prompt), where)


def _rendered(template: ChatTemplate | None, messages: list[Any], first: int,
              where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered, and the spans of the assistant turns from message ``first`` on."""
    if template is None:
        raise UsageError(f"{where} is a conversation, and there is no chat template to render it with; "
                         "give a tokenizer_config.json with a chat_template, or text prompts and completions")
    try:
        text, spans = template.assistant_spans(messages)
        before = len(template.render(messages[:first])) if first else 0  # the prompt's turns: a prefix
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None
    return text, [(start, end) for start, end in spans if start >= before]


def preference_texts(record: Any, template: ChatTemplate | None,
                     where: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """A preference pair's two sequences, chosen then rejected: each the prompt and that
    completion, as text with the completion's spans (strings joined as they are, or lists of
    messages rendered with the template, as ``assistant_text`` renders a prompt and completion)."""
    if not isinstance(record, Mapping) or not {"prompt", "chosen", "rejected"} <= set(record):
        held = ", ".join(map(str, record)) if isinstance(record, Mapping) else type(record).__name__
        raise UsageError(f"{where} holds {held or 'nothing'}; a preference pair gives 'prompt', 'chosen' and "
                         "'rejected' (strings, or lists of messages)")
    sides = []
    for side in ("chosen", "rejected"):
        completion = record[side]
        if isinstance(completion, str) and not completion.strip() or not completion:
            raise UsageError(f"{where}: the {side} completion is empty, so the pair compares nothing; give "
                             "both replies, or leave the line out")
        sides.append(assistant_text({"prompt": record["prompt"], "completion": completion}, template,
                                    f"{where} ({side})"))
    return sides


def supervised_tokens(tokenizer: Any, text: str,
                      spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``text``'s token ids (as written: a template writes its own special tokens) and, for each,
    whether any of its characters lies in ``spans``: the tokens the loss is computed on."""
    ids, offsets = tokenizer.encode_offsets(text)
    mask = np.zeros(len(ids), bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (start < offsets[:, 1])
    return ids, mask


def supervised_examples(path: str | Path, tokenizer: Any,
                        template: ChatTemplate | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each line of the JSON-lines file ``path`` as ``(token ids, loss mask)``; blank lines skipped."""
    path = Path(path)
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"{where} is not JSON ({error.msg}); give one JSON object per line"
                                 ) from None
            yield supervised_tokens(tokenizer, *assistant_text(record, template, where))


def plan_rows(lengths: Sequence[int], length: int, *, pack: bool = True) -> list[list[int]]:
    """Which examples (by index, in order) each row of ``length`` tokens holds: one a row, or
    packed (each into the fullest row it still fits, best fit); an example longer than a row
    has a row of its own and is cut to it."""
    if length < 2:
        raise UsageError(f"rows of {length} tokens cannot hold a prediction; give at least 2")
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted: the best fit is the first with room enough
    for index, size in enumerate(lengths):
        size = min(int(size), length)
        at = bisect.bisect_left(rooms, (size, -1)) if pack else len(rooms)
        if at < len(rooms):
            room, row = rooms.pop(at)
        else:
            room, row = length, len(rows)
            rows.append([])
        rows[row].append(index)
        if pack and room - size > 1:  # a row with one token of room cannot hold a prediction
            bisect.insort(rooms, (room - size, row))
    return rows


def lay_rows(rows: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], length: int) -> dict[str, np.ndarray]:
    """Rows of examples (token ids and their loss masks) as a batch for ``next_token_loss``:
    ``tokens``, ``mask``, ``segments`` (each row's examples numbered from 1, 0 for padding:
    attention stays within an example) and ``positions`` (from 0 in each example). Each example is
    cut to the row; its first token is never learned (no prediction crosses examples)."""
    batch = {key: np.zeros((len(rows), length), np.int32)
             for key in ("tokens", "mask", "segments", "positions")}
    for r, row in enumerate(rows):
        at = 0
        for number, (ids, mask) in enumerate(row, 1):
            ids, mask = np.asarray(ids)[: length - at], np.asarray(mask)[: length - at]
            span = slice(at, at + len(ids))
            batch["tokens"][r, span], batch["mask"][r, span] = ids, mask
            batch["segments"][r, span], batch["positions"][r, span] = number, np.arange(len(ids))
            batch["mask"][r, at] = 0  # an example's first token is predicted from nothing of its own
            at += len(ids)
    return batch


def supervised_rows(examples: Sequence[tuple[np.ndarray, np.ndarray]], length: int, *,
                    pack: bool = True) -> tuple[dict[str, np.ndarray], int]:
    """Examples (token ids and their loss mask) laid into rows of ``length`` tokens (``plan_rows``,
    ``lay_rows``): the batch, and how many examples were longer than a row and cut to it."""
    plan = plan_rows([len(ids) for ids, _ in examples], length, pack=pack)
    cut = sum(len(ids) > length for ids, _ in examples)
    return lay_rows([[examples[i] for i in row] for row in plan], length), cut


def conversation_settings(files: Sequence[Path], field: str, data_format: str, given_template: str | None,
                          request: dict[str, Any]) -> tuple[Any, dict[str, Any], ChatTemplate | None]:
    """The data format of ``files`` (``data_format``: a name or ``module:Class``, or ``auto``:
    detected) and, for a format of examples, the settings that define their shards and the chat
    template they render with (``{}`` and None for documents)."""
    kind = detect_format(files, field) if data_format == "auto" else get_format(data_format)
    if not kind.examples:
        if given_template is not None:
            raise UsageError(f"--chat-template {given_template} applies to conversations, and --data holds "
                             f"{kind.what}; leave it out, or give .jsonl/.parquet files of messages")
        return kind, {}, None
    if request["kind"] == "bpe":
        raise UsageError(f"--tokenizer bpe trains on documents, and --data holds {kind.name}; give the "
                         "checkpoint's tokenizer.json (or bytes)")
    template = chat_template(given_template, request.get("path"))
    return kind, {"kind": kind.name, "chat_template": template.fingerprint}, template
