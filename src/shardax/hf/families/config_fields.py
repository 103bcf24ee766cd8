"""What the Llama-shaped families share in ``config.json``: the shape, RoPE, which layers slide,
and a mixture of experts' fields, read and written. A family module composes these."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardax.hf.registry import refuse
from shardax.models.transformer import TransformerConfig

TANH_GELU = "gelu_pytorch_tanh"
LAYER_TYPES = ("sliding_attention", "full_attention")


def shape_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The shape of the model: vocabulary, widths, heads, layers, norms' epsilon, tied head, context."""
    heads = int(raw["num_attention_heads"])
    return {"vocab_size": int(raw["vocab_size"]), "seq_len": int(raw.get("max_position_embeddings", 2048)),
            "d_model": int(raw["hidden_size"]), "n_heads": heads, "n_layers": int(raw["num_hidden_layers"]),
            "d_ff": int(raw["intermediate_size"]), "positions": "rotary",
            "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "n_kv_heads": int(raw.get("num_key_value_heads") or heads),
            "attention_head_dim": raw.get("head_dim"), "norm_eps": float(raw.get("rms_norm_eps", 1e-6))}


def shape_json(config: TransformerConfig) -> dict[str, Any]:
    """``shape_fields`` written back."""
    return {"vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
            "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
            "max_position_embeddings": config.seq_len}


def rope_fields(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE's base and scaling: Llama 3's, or a linear one (Gemma 3's full-attention layers)."""
    scaling = raw.get("rope_scaling")
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    options: dict[str, Any] = {"rope_theta": float(raw.get("rope_theta", 10000.0))}
    if kind == "llama3":
        options["rope_scaling"] = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                   float(scaling["high_freq_factor"]),
                                   int(scaling["original_max_position_embeddings"]))
    elif kind == "linear":
        options["rope_linear_factor"] = float(scaling["factor"])
    elif kind not in (None, "default"):
        raise refuse(path, "rope_scaling", scaling, "of the RoPE scalings only Llama 3's and linear are")
    return options


def rope_json(config: TransformerConfig) -> dict[str, Any]:
    """``rope_fields`` written back."""
    scaling = None
    if config.rope_scaling is not None:
        factor, low, high, context = config.rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": context}
    elif config.rope_linear_factor != 1.0:
        scaling = {"rope_type": "linear", "factor": config.rope_linear_factor}
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling}


def listed_sliding(path: Path, raw: dict[str, Any]) -> list[bool] | None:
    """Which layers slide by ``config.json``'s ``layer_types`` (None: it has none)."""
    types, layers = raw.get("layer_types"), int(raw["num_hidden_layers"])
    if types is None:
        return None
    if not isinstance(types, list) or set(types) - set(LAYER_TYPES) or len(types) != layers:
        raise refuse(path, "layer_types", types, f"each of the {layers} layers is sliding_attention or "
                                                 "full_attention here")
    return [kind == "sliding_attention" for kind in types]


def window_fields(window: Any, sliding: Sequence[bool]) -> dict[str, Any]:
    """``TransformerConfig``'s window: ``window`` tokens in the layers ``sliding`` marks (none: ``{}``)."""
    if not window or not any(sliding):
        return {}
    return {"sliding_window": int(window),
            "sliding_layers": None if all(sliding) else tuple(i for i, s in enumerate(sliding) if s)}


def layer_types_json(config: TransformerConfig) -> list[str]:
    """Each layer's ``layer_types`` entry."""
    return [LAYER_TYPES[0] if window else LAYER_TYPES[1] for window in config.layer_windows]


def expert_fields(raw: dict[str, Any], count: str, width: str, normalize: bool,
                  shared: bool = False) -> dict[str, Any]:
    """A mixture of experts: ``raw[count]`` experts of ``raw[width]`` hidden units, their weights
    renormalised if ``normalize``, a shared expert if ``shared``."""
    return {"n_experts": int(raw[count]), "experts_per_token": int(raw["num_experts_per_tok"]),
            "expert_d_ff": int(raw[width]),
            "shared_expert_d_ff": int(raw.get("shared_expert_intermediate_size") or 0) if shared else 0,
            "normalize_top_k": normalize,
            # transformers adds the load-balancing loss to its loss only when it outputs the router's logits
            "router_aux_loss": float(raw.get("router_aux_loss_coef", 0.001))
                               if raw.get("output_router_logits") else 0.0}


def expert_json(config: TransformerConfig, count: str) -> dict[str, Any]:
    """``expert_fields`` written back (but the experts' width, whose field differs)."""
    fields = {count: config.n_experts, "num_experts_per_tok": config.experts_per_token,
              "output_router_logits": bool(config.router_aux_loss)}
    if config.router_aux_loss:
        fields["router_aux_loss_coef"] = config.router_aux_loss
    return fields
