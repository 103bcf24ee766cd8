"""Conversations rendered with a checkpoint's chat template, and which characters the assistant wrote.

    template = ChatTemplate.from_tokenizer_config("path/to/checkpoint")
    text = template.render(messages, add_generation_prompt=True)      # as transformers renders it
    text, spans = template.assistant_spans(messages)                  # the characters to train on

A chat template is Jinja, kept in ``tokenizer_config.json`` (``chat_template``) beside its special
tokens. It renders here as Hugging Face's ``apply_chat_template`` renders it: a sandbox that
cannot change what it is given, blocks trimmed (``trim_blocks``, ``lstrip_blocks``), ``break`` and
``continue`` in loops, ``raise_exception(message)``, ``strftime_now(format)``, a ``tojson`` that
keeps non-ASCII text, and the special tokens (``bos_token``, ``eos_token``, ...) as variables. A
``{% generation %}`` block renders its body.

The assistant's characters are found by rendering the conversation up to each assistant turn:
what its turn adds after the generation prompt of the turns before it is the assistant's (its
content and the template's end-of-turn tokens, which the model must learn to emit). A template
whose render of the first turns is not the start of the render of more turns cannot mark them so
and is refused in one line.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardax.errors import UsageError

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %} ... {% endgeneration %}``: the body, as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return environment


def _token_text(token: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": ...}``."""
    return token.get("content") if isinstance(token, Mapping) else token


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template (Jinja source) and the special tokens it is rendered with."""

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    where: str = "the chat template"

    @property
    def fingerprint(self) -> str:
        """What the template renders with (its source and special tokens), as a short hash."""
        text = json.dumps([self.source, dict(sorted(self.special_tokens.items()))])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def end_of_turn(self) -> str:
        """What the template writes after an assistant's reply (``<|eot_id|>``, ``<|im_end|>``,
        ``</s>``...), found by rendering one: where generation stops."""
        marker = "\ue000reply\ue000"
        text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
        return text[text.index(marker) + len(marker):].strip() if marker in text else ""

    @classmethod
    def from_tokenizer_config(cls, directory: str | Path) -> ChatTemplate:
        """The template in ``directory/tokenizer_config.json`` (or its ``chat_template.jinja``)."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((entry.get("template") for entry in source if entry.get("name") == "default"), None)
        if source is None and (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            raise UsageError(f"{directory} has no chat template (no chat_template in tokenizer_config.json, "
                             "no chat_template.jinja); give one, or train on plain text")
        tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if _token_text(config.get(name))}
        return cls(source, tokens, f"the chat template of {directory}")

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               **variables: Any) -> str:
        """The conversation as the model reads it; with ``add_generation_prompt``, followed by
        what opens the assistant's next turn."""
        import jinja2

        check_messages(messages)
        try:
            template = _environment().from_string(self.source)
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **variables})
        except jinja2.exceptions.TemplateError as error:
            raise UsageError(f"{self.where} failed to render this conversation ({error}); check its roles "
                             "and order, or give another template") from None

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character spans the assistant's turns
        add to it (content and end-of-turn tokens), in order."""
        text = self.render(messages)
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            opened = self.render(messages[:index], add_generation_prompt=True) if index else ""
            closed = self.render(messages[:index + 1])
            if not (closed.startswith(opened) and text.startswith(closed)):
                raise UsageError(f"{self.where} renders the first {index + 1} turns as other than the start "
                                 "of the whole conversation, so the assistant's turns cannot be told apart; "
                                 "use a template whose turns only add to the text (as Llama, Qwen and "
                                 "Mistral's do)")
            if len(closed) > len(opened):
                spans.append((len(opened), len(closed)))
        return text, spans


def check_messages(messages: Any, where: str = "the conversation") -> None:
    """Refuse, in one line, what is not a list of ``{"role": ..., "content": ...}`` with known roles."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise UsageError(f"{where} is {type(messages).__name__}; give a non-empty list of "
                         "{'role': ..., 'content': ...} messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise UsageError(f"{where}: message {index} is not {{'role': ..., 'content': ...}} "
                             f"({str(message)[:60]})")
        if message["role"] not in ROLES:
            raise UsageError(f"{where}: message {index} has role {message['role']!r}; use one of "
                             f"{', '.join(ROLES)}")


BUILT_IN = ChatTemplate(
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    {}, "shardax's built-in chat template (<|role|> before each turn, <|end|> after it)")


def chat_template(given: str | Path | None, tokenizer: str | Path | None = None) -> ChatTemplate:
    """The template conversations render with: ``given`` (a checkpoint's folder or a ``.jinja``
    file), else the one beside a ``tokenizer.json`` file, else ``BUILT_IN`` (named in the header)."""
    if given is not None:
        path = Path(given)
        if path.is_file():
            return ChatTemplate(path.read_text(), {}, f"the chat template {path}")
        if not path.is_dir():
            raise UsageError(f"--chat-template {given} is neither a checkpoint's folder nor a .jinja file")
        return ChatTemplate.from_tokenizer_config(path)
    folder = Path(tokenizer).parent if tokenizer is not None and Path(tokenizer).is_file() else None
    if folder is not None and ((folder / "chat_template.jinja").is_file()
                               or "chat_template" in _config(folder)):
        return ChatTemplate.from_tokenizer_config(folder)
    return BUILT_IN


def _config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
