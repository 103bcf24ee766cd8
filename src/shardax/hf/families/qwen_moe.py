"""Qwen2-MoE and Qwen3-MoE: a mixture of experts of their own width (``moe_intermediate_size``)
in every layer, weights renormalised with ``norm_topk_prob``; Qwen2-MoE has q/k/v biases
(``qkv_bias``) and a shared expert gated by a sigmoid, Qwen3-MoE q/k norms.

Their windows are not Qwen2's: transformers' ``Qwen3MoeConfig`` has no ``max_window_layers`` nor
``layer_types``, and with ``use_sliding_window`` every layer slides. Qwen2-MoE's window is
computed three ways by transformers (every layer under eager and sdpa attention; layers from
``max_window_layers`` on under flash_attention_2, as 4.57 does; alternate layers below it in 5.x):
it is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardax.hf.families.config_fields import expert_fields, expert_json, window_fields
from shardax.hf.families.llama import Llama
from shardax.hf.families.mixtral import check_experts
from shardax.hf.registry import refuse, register_family
from shardax.models.transformer import TransformerConfig

EVERY_LAYER_SPARSE = {"decoder_sparse_step": 1, "mlp_only_layers": []}


class QwenMoe(Llama):
    """What Qwen2-MoE and Qwen3-MoE share: every layer a mixture of ``num_experts`` (and a shared
    expert of ``shared_expert_intermediate_size`` beside them, if ``shared_expert``)."""

    experts_field = "num_experts"
    shared_expert = False

    def check(self, raw: dict[str, Any], path: Path) -> None:
        super().check(raw, path)
        if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
            field = "mlp_only_layers" if raw.get("mlp_only_layers") else "decoder_sparse_step"
            raise refuse(path, field, raw[field], "every layer of a stack is a mixture of experts here")

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        check_experts(path, raw, self.experts_field)
        return {**super().features(raw, path), **expert_fields(
            raw, self.experts_field, "moe_intermediate_size", normalize=bool(raw["norm_topk_prob"]),
            shared=self.shared_expert)}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        return {**expert_json(config, self.experts_field), "moe_intermediate_size": config.ff_width,
                "norm_topk_prob": config.normalize_top_k, **EVERY_LAYER_SPARSE,
                "use_sliding_window": bool(config.sliding_window),
                "sliding_window": config.sliding_window or None}


class Qwen2Moe(QwenMoe):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    defaults = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "qkv_bias": True,
                "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "sliding_window": 4096}
    shared_expert = True

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            raise refuse(path, "use_sliding_window", True, "transformers windows Qwen2-MoE's layers one "
                         "way under eager and sdpa attention and another under flash_attention_2; set it to "
                         "false if the model was trained without a window")
        if not raw.get("shared_expert_intermediate_size"):
            raise refuse(path, "shared_expert_intermediate_size", raw.get("shared_expert_intermediate_size"),
                         "a Qwen2-MoE layer has a shared expert beside the others")
        return {**super().features(raw, path), "qkv_bias": bool(raw["qkv_bias"])}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        return {**super().written(config), "qkv_bias": config.qkv_bias,
                "shared_expert_intermediate_size": config.shared_expert_d_ff}


class Qwen3Moe(QwenMoe):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    defaults = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": False, "sliding_window": 4096}

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        every = [True] * int(raw["num_hidden_layers"])
        return {**super().features(raw, path), "qk_norm": True,
                **window_fields(window, every)}


register_family(Qwen2Moe())
register_family(Qwen3Moe())
