"""Gemma 1, 2 and 3 (its text model): a GeGLU MLP (tanh GELU), RMSNorm scaled by ``1 + w``,
embeddings scaled by the square root of the width and a tied head; Gemma 2 adds norms after
attention and the MLP, its query scale, soft-capped scores and logits and windows on alternate
layers; Gemma 3 q/k norms, a RoPE base of its own for the windowed layers and windows on all but
every ``sliding_window_pattern``-th layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardax.hf.families.config_fields import TANH_GELU, layer_types_json, listed_sliding, window_fields
from shardax.hf.families.llama import Llama
from shardax.hf.registry import register_family
from shardax.models.transformer import TransformerConfig


class Gemma(Llama):
    model_type = "gemma"
    architecture = "GemmaForCausalLM"
    defaults = {"head_dim": 256, "tie_word_embeddings": True}
    activation = ("hidden_act", TANH_GELU)

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        return {"norm": "rms_plus_one", "mlp": "geglu", "scale_embeddings": True}

    def write(self, config: TransformerConfig) -> dict[str, Any]:
        return {**super().write(config), "hidden_act": TANH_GELU, "hidden_activation": TANH_GELU}


class Gemma2(Gemma):
    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    defaults = {"head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    activation = ("hidden_activation", TANH_GELU)

    def default_sliding(self, raw: dict[str, Any]) -> list[bool]:
        """Which layers slide where ``config.json`` has no ``layer_types``: alternate ones."""
        return [bool((i + 1) % 2) for i in range(int(raw["num_hidden_layers"]))]

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        scalar = float(raw["query_pre_attn_scalar"])
        fields = {**super().features(raw, path), "post_norms": True,
                  "attention_scale": None if scalar == float(raw["head_dim"]) else scalar ** -0.5,
                  "attention_softcap": raw.get("attn_logit_softcapping"),
                  "logits_softcap": raw.get("final_logit_softcapping")}
        if raw.get("sliding_window"):
            sliding = listed_sliding(path, raw)
            fields.update(window_fields(raw["sliding_window"], self.default_sliding(raw) if sliding is None
                                        else sliding))
        return fields

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        scalar = float(config.head_dim) if config.attention_scale is None else config.attention_scale ** -2
        return {"query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                "attn_logit_softcapping": config.attention_softcap,
                "final_logit_softcapping": config.logits_softcap,
                "sliding_window": config.sliding_window or None, "layer_types": layer_types_json(config)}


class Gemma3Text(Gemma2):
    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    defaults = {"head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                "query_pre_attn_scalar": 256, "rope_theta": 1e6}
    hints = {"gemma3": "the text model of gemma3 is gemma3_text (Gemma3ForCausalLM)"}

    def default_sliding(self, raw: dict[str, Any]) -> list[bool]:
        pattern = int(raw.get("sliding_window_pattern", 6))
        return [bool((i + 1) % pattern) for i in range(int(raw["num_hidden_layers"]))]

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        return {**super().features(raw, path), "qk_norm": True,
                "rope_local_theta": float(raw.get("rope_local_base_freq", 10000.0))}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        local = config.rope_local_theta or config.rope_theta
        return {**super().written(config), "rope_local_base_freq": local}


register_family(Gemma())
register_family(Gemma2())
register_family(Gemma3Text())
