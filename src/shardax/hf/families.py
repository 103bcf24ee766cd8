"""The model families shardax loads from Hugging Face, read from and written to ``config.json``.

The Llama family (llama, mistral, qwen2, qwen3) and Gemma (gemma, gemma2, gemma3_text), each as
``transformers`` computes it: every field that changes what the model computes is either
honoured or refused in one line that names it, so that a model never silently computes
something else than its checkpoint defines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from shardax.errors import UsageError
from shardax.models.transformer import LORA_TARGETS, TransformerConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
FAMILY = tuple(ARCHITECTURES)
GEMMA = ("gemma", "gemma2", "gemma3_text")
QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # a sliding window only with use_sliding_window
# the field that counts the experts
EXPERTS = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}
TANH_GELU = "gelu_pytorch_tanh"
# what transformers' config classes assume where config.json is silent (those that change the model)
DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096}, "qwen2": {"sliding_window": 4096, "max_window_layers": 28},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "qkv_bias": True, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "max_window_layers": 28},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "max_window_layers": 28},
    "gemma": {"head_dim": 256},
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256, "rope_theta": 1e6},
}


def refuse(path: Path, field: str, value: Any, why: str) -> UsageError:
    return UsageError(f"{path / 'config.json'}: {field}={json.dumps(value)} is not supported ({why}); "
                      f"shardax loads {', '.join(FAMILY)} as Hugging Face defines them")


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


def _check_supported(path: Path, raw: dict[str, Any]) -> None:
    """Refuse an architecture, or a field of one, that shardax does not compute as transformers does."""
    kind = raw.get("model_type")
    if kind not in FAMILY:
        hint = ("the text model of gemma3 is gemma3_text (Gemma3ForCausalLM)" if kind == "gemma3"
                else "another architecture")
        raise refuse(path, "model_type", kind, hint)
    field, expected = ("hidden_activation", TANH_GELU) if kind in ("gemma2", "gemma3_text") else (
        ("hidden_act", TANH_GELU) if kind == "gemma" else ("hidden_act", "silu"))
    if raw.get(field, expected) != expected:
        raise refuse(path, field, raw[field], f"this family's MLP is computed with {expected}")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name) and kind != "qwen2":
            raise refuse(path, name, raw[name], "shardax puts no bias on the output projections")
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(name) and EXPERTS.get(kind) != name:
            raise refuse(path, name, raw[name], f"of mixtures of experts only {', '.join(EXPERTS)}'s are")
    if kind in ("qwen2_moe", "qwen3_moe") and (raw.get("decoder_sparse_step", 1) != 1
                                               or raw.get("mlp_only_layers")):
        field = "mlp_only_layers" if raw.get("mlp_only_layers") else "decoder_sparse_step"
        raise refuse(path, field, raw[field], "every layer of a stack is a mixture of experts here")
    if raw.get("router_jitter_noise"):
        raise refuse(path, "router_jitter_noise", raw["router_jitter_noise"],
                     "the router takes no noise here")
    if raw.get("use_bidirectional_attention"):
        raise refuse(path, "use_bidirectional_attention", True, "shardax's attention is causal")


def _rope(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE's options: Llama 3's scaling, or a linear one (Gemma 3's full-attention layers)."""
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
    if raw.get("model_type") == "gemma3_text":
        options["rope_local_theta"] = float(raw.get("rope_local_base_freq", 10000.0))
    return options


def _default_sliding(kind: str, raw: dict[str, Any], layers: int) -> list[bool]:
    """Which layers slide when ``config.json`` has no ``layer_types`` (as transformers decides)."""
    if kind in QWEN:
        return [i >= int(raw.get("max_window_layers", 28)) for i in range(layers)]
    if kind == "gemma2":
        return [bool((i + 1) % 2) for i in range(layers)]
    if kind == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return [bool((i + 1) % pattern) for i in range(layers)]
    return [True] * layers  # mistral


