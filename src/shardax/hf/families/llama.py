"""Llama (``LlamaForCausalLM``) and Mistral: RMSNorm, a SwiGLU MLP, grouped-query attention and
RoPE (Llama 3's scaling too); Mistral's window on every layer.

``Llama`` is also the base of the other families here and of a user's: a subclass changes what
differs (``defaults``, ``features``, ``written``, ``tensor_name``) and keeps the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardax.hf.families.config_fields import rope_fields, rope_json, shape_fields, shape_json, window_fields
from shardax.hf.registry import Family, refuse, register_family, registered
from shardax.models.transformer import TransformerConfig

# the fields that count a mixture's experts, in the families that have one
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


class Llama(Family):
    """A Llama-shaped family. ``defaults``: what transformers' config class assumes where
    ``config.json`` is silent (those that change the model); ``activation``: the field naming the
    MLP's activation and the one computed; ``ignored``: fields other families honour that this one's
    model ignores; ``experts_field``: the field counting its experts (None: a dense MLP)."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    defaults: Mapping[str, Any] = {}
    activation = ("hidden_act", "silu")
    ignored: tuple[str, ...] = ()
    experts_field: str | None = None

    def read(self, raw: dict[str, Any], path: Path) -> TransformerConfig:
        self.check(raw, path)
        raw = {**self.defaults, **raw}
        return TransformerConfig(**shape_fields(raw), **rope_fields(path, raw), **self.features(raw, path))

    def check(self, raw: dict[str, Any], path: Path) -> None:
        """Refuse a field (before ``defaults``) that would make shardax compute another model."""
        field, expected = self.activation
        if raw.get(field, expected) != expected:
            raise refuse(path, field, raw[field], f"this family's MLP is computed with {expected}")
        for name in ("attention_bias", "mlp_bias"):
            if raw.get(name) and name not in self.ignored:
                raise refuse(path, name, raw[name], "shardax puts no bias on the output projections")
        for name in EXPERT_COUNTS:
            if raw.get(name) and name != self.experts_field:
                mixtures = [f.model_type for f in registered() if getattr(f, "experts_field", None)]
                raise refuse(path, name, raw[name],
                             f"of mixtures of experts only {', '.join(mixtures)}'s are")
        if raw.get("router_jitter_noise"):
            raise refuse(path, "router_jitter_noise", raw["router_jitter_noise"],
                         "the router takes no noise here")
        if raw.get("use_bidirectional_attention"):
            raise refuse(path, "use_bidirectional_attention", True, "shardax's attention is causal")

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        """The ``TransformerConfig`` fields beyond the shape and RoPE (``raw`` with ``defaults``)."""
        return {"norm": "rms", "mlp": "swiglu"}

    def write(self, config: TransformerConfig) -> dict[str, Any]:
        return {**shape_json(config), **rope_json(config), self.activation[0]: self.activation[1],
                **self.written(config)}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        """The ``config.json`` fields of ``features`` (what ``write`` adds to the shape and RoPE)."""
        return {}


class Mistral(Llama):
    """Mistral: Llama with a sliding window on every layer (``sliding_window``; ``layer_types``
    is not Mistral's)."""

    model_type = "mistral"
    architecture = "MistralForCausalLM"
    defaults = {"sliding_window": 4096}

    def features(self, raw: dict[str, Any], path: Path) -> dict[str, Any]:
        every = [True] * int(raw["num_hidden_layers"])
        return {**super().features(raw, path), **window_fields(raw.get("sliding_window"), every)}

    def written(self, config: TransformerConfig) -> dict[str, Any]:
        return {"sliding_window": config.sliding_window or None}


register_family(Llama())
register_family(Mistral())
