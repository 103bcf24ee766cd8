"""A Hugging Face checkpoint loaded into shards: each device reads only its own slice."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from shardax.errors import UsageError
from shardax.hf.config import checkpoint_family, read_config
from shardax.hf.files import SafeTensors, give_back_freed_memory, new_memory, stored_dtype
from shardax.hf.names import check_tensor_names, is_adapter, layer_sources, normalize_index, parameter_source
from shardax.hf.registry import Family
from shardax.hf.save import save
from shardax.model_parallel import ParallelModel, parallelize
from shardax.model_state import trained_part
from shardax.models.transformer import LoRA, TransformerConfig, TransformerLM
from shardax.sharding.paths import path_to_str
from shardax.step.state import TrainState

READERS = min(4, os.cpu_count() or 1)  # threads reading a checkpoint's parameters


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


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A Hugging Face checkpoint as a model factory: ``Pretrained(...)(rngs)`` builds its
    ``TransformerLM`` (fresh weights, as any factory), and ``initial_state(parallel, seed)`` lays
    the checkpoint's weights out into ``parallel`` (``Trainer(init_from=...)`` calls it)."""

    path: Path
    config: TransformerConfig

    def __call__(self, rngs: nnx.Rngs) -> TransformerLM:
        return TransformerLM(self.config, rngs=rngs)

    def initial_state(self, parallel: ParallelModel, seed: int = 0) -> TrainState:
        return initial_state(parallel, self.path, seed)[0]

    def lora_factory(self, lora: LoRA) -> Pretrained:
        """``Trainer(lora=...)``'s hook: this checkpoint with ``lora``'s adapters, its frozen
        weights kept in the dtype they are stored in."""
        kept = dataclasses.replace(self.config, param_dtype=stored_dtype(self.path))
        return Pretrained(self.path, lora.applied(kept))


def factory(path: str | Path, lora: LoRA | None = None, **options: Any) -> Pretrained:
    """``rngs -> TransformerLM`` of the checkpoint in ``path``'s config (``read_config``'s
    options), with ``lora``'s adapters if given (the frozen weights then stay in the checkpoint's
    dtype unless ``param_dtype`` says otherwise); its ``initial_state`` loads the weights."""
    if lora is not None:
        options = {"param_dtype": stored_dtype(Path(path)), **options}
    config = read_config(path, **options)
    return Pretrained(Path(path), config if lora is None else lora.applied(config))


def _checkpoint_config(parallel: ParallelModel, path: Path) -> TransformerConfig:
    """``parallel``'s model's config, checked to be a ``TransformerLM`` of the checkpoint's config."""
    abstract = parallel.abstract_state
    model = nnx.merge(parallel.graphdef, abstract.params, abstract.rest)
    config = getattr(model, "config", None)
    if not isinstance(model, TransformerLM) or not isinstance(config, TransformerConfig):
        raise UsageError(f"init_from={str(path)!r} needs the model to be a TransformerLM "
                         f"(shardax.hf.factory(path) makes the checkpoint's); got {type(model).__name__}")
    expected = read_config(path, seq_len=config.seq_len, compute_dtype=config.compute_dtype,
                           param_dtype=config.param_dtype,
                           remat=config.remat, scan_layers=config.scan_layers, attention=config.attention,
                           lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
                           lora_targets=config.lora_targets, capacity_factor=config.capacity_factor)
    if expected != config:
        differ = [f.name for f in dataclasses.fields(config)
                  if getattr(config, f.name) != getattr(expected, f.name)]
        raise UsageError(f"init_from={str(path)!r}: the model's {differ[0]}={getattr(config, differ[0])!r} "
                         f"but the checkpoint's config.json gives {getattr(expected, differ[0])!r}; build "
                         "the model with shardax.hf.factory(path)")
    return config


