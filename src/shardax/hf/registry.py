"""The Hugging Face model families shardax knows: a small registry of ``Family`` plug-ins.

A family says how its ``config.json`` reads into a ``TransformerConfig`` (and what it refuses),
how a ``TransformerConfig`` is written back as its ``config.json``, and what it calls each tensor.
Loading looks the family up by ``config.json``'s ``model_type``; saving writes a model as the
first family that reads its ``config.json`` back as the same model. Nothing outside a family tells
families apart: shardax's own (``shardax.hf.families``) register themselves as a user registers
theirs::

    from shardax.hf import register_family
    from shardax.hf.families.llama import Llama

    class Tiny(Llama):
        model_type, architecture = "tiny", "TinyForCausalLM"

    register_family(Tiny())
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardax.errors import UsageError
from shardax.models.transformer import TransformerConfig


class Family:
    """One Hugging Face model family (a base to subclass; ``Llama`` is a whole one to change a
    part of). ``model_type``: ``config.json``'s; ``architecture``: its ``architectures[0]``
    (transformers' class); ``hints``: other ``model_type`` values this family is mistaken for,
    and what to tell whoever gives one."""

    model_type: str = ""
    architecture: str = ""
    hints: Mapping[str, str] = {}

    def read(self, raw: dict[str, Any], path: Path) -> TransformerConfig:
        """The model ``raw`` (``path``'s ``config.json``) defines, as transformers computes it
        (``seq_len``: ``max_position_embeddings``; how it runs is the loader's). What shardax
        would compute otherwise is refused: a ``UsageError`` of one line naming the field, its
        value and the fix (``refuse``). A missing required field may raise ``KeyError``."""
        raise NotImplementedError

    def write(self, config: TransformerConfig) -> dict[str, Any]:
        """The fields of ``config.json`` for a model of ``config`` (``model_type`` and
        ``architectures`` are added; the loaded ``config.json``'s other fields are kept)."""
        raise NotImplementedError

    def tensor_name(self, name: str) -> str:
        """This family's name of the tensor transformers' Llama calls ``name`` (Qwen2-MoE's names
        for a mixture of experts, ``{e}`` in place of an expert's number); the same by default."""
        return name


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Make ``family`` the one that loads ``config.json`` files of its ``model_type`` (and a
    candidate for saving); ``replace=True`` replaces a family registered under that name."""
    kind = getattr(family, "model_type", None)
    missing = [name for name in ("read", "write", "tensor_name") if not callable(getattr(family, name, None))]
    if not isinstance(kind, str) or not kind or missing or not getattr(family, "architecture", None):
        raise UsageError(f"register_family({family!r}): a family has a model_type, an architecture, read, "
                         "write and tensor_name; subclass shardax.hf.Family")
    if kind in _FAMILIES and not replace and _FAMILIES[kind] is not family:
        raise UsageError(f"a family of model_type={kind!r} is registered already "
                         f"({type(_FAMILIES[kind]).__name__}); give replace=True to replace it")
    _FAMILIES[kind] = family
    return family


def unregister_family(model_type: str) -> None:
    """Forget the family of ``model_type`` (nothing if there is none)."""
    _FAMILIES.pop(model_type, None)


def family_names() -> tuple[str, ...]:
    """The ``model_type`` of every registered family, in the order they were registered."""
    return tuple(_FAMILIES)


def registered() -> tuple[Family, ...]:
    """Every registered family, in the order they were registered."""
    return tuple(_FAMILIES.values())


def refuse(path: Path, field: str, value: Any, why: str) -> UsageError:
    """The one-line error for ``field=value`` of ``path``'s ``config.json``, which shardax does not
    compute as its family defines it (``why``)."""
    return UsageError(f"{path / 'config.json'}: {field}={json.dumps(value)} is not supported ({why}); "
                      f"shardax loads {', '.join(family_names())} as Hugging Face defines them")


def get_family(model_type: Any, path: Path = Path(".")) -> Family:
    """The family registered for ``model_type`` (of ``path``'s ``config.json``), or the one-line
    error that there is none."""
    if isinstance(model_type, str) and model_type in _FAMILIES:
        return _FAMILIES[model_type]
    hints = [hint for family in _FAMILIES.values() for kind, hint in getattr(family, "hints", {}).items()
             if kind == model_type]
    raise refuse(path, "model_type", model_type, hints[0] if hints else
                 "another architecture: register a shardax.hf.Family for it")
