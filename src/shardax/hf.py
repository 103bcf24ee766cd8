"""Hugging Face checkpoints of the Llama family, loaded straight into shards.

``load(path, mesh=..., strategy=...)`` reads ``config.json`` (``model_type`` llama, mistral,
qwen2 or qwen3), builds the matching ``TransformerLM`` laid out by ``parallelize`` and fills
each parameter device by device: a device's slice is read from the safetensors files
(``model.safetensors``, or the shards a ``model.safetensors.index.json`` names) with
safetensors' lazy slicing, so a process reads only the rows and columns its own devices hold
and never the whole model. Hugging Face stores a linear layer's weight as ``[out, in]``;
shardax keeps ``[in, heads, head_dim]`` and friends, so each slice is read as the block of
the transposed weight that covers it.

What shardax's model does not compute (sliding windows, other RoPE scalings, biases on the
output projection, mixtures of experts, another activation) is refused in one line naming
the field of ``config.json``.

``save`` writes a model back (``merge=True`` folds LoRA adapters into the weights they adapt);
``save_adapters`` writes LoRA adapters alone in PEFT's layout, which ``peft`` puts on the
original checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from shardax.errors import UsageError
from shardax.mesh import DeviceMeshManager
from shardax.model_parallel import ParallelModel, parallelize, trained_part
from shardax.models.transformer import LORA_TARGETS, LoRA, TransformerConfig, TransformerLM
from shardax.sharding.paths import path_to_str
from shardax.step.state import TrainState

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# buffers some checkpoints carry that are not weights
IGNORED = ("rotary_emb.inv_freq",)


def _refuse(path: Path, field: str, value: Any, why: str) -> UsageError:
    return UsageError(f"{path / 'config.json'}: {field}={json.dumps(value)} is not supported ({why}); shardax loads "
                      f"the Llama family ({', '.join(FAMILY)}) as Hugging Face defines it")


def read_config(path: str | Path, *, seq_len: int | None = None, compute_dtype: str = "float32",
                remat: str = "none", scan_layers: bool = True, attention: str = "auto", lora_rank: int = 0,
                lora_alpha: float | None = None, lora_targets: tuple[str, ...] = LORA_TARGETS) -> TransformerConfig:
    """The ``TransformerConfig`` of the checkpoint in ``path`` (its ``config.json``).

    ``seq_len``: the longest sequence to run (default: ``max_position_embeddings``, capped by a
    sliding window where one applies, within which attention is exact). ``lora_*``: LoRA
    adapters to fine-tune it with (see ``TransformerConfig``)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} has no config.json; give a Hugging Face model directory") from None
    except (OSError, ValueError) as error:
        raise UsageError(f"{path / 'config.json'} is unreadable ({error}); give a Hugging Face model directory") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path / 'config.json'} holds no settings; give a Hugging Face model directory")
    kind = raw.get("model_type")
    if kind not in FAMILY:
        raise _refuse(path, "model_type", kind, "another architecture")
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse(path, "hidden_act", raw["hidden_act"], "the Llama family's MLP is SwiGLU")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field) and kind != "qwen2":
            raise _refuse(path, field, raw[field], "shardax puts no bias on the output projections")
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(field):
            raise _refuse(path, field, raw[field], "mixtures of experts")
    scaling = raw.get("rope_scaling")
    rope = None
    if scaling:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise _refuse(path, "rope_scaling", scaling, "of the RoPE scalings only Llama 3's is")
        rope = (float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]))
    longest = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window") if (kind == "mistral" or raw.get("use_sliding_window")) else None
    if window:
        longest = min(longest, int(window))
    if seq_len is not None and window and seq_len > int(window):
        raise _refuse(path, "sliding_window", window, f"seq_len {seq_len} is longer: attention over a sliding window")
    try:
        return TransformerConfig(
            vocab_size=int(raw["vocab_size"]), seq_len=seq_len or longest, d_model=int(raw["hidden_size"]),
            n_heads=int(raw["num_attention_heads"]), n_layers=int(raw["num_hidden_layers"]),
            d_ff=int(raw["intermediate_size"]), positions="rotary",
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)), remat=remat, compute_dtype=compute_dtype,
            scan_layers=scan_layers, attention=attention, n_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            attention_head_dim=raw.get("head_dim"), norm="rms", norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            mlp="swiglu", qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
            rope_theta=float(raw.get("rope_theta", 10000.0)), rope_scaling=rope, lora_rank=lora_rank,
            lora_alpha=lora_alpha, lora_targets=tuple(lora_targets))
    except KeyError as error:
        raise UsageError(f"{path / 'config.json'} lacks {error.args[0]}; give a Hugging Face model directory") from None


