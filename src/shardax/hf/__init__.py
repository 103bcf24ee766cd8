"""Hugging Face checkpoints of the Llama family, loaded straight into shards.

``load(path, mesh=..., strategy=...)`` reads ``config.json`` (its ``model_type`` names the
family: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, mixtral, qwen2_moe, qwen3_moe, or
one a user registers), builds the matching ``TransformerLM`` laid out by ``parallelize`` and fills
each parameter device by device: a device's slice is read from the safetensors files
(``model.safetensors``, or the shards a ``model.safetensors.index.json`` names) by its rows, so
a process reads only the rows and columns its own devices hold and never the whole model. The
weights are float32 unless ``param_dtype="bfloat16"`` keeps a bfloat16 checkpoint's as they are
(``stored_dtype`` says which a checkpoint holds; generation and LoRA's frozen base keep them so).
Hugging Face stores a linear layer's weight as ``[out, in]``; shardax keeps ``[in, heads,
head_dim]`` and friends, so each slice is read as the block of the transposed weight that
covers it.

What shardax's model does not compute (sliding windows, other RoPE scalings, biases on the
output projection, mixtures of experts, another activation) is refused in one line naming
the field of ``config.json``.

``save`` writes a model back (``merge=True`` folds LoRA adapters into the weights they adapt);
``save_adapters`` writes LoRA adapters alone in PEFT's layout, which ``peft`` puts on the
original checkpoint.

Families are plug-ins (``registry``): each says how its ``config.json`` reads into a
``TransformerConfig``, what it refuses, how it is written back and what it calls each tensor.
``families`` holds shardax's, registered as a user registers one (``register_family``); the
rest of the package never tells them apart.

The package: ``registry`` (``Family`` and the registry), ``families`` (shardax's), ``config``
(``config.json`` read and written through them), ``names`` (where each parameter comes from),
``files`` (safetensors read by slice and written), ``load`` and ``save``.
"""

from shardax.hf import families
from shardax.hf.config import config_json, read_config
from shardax.hf.files import DTYPES, SafeTensors, stored_dtype
from shardax.hf.load import Loaded, Pretrained, factory, initial_state, load
from shardax.hf.names import hf_names, is_adapter
from shardax.hf.registry import Family, family_names, get_family, register_family, unregister_family
from shardax.hf.save import save, save_adapters

__all__ = ["DTYPES", "Family", "Loaded", "Pretrained", "SafeTensors", "config_json", "factory", "families",
           "family_names", "get_family", "hf_names", "initial_state", "is_adapter", "load", "read_config",
           "register_family", "save", "save_adapters", "stored_dtype", "unregister_family"]