class _Staging:
    """The host memory a checkpoint's slices are arranged in before their devices take them. A CPU
    device takes an aligned host array as its buffer as it is: a slice that CPU devices hold is
    arranged in new memory, which the first of them keeps (nothing copied; the others copy it).
    Other devices copy from the host: their slices share ``limit`` bytes (or one slice, if larger),
    in two halves while two slices fit, so that a slice is copied to its devices while the next is
    arranged in the other half; a part is written again only once its copies are done (and its
    pages stay warm from one slice to the next)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.buffer = limit, np.empty(0, np.uint8)
        self.copies: list[list[jax.Array]] = [[], []]
        self.turn = 0

    def array(self, shape: tuple[int, ...], dtype: Any, devices: list[Any]) -> np.ndarray:
        """Host memory for a slice of ``shape`` that ``devices`` will hold (see the class)."""
        size, half = math.prod(shape) * np.dtype(dtype).itemsize, self.limit // 2 // 64 * 64
        if _kept(devices):
            return new_memory(size).view(dtype).reshape(shape)
        halves = size <= half
        self.turn = 1 - self.turn if halves else 0
        jax.block_until_ready(self.copies if not halves else self.copies[self.turn])
        if self.buffer.size < max(size, self.limit):
            self.buffer = np.empty(max(size, self.limit), np.uint8)
        start = self.turn * half if halves else 0
        return self.buffer[start:start + size].view(dtype).reshape(shape)

    def copy(self, block: np.ndarray, devices: list[Any]) -> list[jax.Array]:
        """``block`` (the last ``array``) on each of ``devices`` (not waited for)."""
        if _kept(devices):  # the first device takes the block's memory as it is; no two share it
            return [jax.device_put(block, devices[0]), *(_copied(block, device) for device in devices[1:])]
        self.copies[self.turn] = [_copied(block, device) for device in devices]
        return self.copies[self.turn]

    def done(self) -> None:
        jax.block_until_ready(self.copies)
        self.buffer = np.empty(0, np.uint8)


def _kept(devices: list[Any]) -> bool:
    """Whether ``devices`` keep the host memory a slice is arranged in (CPU devices do)."""
    return all(device.platform == "cpu" for device in devices)


def _copied(block: np.ndarray, device: Any) -> jax.Array:
    """``block`` on ``device`` in memory of its own: a CPU device takes an aligned host array as
    its buffer as it is (whatever ``may_alias`` says), and ``block`` is written again or held by
    another device."""
    placed = jax.device_put(block, device)
    try:
        aliased = placed.unsafe_buffer_pointer() == block.ctypes.data
    except Exception:  # a platform that cannot say never shares the host's memory
        aliased = False
    return jnp.array(placed, copy=True) if aliased else placed


def _fill(pool: concurrent.futures.Executor, staging: _Staging, tensors: SafeTensors,
          config: TransformerConfig, family: Family, keypath: Any, leaf: jax.ShapeDtypeStruct,
          sharding: Any) -> jax.Array:
    """The parameter at ``keypath`` in ``sharding``: each distinct slice this process's devices
    hold is read into ``staging`` (by ``pool``'s threads, a layer of a stack each, or a slice
    whole) and put on the devices that hold it."""
    name = path_to_str(keypath)
    source, layer, below = parameter_source(name, config, family)
    if source is None and layer is not None:
        source = layer_sources(config, layer, family)[below]
    by_slice: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        index = normalize_index(index, leaf.shape)
        by_slice.setdefault(tuple((s.start, s.stop) for s in index), [index]).append(device)
    arrays = {}
    for index, *devices in by_slice.values():
        block = staging.array(tuple(s.stop - s.start for s in index), leaf.dtype, devices)

        def whole() -> None:
            source.read(tensors, index, block)
            tensors.release()

        def one_layer(stacked: int) -> None:  # layer ``stacked`` of a scanned stack
            layer_sources(config, stacked, family)[below].read(tensors, index[1:],
                                                               block[stacked - index[0].start])
            tensors.release()

        # read by the pool's threads only, whose transpose buffers end with them (the slices one at
        # a time: two threads reading a tensor's columns would each map its pages)
        if source is not None:
            pool.submit(whole).result()
        else:
            list(pool.map(one_layer, range(index[0].start, index[0].stop)))
        arrays.update(zip(devices, staging.copy(block, devices)))
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, [arrays[device] for device in
                                                                           sharding.addressable_devices])


def _with_the_rest(parallel: ParallelModel, seed: int, loaded: dict[str, jax.Array]) -> TrainState:
    """The whole state in its shards around the ``loaded`` parameters, which it holds as they are:
    the step, the adapters, the optimizer's state over the trained weights and the model's other
    variables (the random weights init would make for the loaded ones are never computed)."""
    def start(loaded: dict[str, jax.Array]) -> tuple[TrainState, Any]:
        fresh = parallel.init(seed)
        params = jax.tree_util.tree_map_with_path(
            lambda keypath, leaf: loaded.get(path_to_str(keypath), leaf), fresh.params)
        made = jax.tree_util.tree_map_with_path(  # the parameters not loaded (adapters)
            lambda keypath, leaf: None if path_to_str(keypath) in loaded else leaf, fresh.params)
        return dataclasses.replace(fresh, params=None, opt_state=parallel.tx.init(
            trained_part(params, parallel.trainable))), made

    shardings = dataclasses.replace(parallel.state_shardings, params=None)
    made_shardings = jax.tree_util.tree_map_with_path(
        lambda keypath, sharding: None if path_to_str(keypath) in loaded else sharding,
        parallel.state_shardings.params)
    state, made = jax.jit(start, out_shardings=(shardings, made_shardings))(loaded)
    params = jax.tree_util.tree_map_with_path(
        lambda keypath, leaf: loaded.get(path_to_str(keypath), leaf), made, is_leaf=lambda leaf: leaf is None)
    return dataclasses.replace(state, params=params)


def initial_state(parallel: ParallelModel, path: str | Path, seed: int = 0) -> tuple[TrainState, int]:
    """A ``TrainState`` for ``parallel`` whose parameters are the checkpoint's in ``path``, each
    device's slice read straight from the files; the optimizer's state starts from them. Returns
    it and the bytes this process read. ``parallel``'s model must be the checkpoint's (a
    ``TransformerLM`` of its config, scanned or looped, any remat or precision, with or
    without LoRA adapters, which start from ``seed`` as ``parallel.init`` makes them)."""
    path = Path(path)
    config, family = _checkpoint_config(parallel, path), checkpoint_family(path)
    tensors = SafeTensors(path)
    check_tensor_names(tensors, config, family)
    leaves = [(keypath, leaf, sharding) for (keypath, leaf), sharding in
              zip(jax.tree_util.tree_leaves_with_path(parallel.abstract_state.params),
                  jax.tree.leaves(parallel.state_shardings.params)) if not is_adapter(path_to_str(keypath))]
    # host memory for reading into: the largest tensor's bytes in the parameters' dtype
    staging = _Staging(max(math.prod(shape) for shape in tensors.shapes.values()) *
                       max(np.dtype(leaf.dtype).itemsize for _, leaf, _ in leaves))
    with concurrent.futures.ThreadPoolExecutor(READERS) as pool:  # numpy lets the other threads run
        arrays = [_fill(pool, staging, tensors, config, family, *entry) for entry in leaves]
    staging.done()
    give_back_freed_memory()
    loaded = {path_to_str(keypath): array for (keypath, _, _), array in zip(leaves, arrays)}
    return _with_the_rest(parallel, seed, loaded), tensors.bytes_read


def load(path: str | Path, mesh: Mesh | str | None = None, strategy: Any = "dp", *,
         tx: optax.GradientTransformation | None = None, seq_len: int | None = None,
         compute_dtype: str = "float32", param_dtype: str = "float32", remat: str = "none",
         scan_layers: bool = True, lora: LoRA | None = None, seed: int = 0,
         capacity_factor: float | None = None) -> Loaded:
    """The Hugging Face checkpoint in ``path`` laid out on ``mesh`` by ``strategy``, each device's
    slice of each weight read straight from the files (``mesh``: a ``Mesh``, a shape such as
    ``"data=4,model=2"``, default every device on ``data`` plus what the strategy needs). ``tx`` (default:
    none) sets up the optimizer state for training on; ``lora`` adds adapters (from ``seed``), which alone
    train; ``param_dtype="bfloat16"`` keeps a bfloat16 checkpoint's weights as they are in the files
    (half the memory of float32, and the same results where they stay frozen); ``capacity_factor``
    routes a mixture of experts with that capacity (None: dropless)."""
    path = Path(path)
    config = read_config(path, seq_len=seq_len, compute_dtype=compute_dtype, param_dtype=param_dtype,
                         remat=remat, scan_layers=scan_layers, capacity_factor=capacity_factor)
    config = config if lora is None else lora.applied(config)
    SafeTensors(path).close()  # a missing or damaged file is said before anything is laid out
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), tx or optax.identity(), mesh,
                           strategy)
    state, read = initial_state(parallel, path, seed)
    return Loaded(config, parallel, state, read, json.loads((path / "config.json").read_text()))