# -- reading slices of safetensors files ------------------------------------------------------------------

class SafeTensors:
    """The tensors of a model directory by name, read a slice at a time (and the bytes read)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError):
                raise UsageError(f"{index} is unreadable or lacks weight_map; give a Hugging Face model "
                                 "directory") from None
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            raise UsageError(f"{path} holds neither model.safetensors nor model.safetensors.index.json; give a "
                             "Hugging Face model directory saved with safetensors")
        self.files: dict[str, Any] = {}  # open handles (each maps its file; ``release`` lets them go)
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            try:
                handle = safe_open(str(path / name), framework="flax")
            except FileNotFoundError:
                raise UsageError(f"{path / name} is missing (the index names it); download the whole "
                                 "checkpoint again") from None
            except Exception as error:  # safetensors' own error for a damaged header
                raise UsageError(f"{path / name} is not a readable safetensors file ({error}); download it "
                                 "again") from None
            for key in handle.keys():
                self.where[key] = name
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())
        if weight_map is not None:
            absent = [key for key, name in weight_map.items() if self.where.get(key) != name]
            if absent:
                raise UsageError(f"{path / weight_map[absent[0]]} lacks {absent[0]}, which the index places there; "
                                 "download the checkpoint again")
        self.bytes_read = 0

    def close(self) -> None:
        self.release()

    def release(self) -> None:
        """Unmap the files: the pages a read touched stop counting in this process's memory."""
        self.files = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, rows: slice, columns: slice | None = None) -> np.ndarray:
        """``tensor[rows, columns]`` (``columns`` None: a vector) in the file's dtype (bfloat16 as
        ``ml_dtypes``' numpy type); whoever places it casts it."""
        from safetensors import safe_open

        file = self.where[name]
        if file not in self.files:
            self.files[file] = safe_open(str(self.path / file), framework="flax")
        part = self.files[file].get_slice(name)
        block = part[rows] if columns is None else part[rows, columns]
        array = np.asarray(block)
        self.bytes_read += array.nbytes
        return array


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


def _give_back_freed_memory() -> None:
    """Return the host memory freed while reading a weight to the system (glibc keeps freed heap
    memory for reuse otherwise, and it would count against the process until the load ends)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


_TRANSPOSE = jax.jit(lambda block: block.T.astype(jnp.float32))


def _transposed(block: np.ndarray) -> np.ndarray:
    """``block.T`` as float32, copied by XLA on the host's CPU (numpy's strided copy is about 6x
    slower)."""
    return np.asarray(_TRANSPOSE(jax.device_put(block, jax.local_devices(backend="cpu")[0])))


def _sources(config: TransformerConfig, layer: int) -> dict[str, Source]:
    """Each per-layer parameter of ``TransformerLM`` (its path below the layer) and its tensors."""
    d, n, k, h, f = config.d_model, config.n_heads, config.kv_heads, config.head_dim, config.d_ff
    at = f"model.layers.{layer}."
    attn, mlp = at + "self_attn.", at + "mlp."
    sources = {
        "attn_norm/scale": Source((at + "input_layernorm.weight",), (), (d,)),
        "mlp_norm/scale": Source((at + "post_attention_layernorm.weight",), (), (d,)),
        "attn_out": Source((attn + "o_proj.weight",), (n, h), (d,)),
        "mlp_gate_up": Source((mlp + "gate_proj.weight", mlp + "up_proj.weight"), (d,), (f,), axis=1),
        "mlp_out": Source((mlp + "down_proj.weight",), (f,), (d,)),
    }
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


@dataclasses.dataclass
class Loaded:
    """A checkpoint in shards: its config, its layout and its state (``state.params`` filled)."""

    config: TransformerConfig
    parallel: ParallelModel
    state: TrainState
    bytes_read: int
    hf_config: dict[str, Any] | None = None  # config.json as it was read

    def save(self, out: str | Path, **options: Any) -> Path:
        """``save(out, self.state.params, self.config)`` keeping ``config.json``'s other fields."""
        return save(out, self.state.params, self.config, hf_config=self.hf_config, **options)

    def model(self) -> TransformerLM:
        """The model as a module (its parameters stay where they are)."""
        return nnx.merge(self.parallel.graphdef, self.state.params, self.state.rest)


