"""Hugging Face's names and config for shardax's ``TransformerLM``: ``config.json`` read and
written, and where each parameter of the model comes from among the checkpoint's tensors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from shardax.errors import UsageError
from shardax.models.transformer import TransformerConfig

if TYPE_CHECKING:
    from shardax.hf.files import SafeTensors


# buffers some checkpoints carry that are not weights
IGNORED = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Source:
    """How one parameter of shardax's model (one layer's part of it) comes from Hugging Face
    tensors: each of ``names`` (one per component, stacked on ``axis``) is ``W.T`` reshaped to
    ``inputs + outputs`` (a linear weight ``W [out, in]``), or ``W`` reshaped to ``outputs`` (a
    vector, ``inputs`` empty); ``transpose`` False keeps ``W`` as it is (the embedding)."""

    names: tuple[str, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    axis: int | None = None
    transpose: bool = True

    @property
    def shape(self) -> tuple[int, ...]:
        one = self.inputs + self.outputs
        return one if self.axis is None else one[:self.axis] + (len(self.names),) + one[self.axis:]

    def hf_shape(self) -> tuple[int, ...]:
        if not self.inputs:
            return (math.prod(self.outputs),)
        if not self.transpose:
            return self.inputs + self.outputs
        return (math.prod(self.outputs), math.prod(self.inputs))

    def read(self, tensors: SafeTensors, index: tuple[slice, ...]) -> np.ndarray:
        if self.axis is not None:
            components = range(len(self.names))[index[self.axis]]
            rest = index[:self.axis] + index[self.axis + 1:]
            return np.stack([self._one(tensors, self.names[c], rest) for c in components], axis=self.axis)
        return self._one(tensors, self.names[0], index)

    def _one(self, tensors: SafeTensors, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block of one tensor under ``index``: read the rows (and columns) that cover the
        slice of each flattened group's first dimension, then cut the rest in memory."""
        if not self.transpose:
            return tensors.read(name, index[0], index[1])
        n_in = len(self.inputs)
        in_index, out_index = index[:n_in], index[n_in:]

        def span(shape: tuple[int, ...], cut: tuple[slice, ...]) -> slice:
            stride = math.prod(shape[1:])
            return slice(cut[0].start * stride, cut[0].stop * stride)

        def local(shape: tuple[int, ...], cut: tuple[slice, ...]) -> tuple[tuple[int, ...], tuple[slice, ...]]:
            return (cut[0].stop - cut[0].start, *shape[1:]), (slice(None), *cut[1:])

        out_shape, out_cut = local(self.outputs, out_index)
        if not self.inputs:
            return tensors.read(name, span(self.outputs, out_index)).reshape(out_shape)[out_cut]
        in_shape, in_cut = local(self.inputs, in_index)
        block = tensors.read(name, span(self.outputs, out_index), span(self.inputs, in_index))
        return _transposed(block).reshape(in_shape + out_shape)[in_cut + out_cut]


def _sources(config: TransformerConfig, layer: int) -> dict[str, Source]:
    """Each per-layer parameter of ``TransformerLM`` (its path below the layer) and its tensors."""
    d, n, k, h, f = config.d_model, config.n_heads, config.kv_heads, config.head_dim, config.d_ff
    at = f"model.layers.{layer}."
    attn, mlp = at + "self_attn.", at + "mlp."
    sources = {
        "attn_norm/scale": Source((at + "input_layernorm.weight",), (), (d,)),
        "attn_out": Source((attn + "o_proj.weight",), (n, h), (d,)),
        "mlp_gate_up": Source((mlp + "gate_proj.weight", mlp + "up_proj.weight"), (d,), (f,), axis=1),
        "mlp_out": Source((mlp + "down_proj.weight",), (f,), (d,)),
    }
    if config.post_norms:  # Gemma 2 and 3: a norm after attention, and one before and one after the MLP
        sources["attn_post_norm/scale"] = Source((at + "post_attention_layernorm.weight",), (), (d,))
        sources["mlp_norm/scale"] = Source((at + "pre_feedforward_layernorm.weight",), (), (d,))
        sources["mlp_post_norm/scale"] = Source((at + "post_feedforward_layernorm.weight",), (), (d,))
    else:
        sources["mlp_norm/scale"] = Source((at + "post_attention_layernorm.weight",), (), (d,))
    q, kk, v = (attn + f"{x}_proj" for x in "qkv")
    if k == n:
        sources["qkv"] = Source((q + ".weight", kk + ".weight", v + ".weight"), (d,), (n, h), axis=1)
        if config.qkv_bias:
            sources["qkv_bias"] = Source((q + ".bias", kk + ".bias", v + ".bias"), (), (n, h), axis=0)
    else:
        sources["q"] = Source((q + ".weight",), (d,), (n, h))
        sources["kv"] = Source((kk + ".weight", v + ".weight"), (d,), (k, h), axis=1)
        if config.qkv_bias:
            sources["q_bias"] = Source((q + ".bias",), (), (n, h))
            sources["kv_bias"] = Source((kk + ".bias", v + ".bias"), (), (k, h), axis=0)
    if config.qk_norm:
        sources["q_norm/scale"] = Source((attn + "q_norm.weight",), (), (h,))
        sources["k_norm/scale"] = Source((attn + "k_norm.weight",), (), (h,))
    return sources


