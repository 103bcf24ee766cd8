"""A Hugging Face checkpoint loaded into shards: each device reads only its own slice."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from shardax.errors import UsageError
from shardax.hf.families import read_config
from shardax.hf.files import SafeTensors, give_back_freed_memory
from shardax.hf.names import check_tensor_names, is_adapter, layer_sources, normalize_index, parameter_source
from shardax.hf.save import save
from shardax.model_parallel import ParallelModel, parallelize
from shardax.model_state import trained_part
from shardax.models.transformer import LoRA, TransformerConfig, TransformerLM
from shardax.sharding.paths import path_to_str
from shardax.step.state import TrainState


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


def factory(path: str | Path, lora: LoRA | None = None, **options: Any) -> Pretrained:
    """``rngs -> TransformerLM`` of the checkpoint in ``path``'s config (``read_config``'s
    options), with ``lora``'s adapters if given; its ``initial_state`` loads the weights."""
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


def _read_slice(tensors: SafeTensors, config: TransformerConfig, name: str, dtype: Any,
                index: tuple[slice, ...]) -> np.ndarray:
    """One device's slice of parameter ``name``, filled a layer at a time: besides the slice
    itself, only one layer's part of it is ever held."""
    source, layer, below = parameter_source(name, config)
    out = np.empty(tuple(s.stop - s.start for s in index), dtype)
    if source is not None:
        out[...] = source.read(tensors, index)
    elif layer is not None:
        out[...] = layer_sources(config, layer)[below].read(tensors, index)
    else:
        for row, at in enumerate(range(config.n_layers)[index[0]]):
            out[row] = layer_sources(config, at)[below].read(tensors, index[1:])
    return out


def _fill(tensors: SafeTensors, config: TransformerConfig, keypath: Any, leaf: jax.ShapeDtypeStruct,
          sharding: Any) -> jax.Array:
    """The parameter at ``keypath`` in ``sharding``, this process's devices' slices read from the files."""
    name = path_to_str(keypath)

    def key(index: tuple[slice, ...]) -> tuple[tuple[int, int], ...]:
        return tuple((s.start, s.stop) for s in normalize_index(index, leaf.shape))

    # devices that hold the same slice read it once; a slice is let go once its last device has it
    wanted = collections.Counter(key(index) for index in
                                 sharding.addressable_devices_indices_map(leaf.shape).values())
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        at = key(index)
        if at not in blocks:
            blocks[at] = _read_slice(tensors, config, name, leaf.dtype, normalize_index(index, leaf.shape))
            tensors.release()
        wanted[at] -= 1
        return blocks.pop(at) if wanted[at] <= 0 else blocks[at]

    array = jax.make_array_from_callback(leaf.shape, sharding, block)
    give_back_freed_memory()
    return array


def _with_the_rest(parallel: ParallelModel, seed: int, loaded: dict[str, jax.Array]) -> TrainState:
    """The whole state in its shards around the ``loaded`` parameters: the step, the adapters, the
    optimizer's state over the trained weights and the model's other variables (the random
    weights init would make for the loaded ones are never computed)."""
    def start(loaded: dict[str, jax.Array]) -> TrainState:
        fresh = parallel.init(seed)
        params = jax.tree_util.tree_map_with_path(
            lambda keypath, leaf: loaded.get(path_to_str(keypath), leaf), fresh.params)
        return dataclasses.replace(fresh, params=params, opt_state=parallel.tx.init(
            trained_part(params, parallel.trainable)))

    return jax.jit(start, out_shardings=parallel.state_shardings, donate_argnums=0)(loaded)


def initial_state(parallel: ParallelModel, path: str | Path, seed: int = 0) -> tuple[TrainState, int]:
    """A ``TrainState`` for ``parallel`` whose parameters are the checkpoint's in ``path``, each
    device's slice read straight from the files; the optimizer's state starts from them. Returns
    it and the bytes this process read. ``parallel``'s model must be the checkpoint's (a
    ``TransformerLM`` of its config, scanned or looped, any remat or precision, with or
    without LoRA adapters, which start from ``seed`` as ``parallel.init`` makes them)."""
    path = Path(path)
    config = _checkpoint_config(parallel, path)
    tensors = SafeTensors(path)
    check_tensor_names(tensors, config)
    leaves = zip(jax.tree_util.tree_leaves_with_path(parallel.abstract_state.params),
                 jax.tree.leaves(parallel.state_shardings.params))
    loaded = {path_to_str(keypath): _fill(tensors, config, keypath, leaf, sharding)
              for (keypath, leaf), sharding in leaves if not is_adapter(path_to_str(keypath))}
    tensors.close()
    return _with_the_rest(parallel, seed, loaded), tensors.bytes_read


def load(path: str | Path, mesh: Mesh | str | None = None, strategy: Any = "dp", *,
         tx: optax.GradientTransformation | None = None, seq_len: int | None = None,
         compute_dtype: str = "float32", remat: str = "none", scan_layers: bool = True,
         lora: LoRA | None = None, seed: int = 0, capacity_factor: float | None = None) -> Loaded:
    """The Hugging Face checkpoint in ``path`` laid out on ``mesh`` by ``strategy``, each device's
    slice of each weight read straight from the files (``mesh``: a ``Mesh``, a shape such as
    ``"data=4,model=2"``, default every device on ``data`` plus what the strategy needs). ``tx`` (default:
    none) sets up the optimizer state for training on; ``lora`` adds adapters (from ``seed``), which alone
    train; ``capacity_factor`` routes a mixture of experts with that capacity (None: dropless)."""
    path = Path(path)
    config = read_config(path, seq_len=seq_len, compute_dtype=compute_dtype, remat=remat,
                         scan_layers=scan_layers, capacity_factor=capacity_factor)
    config = config if lora is None else lora.applied(config)
    SafeTensors(path).close()  # a missing or damaged file is said before anything is laid out
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), tx or optax.identity(), mesh,
                           strategy)
    state, read = initial_state(parallel, path, seed)
    return Loaded(config, parallel, state, read, json.loads((path / "config.json").read_text()))