def factory(path: str | Path, lora: LoRA | None = None, **options: Any) -> Any:
    """``rngs -> TransformerLM`` of the checkpoint in ``path``'s config (``read_config``'s
    options), with ``lora``'s adapters if given."""
    config = read_config(path, **options)
    config = config if lora is None else lora.applied(config)
    return lambda rngs: TransformerLM(config, rngs=rngs)


def initial_state(parallel: ParallelModel, path: str | Path, seed: int = 0) -> tuple[TrainState, int]:
    """A ``TrainState`` for ``parallel`` whose parameters are the checkpoint's in ``path``, each
    device's slice read straight from the files; the optimizer's state starts from them. Returns
    it and the bytes this process read. ``parallel``'s model must be the checkpoint's (a
    ``TransformerLM`` of its config, scanned or looped, any remat or precision, with or
    without LoRA adapters, which start from ``seed`` as ``parallel.init`` makes them)."""
    path = Path(path)
    abstract, shardings = parallel.abstract_state, parallel.state_shardings
    model = nnx.merge(parallel.graphdef, abstract.params, abstract.rest)
    config = getattr(model, "config", None)
    if not isinstance(model, TransformerLM) or not isinstance(config, TransformerConfig):
        raise UsageError(f"init_from={str(path)!r} needs the model to be a TransformerLM (shardax.hf.factory(path) "
                         f"makes the checkpoint's); got {type(model).__name__}")
    expected = read_config(path, seq_len=config.seq_len, compute_dtype=config.compute_dtype, remat=config.remat,
                           scan_layers=config.scan_layers, attention=config.attention, lora_rank=config.lora_rank,
                           lora_alpha=config.lora_alpha, lora_targets=config.lora_targets)
    if expected != config:
        differ = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(expected, f.name)]
        raise UsageError(f"init_from={str(path)!r}: the model's {differ[0]}={getattr(config, differ[0])!r} but the "
                         f"checkpoint's config.json gives {getattr(expected, differ[0])!r}; build the model with "
                         "shardax.hf.factory(path)")
    tensors = SafeTensors(path)
    _check_names(tensors, config)

    def fill(keypath: Any, leaf: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
        name = path_to_str(keypath)
        source, layer, below = _parameter_source(name, config)

        def key(index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
            return tuple((s.start, s.stop) for s in _normalize(index, leaf.shape))

        # devices that hold the same slice read it once; a slice is let go once its last device has it
        wanted = collections.Counter(key(index) for index in
                                     sharding.addressable_devices_indices_map(leaf.shape).values())
        blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

        def block(index: tuple[slice, ...]) -> np.ndarray:
            at = key(index)
            if at not in blocks:
                blocks[at] = read(_normalize(index, leaf.shape))
                tensors.release()
            wanted[at] -= 1
            return blocks.pop(at) if wanted[at] <= 0 else blocks[at]

        def read(index: tuple[slice, ...]) -> np.ndarray:
            """One device's slice, filled a layer at a time: besides the slice itself, only one
            layer's part of it is ever held."""
            out = np.empty(tuple(s.stop - s.start for s in index), leaf.dtype)
            if source is not None:
                out[...] = source.read(tensors, index)
            elif layer is not None:
                out[...] = _sources(config, layer)[below].read(tensors, index)
            else:
                for row, at in enumerate(range(config.n_layers)[index[0]]):
                    out[row] = _sources(config, at)[below].read(tensors, index[1:])
            return out

        array = jax.make_array_from_callback(leaf.shape, sharding, block)
        _give_back_freed_memory()
        return array

    loaded = {path_to_str(keypath): fill(keypath, leaf, sharding) for (keypath, leaf), sharding in zip(
        jax.tree_util.tree_leaves_with_path(abstract.params), jax.tree.leaves(shardings.params))
        if not is_adapter(path_to_str(keypath))}
    tensors.close()

    # the rest of the state in its shards: the step, the adapters, the optimizer's state over the
    # trained weights and the model's other variables (the random weights init would make for
    # the loaded ones are never computed)
    def start(loaded: dict[str, jax.Array]) -> TrainState:
        fresh = parallel.init(seed)
        params = jax.tree_util.tree_map_with_path(lambda keypath, leaf: loaded.get(path_to_str(keypath), leaf),
                                                  fresh.params)
        return dataclasses.replace(fresh, params=params, opt_state=parallel.tx.init(
            trained_part(params, parallel.trainable)))

    state = jax.jit(start, out_shardings=shardings, donate_argnums=0)(loaded)
    return state, tensors.bytes_read


def load(path: str | Path, mesh: Mesh | str | None = None, strategy: Any = "dp", *,
         tx: optax.GradientTransformation | None = None, seq_len: int | None = None,
         compute_dtype: str = "float32", remat: str = "none", scan_layers: bool = True,
         lora: LoRA | None = None, seed: int = 0) -> Loaded:
    """The Hugging Face checkpoint in ``path`` laid out on ``mesh`` by ``strategy``, each device's
    slice of each weight read straight from the files (``mesh``: a ``Mesh``, a shape such as
    ``"data=4,model=2"``, default every device on ``data``). ``tx`` (default: none) sets up the
    optimizer state for training on; ``lora`` adds adapters (from ``seed``), which alone train."""
    path = Path(path)
    config = read_config(path, seq_len=seq_len, compute_dtype=compute_dtype, remat=remat, scan_layers=scan_layers)
    config = config if lora is None else lora.applied(config)
    if mesh is None or isinstance(mesh, str):
        mesh = DeviceMeshManager().create_device_mesh(mesh or "data=-1")
    SafeTensors(path).close()  # a missing or damaged file is said before anything is laid out
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), tx or optax.identity(), mesh, strategy)
    state, read = initial_state(parallel, path, seed)
    return Loaded(config, parallel, state, read, json.loads((path / "config.json").read_text()))


