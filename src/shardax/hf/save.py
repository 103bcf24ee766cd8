"""A model written back in Hugging Face's layout, or its LoRA adapters alone in PEFT's."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardax.errors import UsageError
from shardax.hf.config import saved_as
from shardax.hf.files import DTYPES, begin_write, check_output, finish_write, write_safetensors
from shardax.hf.names import MODULES, TARGETS, Source, hf_names, is_adapter, layer_sources, parameter_source
from shardax.hf.registry import Family
from shardax.models.transformer import TransformerConfig
from shardax.sharding.paths import path_to_str


def _gather(array: jax.Array, layer: int | None) -> np.ndarray:
    """One layer of ``array`` (or all of it) whole on this host: every process takes part, and
    holds one tensor at a time."""
    if array.is_fully_addressable:  # one process holds every piece
        return np.asarray(array if layer is None else array[layer])
    replicated = jax.sharding.NamedSharding(array.sharding.mesh, jax.sharding.PartitionSpec())
    whole = jax.jit(lambda a: a if layer is None else a[layer], out_shardings=replicated)(array)
    return np.asarray(whole.addressable_data(0))


def _lora_summary(config: TransformerConfig) -> str:
    return f"rank {config.lora_rank} on {','.join(config.lora_targets)}"


def _check_merge(config: TransformerConfig, merge: bool) -> None:
    """Refuse a LoRA model saved without ``merge``, and ``merge`` on a model without LoRA."""
    if config.lora_rank and not merge:
        raise UsageError(f"this model carries LoRA adapters ({_lora_summary(config)}): save(..., merge=True) "
                         "writes its weights with them merged in, save_adapters(...) the adapters alone in "
                         "PEFT's layout")
    if merge and not config.lora_rank:
        raise UsageError("merge=True merges LoRA adapters into the weights, and this model has none; drop "
                         "merge")


def _lora_delta(config: TransformerConfig, adapters: dict[str, jax.Array], name: str, below: str,
                component: int, index: int | None) -> Any:
    """The merged LoRA term of one component of one layer's weight (None: not adapted)."""
    target = TARGETS.get((below, component))
    if target is None or target not in config.lora_targets:
        return None
    stem = name.rsplit("/", 1)[0] + f"/lora_{target}_"
    a, b = (_gather(adapters[stem + part], index).astype(np.float32) for part in "ab")
    return config.lora_scale * np.tensordot(a, b, axes=1)


def _entries(arrays: dict[str, jax.Array], adapters: dict[str, jax.Array], config: TransformerConfig,
             family: Family, merge: bool) -> list[tuple[Any, ...]]:
    """Every Hugging Face tensor to write as ``(name, shape, array, layer index, source, component,
    merged delta or None)``, in Hugging Face's order: embedding, layers, norm, head."""
    entries = []
    for name, array in arrays.items():
        source, layer, below = parameter_source(name, config, family)
        layers = [layer] if layer is not None else [None] if source is not None else range(config.n_layers)
        for at in layers:
            one = source or layer_sources(config, at, family)[below]
            index = None if source is not None or layer is not None else at
            for tensor, component in one.components():
                merged = (functools.partial(_lora_delta, config, adapters, name, below, component, index)
                          if merge and source is None else None)
                entries.append((tensor, one.hf_shape(), array, index, one, component, merged))
    order = {name: i for i, name in enumerate(hf_names(config, family))}
    entries.sort(key=lambda entry: order[entry[0]])
    return entries