def _global_sources(config: TransformerConfig) -> dict[str, Source]:
    d, v = config.d_model, config.vocab_size
    sources = {"embedding": Source(("model.embed_tokens.weight",), (v,), (d,), transpose=False),
               "final_norm/scale": Source(("model.norm.weight",), (), (d,))}
    if not config.tie_embeddings:
        sources["head"] = Source(("lm_head.weight",), (d,), (v,))
    return sources


def _check_names(tensors: SafeTensors, config: TransformerConfig) -> None:
    """One line for a tensor the model needs that is missing, one whose shape is not what
    ``config.json`` says, or one the model has no place for."""
    expected = {}
    for source in [*_global_sources(config).values(),
                   *(s for layer in range(config.n_layers) for s in _sources(config, layer).values())]:
        for name in source.names:
            expected[name] = source.hf_shape()
    for name, shape in expected.items():
        if name not in tensors.where:
            raise UsageError(f"{tensors.path} lacks the tensor {name}, which its config.json implies; the checkpoint "
                             "is incomplete or of another model")
        if tensors.shape(name) != shape:
            raise UsageError(f"{tensors.path}: {name} has shape {list(tensors.shape(name))} but config.json implies "
                             f"{list(shape)}; the checkpoint and its config.json do not match")
    unknown = sorted(name for name in tensors.where if name not in expected and not name.endswith(IGNORED)
                     and not (config.tie_embeddings and name == "lm_head.weight"))
    if unknown:
        raise UsageError(f"{tensors.path}: tensor {unknown[0]} has no place in the {config.n_layers}-layer model its "
                         f"config.json describes ({len(unknown)} such tensors); the checkpoint is of another model")


def _normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(size)[:2]) for s, size in zip(index, shape))


def is_adapter(path: str) -> bool:
    """Whether a parameter path is a LoRA adapter's (``.../lora_q_a``), which no base checkpoint holds."""
    return path.rsplit("/", 1)[-1].startswith("lora_")


# the LoRA target each (parameter below the layer, component) of a projection computes
TARGETS = {("qkv", 0): "q", ("qkv", 1): "k", ("qkv", 2): "v", ("q", 0): "q", ("kv", 0): "k", ("kv", 1): "v",
           ("attn_out", 0): "o", ("mlp_gate_up", 0): "gate", ("mlp_gate_up", 1): "up", ("mlp_out", 0): "down"}


def _parameter_source(path: str, config: TransformerConfig) -> tuple[Source | None, int | None, str]:
    """Where a parameter of ``TransformerLM`` comes from: (its source when it is not a layer's;
    the layer of a looped stack's parameter, None for a scanned stack's; its path below the layer)."""
    glob = _global_sources(config)
    if path in glob:
        return glob[path], None, path
    parts = path.split("/")
    if parts[:2] != ["blocks", "layers"]:
        raise UsageError(f"parameter {path} of the model has no Hugging Face tensor")
    if parts[2].isdigit():  # a stack in a Python loop: one module per layer
        return None, int(parts[2]), "/".join(parts[3:])
    return None, None, "/".join(parts[2:])


def hf_names(config: TransformerConfig) -> Sequence[str]:
    """Every Hugging Face tensor name a model of ``config`` reads (for inspection and tests)."""
    names = [n for s in _global_sources(config).values() for n in s.names]
    return names + [n for layer in range(config.n_layers) for s in _sources(config, layer).values() for n in s.names]




# Hugging Face's module of each LoRA target
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


_TRANSPOSE = jax.jit(lambda block: block.T.astype(jnp.float32))


def _transposed(block: np.ndarray) -> np.ndarray:
    """``block.T`` as float32, copied by XLA on the host's CPU (numpy's strided copy is about 6x
    slower)."""
    return np.asarray(_TRANSPOSE(jax.device_put(block, jax.local_devices(backend="cpu")[0])))
