"""Mixtral: Mistral with a mixture of experts in every layer's place of the MLP (each token through
the ``num_experts_per_tok`` of ``num_local_experts`` its router weighs highest, their weights
renormalised), under its own tensor names (``block_sparse_moe``, ``w1``/``w3``/``w2``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardax.hf.families.config_fields import expert_fields, expert_json, window_fields
from shardax.hf.families.llama import Llama
from shardax.hf.registry import refuse, register_family
from shardax.models.transformer import TransformerConfig

# an expert's projections: Mixtral's name of each
PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def check_experts(path: Path, raw: dict[str, Any], field: str) -> None:
    """Refuse a mixture without experts (a dense model is another family)."""
    if int(raw[field]) < 1:
        raise refuse(path, field, raw[field], "a mixture of experts has one or more")


class Mixtral(Llama):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    defaults = {"num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "rms_norm_eps": 1e-5}
    experts_field = "num_local_experts"

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        check_experts(path, raw, self.experts_field)
        every = [True] * int(raw["num_hidden_layers"])
        return {**super().features(raw, path), **window_fields(raw.get("sliding_window"), every),
                **expert_fields(raw, self.experts_field, "intermediate_size", normalize=True)}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        return {"sliding_window": config.sliding_window or None, "intermediate_size": config.ff_width,
                **expert_json(config, self.experts_field)}

    def tensor_name(self, name: str) -> str:
        name = re.sub(r"\.mlp\.(gate|experts)\.", r".block_sparse_moe.\1.", name)
        return re.sub(r"(\.experts\.[^.]+\.)(gate_proj|up_proj|down_proj)\.",
                      lambda match: match[1] + PROJECTIONS[match[2]] + ".", name)


register_family(Mixtral())