def hf_names(config: TransformerConfig) -> Sequence[str]:
    """Every Hugging Face tensor name a model of ``config`` reads (for inspection and tests)."""
    names = [n for s in _global_sources(config).values() for n in s.names]
    return names + [n for layer in range(config.n_layers) for s in _sources(config, layer).values() for n in s.names]


# -- writing Hugging Face checkpoints ------------------------------------------------------------------------

DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", jnp.bfloat16), "float16": ("F16", np.float16)}


def config_json(config: TransformerConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for ``config`` (``base``: the one it was loaded with, whose other fields stay)."""
    if config.norm != "rms" or config.mlp != "swiglu" or config.positions != "rotary":
        raise UsageError(f"this model has {config.norm} norms, a {config.mlp} MLP and {config.positions} positions; "
                         "only the Llama family (rms, swiglu, rotary) has a Hugging Face layout to save in")
    kind = "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else (base or {}).get("model_type", "llama")
    if kind not in FAMILY:
        kind = "llama"
    architecture = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}[kind]
    raw = dict(base or {})
    raw.update(model_type=kind, architectures=[architecture], vocab_size=config.vocab_size,
               hidden_size=config.d_model, intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
               num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
               rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, hidden_act="silu",
               tie_word_embeddings=config.tie_embeddings,
               max_position_embeddings=max(config.seq_len, int(raw.get("max_position_embeddings", 0))))
    if config.rope_scaling is not None:
        factor, low, high, context = config.rope_scaling
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": context}
    else:
        raw["rope_scaling"] = None
    if kind == "qwen2":
        raw.setdefault("use_sliding_window", False)
    return raw


def _gather(array: jax.Array, layer: int | None) -> np.ndarray:
    """One layer of ``array`` (or all of it) whole on this host: every process takes part, and
    holds one tensor at a time."""
    if array.is_fully_addressable:  # one process holds every piece
        return np.asarray(array if layer is None else array[layer])
    replicated = jax.sharding.NamedSharding(array.sharding.mesh, jax.sharding.PartitionSpec())
    whole = jax.jit(lambda a: a if layer is None else a[layer], out_shardings=replicated)(array)
    return np.asarray(whole.addressable_data(0))


def _hf_tensor(source: Source, component: int, ours: np.ndarray, delta: np.ndarray | None = None) -> np.ndarray:
    """The Hugging Face tensor ``source.names[component]`` from shardax's array (one layer's),
    plus ``delta`` (a merged LoRA term, in shardax's layout of that component) if given."""
    one = ours if source.axis is None else np.take(ours, component, axis=source.axis)
    if delta is not None:
        one = one.astype(np.float32) + delta
    if not source.transpose:
        return one
    if not source.inputs:
        return one.reshape(-1)
    return one.reshape(math.prod(source.inputs), math.prod(source.outputs)).T


def _write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], Any]], dtype: str) -> None:
    """A safetensors file written a tensor at a time (the header first: every shape is known).
    ``entries``: (name, shape, a function giving the tensor)."""
    code, numpy_dtype = DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * np.dtype(numpy_dtype).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for _, _, produce in entries:
            file.write(np.ascontiguousarray(produce(), dtype=numpy_dtype).tobytes())


