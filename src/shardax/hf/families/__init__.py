"""The Hugging Face families shardax ships, each registered by its module as a user registers
theirs (``shardax.hf.register_family``): ``llama`` (Llama, Mistral), ``qwen`` (Qwen2, Qwen3),
``gemma`` (Gemma 1, 2 and 3's text model), ``mixtral`` and ``qwen_moe`` (Qwen2-MoE, Qwen3-MoE).
``config_fields`` holds the fields they share in ``config.json``.

Another family is one module: a ``Family`` (most simply a subclass of ``llama.Llama`` changing
what differs) and a ``register_family(...)`` call, imported before its checkpoints load.
"""

# in the order they register in, which saving tries them in
from shardax.hf.families import llama, qwen, gemma, mixtral, qwen_moe  # noqa: I001

__all__ = ["gemma", "llama", "mixtral", "qwen", "qwen_moe"]