def _shard(entries: list[tuple[Any, ...]], itemsize: int, max_shard_bytes: int) -> list[list[Any]]:
    """``entries`` split in order into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    files: list[list[Any]] = [[]]
    size = 0
    for entry in entries:
        bytes_ = math.prod(entry[1]) * itemsize
        if files[-1] and size + bytes_ > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += bytes_
    return files


def _producer(cache: dict[tuple[int, int | None], np.ndarray], array: jax.Array, index: int | None,
              source: Source, component: int, merged: Any) -> Any:
    """A function that gathers one Hugging Face tensor; the components of a fused weight share one
    gather through ``cache``."""
    def tensor() -> np.ndarray:
        key = (id(array), index)
        if key not in cache:  # the components of one fused weight share one gather
            cache.clear()
            cache[key] = _gather(array, index)
        return source.to_hf(cache[key], component, merged() if merged else None)
    return tensor


def _write_index(partial: Path, names: list[str], files: list[list[Any]], itemsize: int) -> None:
    """Write ``model.safetensors.index.json``: the total size and which shard holds each tensor."""
    weight_map = {entry[0]: file_name for file_name, group in zip(names, files) for entry in group}
    total_size = sum(math.prod(entry[1]) * itemsize for group in files for entry in group)
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))


def save(out: str | Path, params: Any, config: TransformerConfig, *, hf_config: dict[str, Any] | None = None,
         dtype: str = "float32", max_shard_bytes: int = 2 << 30, merge: bool = False) -> Path:
    """Write ``params`` (a ``TransformerLM``'s, in any layout) as a Hugging Face checkpoint in
    ``out``: ``config.json``, ``model.safetensors`` or shards of at most ``max_shard_bytes`` with
    their index. A tensor at a time is gathered (every process takes part; process 0 writes).
    ``out`` must not hold files already; the checkpoint appears there whole or not at all.

    A model with LoRA adapters is saved with ``merge=True``: each adapted weight as
    ``W + (alpha / rank) A B``, the model it computes (``save_adapters`` writes them alone)."""
    out = Path(out)
    check_output(out, dtype)
    _check_merge(config, merge)
    family, raw = saved_as(config, hf_config)
    arrays = {path_to_str(keypath): leaf for keypath, leaf in jax.tree_util.tree_leaves_with_path(params)}
    adapters = {name: arrays.pop(name) for name in list(arrays) if is_adapter(name)}
    itemsize = np.dtype(DTYPES[dtype][1]).itemsize
    files = _shard(_entries(arrays, adapters, config, family, merge), itemsize, max_shard_bytes)
    writing, partial = begin_write(out)
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    cache: dict[tuple[int, int | None], np.ndarray] = {}
    for file_name, group in zip(names, files):
        producers = [(name, shape, _producer(cache, array, index, source, component, merged))
                     for name, shape, array, index, source, component, merged in group]
        if writing:
            write_safetensors(partial / file_name, producers, dtype)
        else:
            for _, _, tensor in producers:  # the gathers are collective: every process runs them
                tensor()
    if writing:
        if len(files) > 1:
            _write_index(partial, names, files, itemsize)
        raw["torch_dtype"] = dtype
        (partial / "config.json").write_text(json.dumps(raw, indent=2))
    return finish_write(writing, partial, out)


def save_adapters(out: str | Path, params: Any, config: TransformerConfig, *, base_model: str | None = None,
                  dtype: str = "float32") -> Path:
    """Write the LoRA adapters of ``params`` alone in PEFT's layout: ``adapter_config.json``
    (rank, alpha, target modules) and ``adapter_model.safetensors`` with each layer's
    ``...q_proj.lora_A.weight`` ``[rank, in]`` and ``lora_B.weight`` ``[out, rank]``, which
    ``peft.PeftModel.from_pretrained`` puts on the base model (``base_model``: its name or
    directory, recorded). A tensor at a time is gathered; process 0 writes."""
    out = Path(out)
    check_output(out, dtype)
    if not config.lora_rank:
        raise UsageError("this model has no LoRA adapters to save (it trained every weight); save(...) "
                         "writes it whole")
    arrays = {path_to_str(keypath): leaf for keypath, leaf in jax.tree_util.tree_leaves_with_path(params)}
    entries = []
    for layer in range(config.n_layers):
        for target, (inputs, _, outputs, _) in config.lora_shapes().items():
            for part, shape in (("a", (config.lora_rank, math.prod(inputs))),
                                ("b", (math.prod(outputs), config.lora_rank))):
                looped = f"blocks/layers/{layer}/lora_{target}_{part}"
                array, index = (arrays[looped], None) if looped in arrays else (
                    arrays[f"blocks/layers/lora_{target}_{part}"], layer)

                def tensor(array: jax.Array = array, index: int | None = index,
                           shape: tuple[int, ...] = shape, part: str = part) -> np.ndarray:
                    one = _gather(array, index)
                    return (one.reshape(-1, config.lora_rank).T if part == "a"
                            else one.reshape(config.lora_rank, -1).T)

                name = f"base_model.model.model.layers.{layer}.{MODULES[target]}.lora_{part.upper()}.weight"
                entries.append((name, shape, tensor))
    writing, partial = begin_write(out)
    if writing:
        write_safetensors(partial / "adapter_model.safetensors", entries, dtype)
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
    return finish_write(writing, partial, out)
