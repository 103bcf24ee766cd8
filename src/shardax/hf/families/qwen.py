"""Qwen2 (biases on q, k and v) and Qwen3 (RMSNorm on each head's queries and keys), with their
window: with ``use_sliding_window``, the layers ``layer_types`` marks, else those from
``max_window_layers`` on (transformers' ``Qwen2Config`` and ``Qwen3Config``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardax.hf.families.config_fields import layer_types_json, listed_sliding, window_fields
from shardax.hf.families.llama import Llama
from shardax.hf.registry import register_family
from shardax.models.transformer import TransformerConfig


def qwen_window(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's and Qwen3's window (``raw`` with their defaults)."""
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return {}
    sliding = listed_sliding(path, raw)
    if sliding is None:
        sliding = [i >= int(raw["max_window_layers"]) for i in range(int(raw["num_hidden_layers"]))]
    return window_fields(raw["sliding_window"], sliding)


def qwen_window_json(config: TransformerConfig) -> dict[str, Any]:
    return {"use_sliding_window": bool(config.sliding_window),
            "sliding_window": config.sliding_window or None, "layer_types": layer_types_json(config)}


class Qwen2(Llama):
    """Qwen2: Llama with biases on q, k and v (its ``attention_bias`` and ``mlp_bias`` are not
    read) and Qwen's window."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    defaults = {"sliding_window": 4096, "max_window_layers": 28}
    ignored = ("attention_bias", "mlp_bias")

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        return {**super().features(raw, path), "qkv_bias": True, **qwen_window(path, raw)}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        return qwen_window_json(config)


class Qwen3(Llama):
    """Qwen3: Llama with RMSNorm on each head's queries and keys, and Qwen's window."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    defaults = {"sliding_window": 4096, "max_window_layers": 28}

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        return {**super().features(raw, path), "qk_norm": True, **qwen_window(path, raw)}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        return qwen_window_json(config)


register_family(Qwen2())
register_family(Qwen3())
