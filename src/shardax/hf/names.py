"""Hugging Face's names for shardax's ``TransformerLM``: where each parameter of the model comes
from among the checkpoint's tensors, named as transformers' Llama names them and renamed by the
checkpoint's family (``Family.tensor_name``)."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardax.errors import UsageError
from shardax.hf.config import saved_as
from shardax.hf.files import thread_buffer
from shardax.hf.registry import Family
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

    def components(self) -> list[tuple[str, Any]]:
        """Each Hugging Face tensor of this parameter: (its name, the component ``to_hf`` takes)."""
        return list(zip(self.names, range(len(self.names))))

    def to_hf(self, ours: np.ndarray, component: Any, delta: np.ndarray | None = None) -> np.ndarray:
        """The Hugging Face tensor of ``component`` from shardax's array (one layer's), plus
        ``delta`` (a merged LoRA term, in shardax's layout of that component) if given."""
        one = ours if self.axis is None else np.take(ours, component, axis=self.axis)
        if delta is not None:
            one = one.astype(np.float32) + delta
        if not self.transpose:
            return one
        if not self.inputs:
            return one.reshape(-1)
        return one.reshape(math.prod(self.inputs), math.prod(self.outputs)).T

    def read(self, tensors: SafeTensors, index: tuple[slice, ...], out: np.ndarray) -> None:
        """Write the block of this parameter under ``index`` into ``out`` (of its shape and dtype)."""
        if self.axis is None:
            self._one(tensors, self.names[0], index, out)
            return
        rest = index[:self.axis] + index[self.axis + 1:]
        for at, component in enumerate(range(len(self.names))[index[self.axis]]):
            self._one(tensors, self.names[component], rest, out[(slice(None),) * self.axis + (at,)])

    def _one(self, tensors: SafeTensors, name: str, index: tuple[slice, ...], out: np.ndarray) -> None:
        """The block of one tensor under ``index``, into ``out``: the rows (and columns) that cover
        the slice of each flattened group's first dimension are read, the rest cut in memory."""
        if not self.transpose:
            out[...] = tensors.block(name, index[0], index[1])
            return
        n_in = len(self.inputs)
        in_index, out_index = index[:n_in], index[n_in:]

        def span(shape: tuple[int, ...], cut: tuple[slice, ...]) -> slice:
            stride = math.prod(shape[1:])
            return slice(cut[0].start * stride, cut[0].stop * stride)

        def local(shape: tuple[int, ...],
                  cut: tuple[slice, ...]) -> tuple[tuple[int, ...], tuple[slice, ...]]:
            return (cut[0].stop - cut[0].start, *shape[1:]), (slice(None), *cut[1:])

        out_shape, out_cut = local(self.outputs, out_index)
        if not self.inputs:
            out[...] = tensors.block(name, span(self.outputs, out_index)).reshape(out_shape)[out_cut]
            return
        in_shape, in_cut = local(self.inputs, in_index)
        block = tensors.block(name, span(self.outputs, out_index), span(self.inputs, in_index))
        whole = all((cut.start or 0, size if cut.stop is None else cut.stop) == (0, size)
                    for cut, size in zip(in_cut + out_cut, in_shape + out_shape))
        flat = out.reshape(block.shape[::-1]) if whole else None
        if flat is not None and np.may_share_memory(flat, out):  # the slice is the block: straight in
            transpose_into(flat, block)
            return
        # else transposed into a buffer kept warm, and the slice of it copied
        transposed = _scratch(block.shape[::-1], out.dtype)
        transpose_into(transposed, block)
        out[...] = transposed.reshape(in_shape + out_shape)[in_cut + out_cut]


@dataclasses.dataclass(frozen=True)
class Experts(Source):
    """A parameter of every expert of a layer, stacked on a leading dimension of ``count``: each
    expert's tensors are ``names`` with ``{e}`` its number, read and written as ``Source`` does."""

    count: int = 1

    def one(self, expert: int) -> Source:
        return Source(tuple(n.format(e=expert) for n in self.names), self.inputs, self.outputs, self.axis,
                      self.transpose)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.count, *self.one(0).shape)

    def components(self) -> list[tuple[str, Any]]:
        return [(name, (e, c)) for e in range(self.count) for name, c in self.one(e).components()]

    def to_hf(self, ours: np.ndarray, component: Any, delta: np.ndarray | None = None) -> np.ndarray:
        expert, inner = component
        return self.one(expert).to_hf(ours[expert], inner, delta)

    def read(self, tensors: SafeTensors, index: tuple[slice, ...], out: np.ndarray) -> None:
        for at, expert in enumerate(range(self.count)[index[0]]):
            self.one(expert).read(tensors, index[1:], out[at])


