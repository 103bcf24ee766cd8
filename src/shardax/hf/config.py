"""``config.json`` read into a ``TransformerConfig`` and written back, by the registered families.

Every field that changes what the model computes is either honoured or refused in one line that
names it (by the family of ``model_type``), so that a model never silently computes something
else than its checkpoint defines; a model is saved as a family only if that family's
``config.json`` reads back as the same model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from shardax.errors import UsageError
from shardax.hf.registry import Family, get_family, registered
from shardax.models.transformer import LORA_TARGETS, TransformerConfig

# how a model runs, which the loader sets and config.json does not hold
RUNTIME = ("compute_dtype", "param_dtype", "remat", "scan_layers", "attention", "lora_rank", "lora_alpha",
           "lora_targets", "capacity_factor", "router_z_loss")


def read_raw(path: Path) -> dict[str, Any]:
    """The settings in ``path``'s ``config.json``, or a ``UsageError`` saying why there are none."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} has no config.json; give a Hugging Face model directory") from None
    except (OSError, ValueError) as error:
        raise UsageError(f"{path / 'config.json'} is unreadable ({error}); give a Hugging Face model "
                         "directory") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path / 'config.json'} holds no settings; give a Hugging Face model directory")
    return raw


def checkpoint_family(path: Path) -> Family:
    """The registered family of the checkpoint in ``path`` (by its ``config.json``'s ``model_type``)."""
    return get_family(read_raw(path).get("model_type"), path)


def read_config(path: str | Path, *, seq_len: int | None = None, compute_dtype: str = "float32",
                param_dtype: str = "float32", remat: str = "none", scan_layers: bool = True,
                attention: str = "auto", lora_rank: int = 0, lora_alpha: float | None = None,
                lora_targets: tuple[str, ...] = LORA_TARGETS,
                capacity_factor: float | None = None) -> TransformerConfig:
    """The ``TransformerConfig`` of the checkpoint in ``path`` (its ``config.json``).

    ``seq_len``: the longest sequence to run (default: ``max_position_embeddings``). ``lora_*``:
    LoRA adapters to fine-tune it with (see ``TransformerConfig``). ``param_dtype``: the weights'
    dtype (``bfloat16`` keeps a bfloat16 checkpoint's as they are). ``capacity_factor``: a
    mixture of experts' routing (None: dropless)."""
    path = Path(path)
    return config_of(path, read_raw(path), seq_len=seq_len, compute_dtype=compute_dtype,
                     param_dtype=param_dtype, remat=remat, scan_layers=scan_layers, attention=attention,
                     lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=tuple(lora_targets),
                     capacity_factor=capacity_factor)


def config_of(path: Path, raw: dict[str, Any], seq_len: int | None = None,
              **options: Any) -> TransformerConfig:
    """``read_config`` of the settings ``raw`` (read from ``path``, which errors name)."""
    family = get_family(raw.get("model_type"), path)
    try:
        config = family.read(raw, path)
    except KeyError as error:
        raise UsageError(f"{path / 'config.json'} lacks {error.args[0]}; give a Hugging Face model "
                         "directory") from None
    return dataclasses.replace(config, seq_len=seq_len or config.seq_len, **options)


NO_PLACE = "no Hugging Face family computes this model, so it cannot be saved in that layout"


def _attempt(family: Family, config: TransformerConfig,
             base: dict[str, Any]) -> tuple[dict[str, Any], float, UsageError | None]:
    """``config.json`` for ``config`` as ``family`` (``base``'s other fields kept), how many fields
    of the model it would load with otherwise (infinite: ``family`` refuses it) and the error
    saying the first (None: it reads back as this model)."""
    written = family.write(config)
    raw = {**base, **written, "model_type": family.model_type, "architectures": [family.architecture]}
    if "max_position_embeddings" in written:  # a longer context the checkpoint had stays
        raw["max_position_embeddings"] = max(config.seq_len, int(base.get("max_position_embeddings", 0)))
    options = {name: getattr(config, name) for name in RUNTIME}
    try:
        again = config_of(Path("."), raw, seq_len=config.seq_len, **options)
    except UsageError as error:
        return raw, float("inf"), UsageError(f"this model has no place in a {family.model_type} config.json "
                                             f"({error}); {NO_PLACE}")
    # the same model however it is spelled: head size, key/value heads and experts' width given or
    # implied; an all-experts model's dense width, which it never uses
    config, again = (dataclasses.replace(c, attention_head_dim=c.head_dim, n_kv_heads=c.kv_heads,
                                         d_ff=c.ff_width if c.n_experts else c.d_ff,
                                         expert_d_ff=c.ff_width if c.n_experts else c.expert_d_ff)
                     for c in (config, again))
    differ = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(again, f.name)]
    if not differ:
        return raw, 0, None
    name = differ[0]
    return raw, len(differ), UsageError(
        f"this model's {name}={getattr(config, name)!r} has no place in a {family.model_type} config.json "
        f"(it would load as {getattr(again, name)!r}); {NO_PLACE}")


def saved_as(config: TransformerConfig, base: dict[str, Any] | None = None) -> tuple[Family, dict[str, Any]]:
    """The family a model of ``config`` is saved as, and its ``config.json``: ``base``'s family
    (the ``config.json`` it was loaded with, whose other fields stay) if that reads back as this
    model, else the first registered one that does. None does: the error names the family that
    would load it with the fewest fields changed."""
    base = dict(base or {})
    kind = base.get("model_type")
    families = [f for f in registered() if f.model_type == kind]
    families += [f for f in registered() if f.model_type != kind]
    misses: list[tuple[float, UsageError]] = []
    for family in families:
        raw, distance, error = _attempt(family, config, base)
        if error is None:
            return family, raw
        misses.append((distance, error))
    if config.norm == "layer" or config.mlp == "gelu" or config.positions != "rotary":
        raise UsageError(f"this model has {config.norm} norms, a {config.mlp} MLP and {config.positions} "
                         "positions; only the Llama and Gemma families (RMSNorm, gated MLPs, rotary "
                         "positions) have a Hugging Face layout to save in (shardax 0.1's presets had layer "
                         "norms and GELU MLPs: a new run of a preset exports)")
    if not misses:
        raise UsageError("no Hugging Face family is registered to save this model as; register one with "
                         "shardax.hf.register_family")
    raise min(misses, key=lambda miss: miss[0])[1]  # the first of the nearest


def config_json(config: TransformerConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for ``config`` (``base``: the one it was loaded with, whose other fields stay)."""
    return saved_as(config, base)[1]
