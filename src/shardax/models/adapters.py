"""LoRA adapters, kept importable from here: they live in ``shardax.adapters`` (any model's, not the LM's)."""

from shardax.adapters import (  # noqa: F401
    ADAPTABLE,
    LORA_TARGETS,
    LoRA,
    adapted_layers,
    add_lora,
    save_adapters,
)