def _named(sources: dict[str, Source], family: Family) -> dict[str, Source]:
    """``sources`` with each tensor named as ``family`` names it."""
    return {key: dataclasses.replace(source, names=tuple(family.tensor_name(name) for name in source.names))
            for key, source in sources.items()}


def _expert_sources(config: TransformerConfig, at: str) -> dict[str, Source]:
    """A mixture of experts' router and experts (Qwen2-MoE's names)."""
    d, e, f, s = config.d_model, config.n_experts, config.ff_width, config.shared_expert_d_ff
    moe = at + "mlp."
    expert = moe + "experts.{e}."
    sources = {"experts/router": Source((moe + "gate.weight",), (d,), (e,)),
               "experts/gate_up": Experts((expert + "gate_proj.weight", expert + "up_proj.weight"), (d,),
                                          (f,), axis=1, count=e),
               "experts/down": Experts((expert + "down_proj.weight",), (f,), (d,), count=e)}
    if s:
        shared = moe + "shared_expert."
        sources.update({
            "experts/shared_gate_up": Source((shared + "gate_proj.weight", shared + "up_proj.weight"), (d,),
                                             (s,), axis=1),
            "experts/shared_down": Source((shared + "down_proj.weight",), (s,), (d,)),
            "experts/shared_gate": Source((moe + "shared_expert_gate.weight",), (d,), (1,))})
    return sources


def layer_sources(config: TransformerConfig, layer: int, family: Family) -> dict[str, Source]:
    """Each per-layer parameter of ``TransformerLM`` (its path below the layer) and its tensors,
    named as ``family`` names them."""
    d, n, k, h, f = config.d_model, config.n_heads, config.kv_heads, config.head_dim, config.d_ff
    at = f"model.layers.{layer}."
    attn, mlp = at + "self_attn.", at + "mlp."
    sources = {
        "attn_norm/scale": Source((at + "input_layernorm.weight",), (), (d,)),
        "attn_out": Source((attn + "o_proj.weight",), (n, h), (d,)),
    }
    if config.n_experts:
        sources.update(_expert_sources(config, at))
    else:
        sources["mlp_gate_up"] = Source((mlp + "gate_proj.weight", mlp + "up_proj.weight"), (d,), (f,),
                                        axis=1)
        sources["mlp_out"] = Source((mlp + "down_proj.weight",), (f,), (d,))
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
    return _named(sources, family)


def global_sources(config: TransformerConfig, family: Family) -> dict[str, Source]:
    """The parameters of ``TransformerLM`` outside its layers and their tensors, as ``family`` names them."""
    d, v = config.d_model, config.vocab_size
    sources = {"embedding": Source(("model.embed_tokens.weight",), (v,), (d,), transpose=False),
               "final_norm/scale": Source(("model.norm.weight",), (), (d,))}
    if not config.tie_embeddings:
        sources["head"] = Source(("lm_head.weight",), (d,), (v,))
    return _named(sources, family)


def all_sources(config: TransformerConfig, family: Family) -> list[Source]:
    """Every parameter's source: those outside the layers, then each layer's."""
    return [*global_sources(config, family).values(),
            *(s for layer in range(config.n_layers) for s in layer_sources(config, layer, family).values())]