def _windows(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The sliding window and the layers it applies to (none: ``{}``)."""
    kind, layers = raw.get("model_type"), int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    if kind in ("llama", "gemma") or not window or (kind in QWEN and not raw.get("use_sliding_window")):
        return {}
    types = raw.get("layer_types")
    if types is None or kind in ("mistral", "mixtral"):
        sliding = _default_sliding(kind, raw, layers)
    else:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != layers:
            raise refuse(path, "layer_types", types, f"each of the {layers} layers is sliding_attention or "
                                                     "full_attention here")
        sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return {}
    return {"sliding_window": int(window),
            "sliding_layers": None if all(sliding) else tuple(i for i, s in enumerate(sliding) if s)}


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    kind = raw["model_type"]
    if kind not in EXPERTS:
        return {}
    return {"n_experts": int(raw[EXPERTS[kind]]), "experts_per_token": int(raw["num_experts_per_tok"]),
            "expert_d_ff": int(raw["intermediate_size" if kind == "mixtral" else "moe_intermediate_size"]),
            "shared_expert_d_ff": int(raw.get("shared_expert_intermediate_size") or 0)
                                  if kind == "qwen2_moe" else 0,
            "normalize_top_k": kind == "mixtral" or bool(raw["norm_topk_prob"]),
            # transformers adds the load-balancing loss to its loss only when it outputs the router's logits
            "router_aux_loss": float(raw.get("router_aux_loss_coef", 0.001))
                               if raw.get("output_router_logits") else 0.0}


def _gemma(raw: dict[str, Any]) -> dict[str, Any]:
    kind = raw["model_type"]
    if kind not in GEMMA:
        biases = kind == "qwen2" or (kind == "qwen2_moe" and bool(raw["qkv_bias"]))
        return {"norm": "rms", "mlp": "swiglu", "qkv_bias": biases, "qk_norm": kind in ("qwen3", "qwen3_moe")}
    scalar = float(raw["query_pre_attn_scalar"]) if kind != "gemma" else None
    scale = None if scalar is None or scalar == float(raw["head_dim"]) else scalar ** -0.5
    return {"norm": "rms_plus_one", "mlp": "geglu", "scale_embeddings": True, "post_norms": kind != "gemma",
            "qk_norm": kind == "gemma3_text", "attention_scale": scale,
            "attention_softcap": raw.get("attn_logit_softcapping") if kind != "gemma" else None,
            "logits_softcap": raw.get("final_logit_softcapping") if kind != "gemma" else None}


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
    _check_supported(path, raw)
    raw = {**DEFAULTS.get(raw["model_type"], {}), **raw}
    try:
        heads = int(raw["num_attention_heads"])
        family = {**_rope(path, raw), **_windows(path, raw), **_gemma(raw), **_experts(raw)}
        return TransformerConfig(
            vocab_size=int(raw["vocab_size"]),
            seq_len=seq_len or int(raw.get("max_position_embeddings", 2048)), d_model=int(raw["hidden_size"]),
            n_heads=heads, n_layers=int(raw["num_hidden_layers"]), d_ff=int(raw["intermediate_size"]),
            positions="rotary",
            tie_embeddings=bool(raw.get("tie_word_embeddings", raw["model_type"] in GEMMA)),
            n_kv_heads=int(raw.get("num_key_value_heads") or heads), attention_head_dim=raw.get("head_dim"),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), **options, **family)
    except KeyError as error:
        raise UsageError(f"{path / 'config.json'} lacks {error.args[0]}; give a Hugging Face model "
                         "directory") from None


def family_of(config: TransformerConfig, base: dict[str, Any] | None = None) -> str:
    """The Hugging Face family a model of ``config`` is saved as (``base``'s where it fits)."""
    if config.norm == "rms_plus_one":
        kind = "gemma3_text" if config.qk_norm else "gemma2" if config.post_norms else "gemma"
    elif config.n_experts:
        kind = ("qwen3_moe" if config.qk_norm
                else "qwen2_moe" if config.qkv_bias or config.shared_expert_d_ff else "mixtral")
    else:
        kind = ("qwen3" if config.qk_norm
                else "qwen2" if config.qkv_bias else (base or {}).get("model_type", "llama"))
        if kind in GEMMA or kind in EXPERTS or kind not in FAMILY or kind == "llama":
            kind = "mistral" if config.sliding_window and config.sliding_layers is None else "llama"
    return kind


def _layer_types(config: TransformerConfig) -> list[str]:
    return ["sliding_attention" if w else "full_attention" for w in config.layer_windows]


def _family_fields(kind: str, config: TransformerConfig) -> dict[str, Any]:
    """The fields of ``config.json`` that differ between families."""
    if kind not in GEMMA:
        fields: dict[str, Any] = {"hidden_act": "silu", "sliding_window": config.sliding_window or None}
        if kind in QWEN:
            fields.update(use_sliding_window=bool(config.sliding_window), layer_types=_layer_types(config))
        if kind in EXPERTS:
            fields.update({EXPERTS[kind]: config.n_experts, "num_experts_per_tok": config.experts_per_token,
                           "output_router_logits": bool(config.router_aux_loss)})
            if config.router_aux_loss:
                fields["router_aux_loss_coef"] = config.router_aux_loss
        if kind == "mixtral":
            fields["intermediate_size"] = config.ff_width
        if kind in ("qwen2_moe", "qwen3_moe"):
            fields.update(moe_intermediate_size=config.ff_width, norm_topk_prob=config.normalize_top_k,
                          decoder_sparse_step=1, mlp_only_layers=[])
        if kind == "qwen2_moe":
            fields.update(qkv_bias=config.qkv_bias, shared_expert_intermediate_size=config.shared_expert_d_ff)
        return fields
    fields = {"hidden_act": TANH_GELU, "hidden_activation": TANH_GELU}
    if kind != "gemma":
        scalar = float(config.head_dim) if config.attention_scale is None else config.attention_scale ** -2
        fields.update(query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                      attn_logit_softcapping=config.attention_softcap,
                      final_logit_softcapping=config.logits_softcap,
                      sliding_window=config.sliding_window or None, layer_types=_layer_types(config))
    if kind == "gemma3_text":
        fields["rope_local_base_freq"] = config.rope_local_theta or config.rope_theta
    return fields


def config_json(config: TransformerConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for ``config`` (``base``: the one it was loaded with, whose other fields stay)."""
    if config.norm == "layer" or config.mlp == "gelu" or config.positions != "rotary":
        raise UsageError(f"this model has {config.norm} norms, a {config.mlp} MLP and {config.positions} "
                         "positions; only the Llama and Gemma families (RMSNorm, gated MLPs, rotary "
                         "positions) have a Hugging Face layout to save in (shardax 0.1's presets had layer "
                         "norms and GELU MLPs: a new run of a preset exports)")
    kind = family_of(config, base)
    raw = dict(base or {})
    raw.update(model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=config.vocab_size,
               hidden_size=config.d_model, intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
               num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
               head_dim=config.head_dim, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
               tie_word_embeddings=config.tie_embeddings,
               max_position_embeddings=max(config.seq_len, int(raw.get("max_position_embeddings", 0))))
    raw.update(_family_fields(kind, config))
    if config.rope_scaling is not None:
        factor, low, high, context = config.rope_scaling
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": context}
    else:
        raw["rope_scaling"] = ({"rope_type": "linear", "factor": config.rope_linear_factor}
                               if config.rope_linear_factor != 1.0 else None)
    _check_saved_as_it_is(config, kind, raw)
    return raw


def _check_saved_as_it_is(config: TransformerConfig, kind: str, raw: dict[str, Any]) -> None:
    """Refuse a model that ``raw`` would load as another (a feature no family of that name has)."""
    options = {name: getattr(config, name) for name in (
        "compute_dtype", "param_dtype", "remat", "scan_layers", "attention", "lora_rank", "lora_alpha",
        "lora_targets", "capacity_factor", "router_z_loss")}
    again = config_of(Path("."), raw, seq_len=config.seq_len, **options)
    # the same model however it is spelled: head size and key/value heads given or implied; an
    # all-experts model's dense width, which it never uses
    config, again = (dataclasses.replace(c, attention_head_dim=c.head_dim, n_kv_heads=c.kv_heads,
                                         d_ff=c.ff_width if c.n_experts else c.d_ff) for c in (config, again))
    differ = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(again, f.name)]
    if differ:
        raise UsageError(f"this model's {differ[0]}={getattr(config, differ[0])!r} has no place in a {kind} "
                         f"config.json (it would load as {getattr(again, differ[0])!r}); no Hugging Face "
                         "family computes this model, so it cannot be saved in that layout")