def _check_out(out: Path, dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"dtype={dtype!r}; use one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not an empty directory; choose a new directory to save in")


def _lora_summary(config: TransformerConfig) -> str:
    return f"rank {config.lora_rank} on {','.join(config.lora_targets)}"


def save(out: str | Path, params: Any, config: TransformerConfig, *, hf_config: dict[str, Any] | None = None,
         dtype: str = "float32", max_shard_bytes: int = 2 << 30, merge: bool = False) -> Path:
    """Write ``params`` (a ``TransformerLM``'s, in any layout) as a Hugging Face checkpoint in
    ``out``: ``config.json``, ``model.safetensors`` or shards of at most ``max_shard_bytes`` with
    their index. A tensor at a time is gathered (every process takes part; process 0 writes).
    ``out`` must not hold files already; the checkpoint appears there whole or not at all.

    A model with LoRA adapters is saved with ``merge=True``: each adapted weight as
    ``W + (alpha / rank) A B``, the model it computes (``save_adapters`` writes them alone)."""
    out = Path(out)
    _check_out(out, dtype)
    if config.lora_rank and not merge:
        raise UsageError(f"this model carries LoRA adapters ({_lora_summary(config)}): save(..., merge=True) writes "
                         "its weights with them merged in, save_adapters(...) the adapters alone in PEFT's layout")
    if merge and not config.lora_rank:
        raise UsageError("merge=True merges LoRA adapters into the weights, and this model has none; drop merge")
    raw = config_json(config, hf_config)
    arrays = {path_to_str(keypath): leaf for keypath, leaf in jax.tree_util.tree_leaves_with_path(params)}
    adapters = {name: arrays.pop(name) for name in list(arrays) if is_adapter(name)}

    def delta(name: str, below: str, component: int, index: int | None) -> Any:
        """The merged LoRA term of one component of one layer's weight (None: not adapted)."""
        target = TARGETS.get((below, component))
        if target is None or target not in config.lora_targets:
            return None
        stem = name.rsplit("/", 1)[0] + f"/lora_{target}_"
        a, b = (_gather(adapters[stem + part], index).astype(np.float32) for part in "ab")
        return config.lora_scale * np.tensordot(a, b, axes=1)

    entries = []  # (name, shape, producer) in Hugging Face's order: embedding, layers, norm, head
    for name, array in arrays.items():
        source, layer, below = _parameter_source(name, config)
        layers = [layer] if layer is not None else [None] if source is not None else range(config.n_layers)
        for at in layers:
            one = source or _sources(config, at)[below]
            index = None if source is not None or layer is not None else at
            for component, tensor in enumerate(one.names):
                merged = functools.partial(delta, name, below, component, index) if merge and source is None else None
                entries.append((tensor, one.hf_shape(), array, index, one, component, merged))
    order = {name: i for i, name in enumerate(hf_names(config))}
    entries.sort(key=lambda entry: order[entry[0]])
    itemsize = np.dtype(DTYPES[dtype][1]).itemsize
    files: list[list[Any]] = [[]]
    size = 0
    for entry in entries:
        bytes_ = math.prod(entry[1]) * itemsize
        if files[-1] and size + bytes_ > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += bytes_
    writing, partial = _begin(out)
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    cache: dict[tuple[int, int | None], np.ndarray] = {}

    def produce(array: jax.Array, index: int | None, source: Source, component: int, merged: Any) -> Any:
        def tensor() -> np.ndarray:
            key = (id(array), index)
            if key not in cache:  # the components of one fused weight share one gather
                cache.clear()
                cache[key] = _gather(array, index)
            return _hf_tensor(source, component, cache[key], merged() if merged else None)
        return tensor

    for file_name, group in zip(names, files):
        producers = [(name, shape, produce(array, index, source, component, merged))
                     for name, shape, array, index, source, component, merged in group]
        if writing:
            _write_safetensors(partial / file_name, producers, dtype)
        else:
            for _, _, tensor in producers:  # the gathers are collective: every process runs them
                tensor()
    if writing:
        if len(files) > 1:
            weight_map = {entry[0]: file_name for file_name, group in zip(names, files) for entry in group}
            (partial / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": sum(math.prod(e[1]) * itemsize for e in entries)},
                 "weight_map": weight_map}, indent=2))
        raw["torch_dtype"] = dtype
        (partial / "config.json").write_text(json.dumps(raw, indent=2))
    return _finish(writing, partial, out)