def check_tensor_names(tensors: SafeTensors, config: TransformerConfig, family: Family) -> None:
    """One line for a tensor the model needs that is missing, one whose shape is not what
    ``config.json`` says, or one the model has no place for."""
    expected = {}
    for source in all_sources(config, family):
        for name, _ in source.components():
            expected[name] = source.hf_shape()
    for name, shape in expected.items():
        if name not in tensors.where:
            raise UsageError(f"{tensors.path} lacks the tensor {name}, which its config.json implies; the "
                             "checkpoint is incomplete or of another model")
        if tensors.shape(name) != shape:
            raise UsageError(f"{tensors.path}: {name} has shape {list(tensors.shape(name))} but config.json "
                             f"implies {list(shape)}; the checkpoint and its config.json do not match")
    unknown = sorted(name for name in tensors.where if name not in expected and not name.endswith(IGNORED)
                     and not (config.tie_embeddings and name == family.tensor_name("lm_head.weight")))
    if unknown:
        raise UsageError(f"{tensors.path}: tensor {unknown[0]} has no place in the {config.n_layers}-layer "
                         f"model its config.json describes ({len(unknown)} such tensors); the checkpoint is "
                         "of another model")


def normalize_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(size)[:2]) for s, size in zip(index, shape))


def is_adapter(path: str) -> bool:
    """Whether a parameter path is a LoRA adapter's (``.../lora_q_a``), which no base checkpoint holds."""
    return path.rsplit("/", 1)[-1].startswith("lora_")


# the LoRA target each (parameter below the layer, component) of a projection computes
TARGETS = {("qkv", 0): "q", ("qkv", 1): "k", ("qkv", 2): "v", ("q", 0): "q", ("kv", 0): "k", ("kv", 1): "v",
           ("attn_out", 0): "o", ("mlp_gate_up", 0): "gate", ("mlp_gate_up", 1): "up", ("mlp_out", 0): "down"}


def parameter_source(path: str, config: TransformerConfig,
                     family: Family) -> tuple[Source | None, int | None, str]:
    """Where a parameter of ``TransformerLM`` comes from: (its source when it is not a layer's;
    the layer of a looped stack's parameter, None for a scanned stack's; its path below the layer)."""
    glob = global_sources(config, family)
    if path in glob:
        return glob[path], None, path
    parts = path.split("/")
    if parts[:2] != ["blocks", "layers"]:
        raise UsageError(f"parameter {path} of the model has no Hugging Face tensor")
    if parts[2].isdigit():  # a stack in a Python loop: one module per layer
        return None, int(parts[2]), "/".join(parts[3:])
    return None, None, "/".join(parts[2:])


def hf_names(config: TransformerConfig, family: Family | None = None) -> Sequence[str]:
    """Every Hugging Face tensor name a model of ``config`` reads (for inspection and tests), as
    ``family`` names them (default: the family it is saved as)."""
    sources = all_sources(config, family or saved_as(config)[0])
    return [name for source in sources for name, _ in source.components()]




# Hugging Face's module of each LoRA target
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


TILE = (16, 1024)  # rows and columns of the source transposed at a time (benchmark 17)


def transpose_into(out: np.ndarray, block: np.ndarray) -> None:
    """``out[...] = block.T`` cast to ``out``'s dtype, a tile at a time: each tile is cast where
    it lies and written across ``out`` while both are in cache (2-15x faster than numpy's one
    strided copy of ``block.T``; numpy lets other threads run meanwhile). Of 7 tile shapes on
    two threads, 16 x 1024 moved a 5632 x 2048 bfloat16 weight fastest, 1.2-1.5x 32 x 256's."""
    rows, columns = TILE
    if block.dtype == out.dtype and block.dtype.itemsize in (2, 4):  # bits moved as integers: faster
        unsigned = np.uint16 if block.dtype.itemsize == 2 else np.uint32
        out, block = out.view(unsigned), block.view(unsigned)
    for column in range(0, block.shape[1], columns):
        for row in range(0, block.shape[0], rows):
            tile = block[row:row + rows, column:column + columns]
            out[column:column + columns, row:row + rows] = (
                tile.astype(out.dtype) if tile.dtype != out.dtype else tile).T


_SCRATCH = threading.local()  # each thread's buffer for transposes


def _scratch(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array of ``shape`` over the calling thread's own buffer for transposes."""
    return thread_buffer(_SCRATCH, math.prod(shape) * np.dtype(dtype).itemsize).view(dtype).reshape(shape)