def _begin(out: Path) -> tuple[bool, Path]:
    """(whether this process writes, the directory it writes into before it becomes ``out``)."""
    writing = jax.process_index() == 0
    partial = out.with_name(out.name + ".partial")
    if writing:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    return writing, partial


def _finish(writing: bool, partial: Path, out: Path) -> Path:
    if writing:
        if out.exists():
            out.rmdir()
        partial.rename(out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("shardax: Hugging Face checkpoint saved")
    return out


# Hugging Face's module of each LoRA target
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def save_adapters(out: str | Path, params: Any, config: TransformerConfig, *, base_model: str | None = None,
                  dtype: str = "float32") -> Path:
    """Write the LoRA adapters of ``params`` alone in PEFT's layout: ``adapter_config.json``
    (rank, alpha, target modules) and ``adapter_model.safetensors`` with each layer's
    ``...q_proj.lora_A.weight`` ``[rank, in]`` and ``lora_B.weight`` ``[out, rank]``, which
    ``peft.PeftModel.from_pretrained`` puts on the base model (``base_model``: its name or
    directory, recorded). A tensor at a time is gathered; process 0 writes."""
    out = Path(out)
    _check_out(out, dtype)
    if not config.lora_rank:
        raise UsageError("this model has no LoRA adapters to save (it trained every weight); save(...) writes it whole")
    arrays = {path_to_str(keypath): leaf for keypath, leaf in jax.tree_util.tree_leaves_with_path(params)}
    entries = []
    for layer in range(config.n_layers):
        for target, (inputs, _, outputs, _) in config.lora_shapes().items():
            for part, shape in (("a", (config.lora_rank, math.prod(inputs))),
                                ("b", (math.prod(outputs), config.lora_rank))):
                looped = f"blocks/layers/{layer}/lora_{target}_{part}"
                array, index = (arrays[looped], None) if looped in arrays else (
                    arrays[f"blocks/layers/lora_{target}_{part}"], layer)

                def tensor(array: jax.Array = array, index: int | None = index, shape: tuple[int, ...] = shape,
                           part: str = part) -> np.ndarray:
                    one = _gather(array, index)
                    return one.reshape(-1, config.lora_rank).T if part == "a" else one.reshape(config.lora_rank, -1).T

                name = f"base_model.model.model.layers.{layer}.{MODULES[target]}.lora_{part.upper()}.weight"
                entries.append((name, shape, tensor))
    writing, partial = _begin(out)
    if writing:
        _write_safetensors(partial / "adapter_model.safetensors", entries, dtype)
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": config.lora_rank, "lora_alpha": config.lora_alpha or config.lora_rank, "lora_dropout": 0.0,
            "target_modules": sorted(MODULES[t].split(".")[1] for t in config.lora_targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None}
        (partial / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    else:
        for _, _, tensor in entries:  # the gathers are collective: every process runs them
            tensor()
    return _finish(writing, partial, out)
