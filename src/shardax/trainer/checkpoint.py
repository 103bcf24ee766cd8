"""Checkpoints with orbax: asynchronous saves, restores straight into a target layout.

A checkpoint holds the whole ``TrainState`` (parameters, optimizer state, step, the model's
other variables) as a flat dict of arrays, a JSON record (data position, the run's settings)
and, when the data comes from Grain, each process's iterator state. Restoring into another
strategy or mesh is restoring into that layout's abstract state: orbax reads each device's
pieces where they now belong. RNG keys are stored as their raw bits and wrapped again on restore.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from shardax.sharding.paths import path_to_str

logger = logging.getLogger(__name__)


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flat_name(keypath: Any) -> str:
    return path_to_str(keypath).replace("/", ".")


def flatten_state(tree: Any) -> dict[str, Any]:
    """``{"params.blocks.qkv": leaf, ...}``: a flat dict orbax stores as one array each (keys as bits)."""
    def stored(leaf: Any) -> Any:
        if not _is_key(leaf):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, leaf)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_key_data_sharding(leaf.sharding))
        return jax.random.key_data(leaf)

    return {_flat_name(keypath): stored(leaf) for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _key_data_sharding(sharding: Any) -> Any:
    """A key's raw bits add a trailing dimension, which stays whole."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec))
    return sharding


def unflatten_state(template: Any, flat: dict[str, Any]) -> Any:
    """Put ``flat``'s arrays back into ``template``'s structure (same paths; RNG keys wrapped)."""
    keypaths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [path_to_str(k) for k, _ in keypaths if _flat_name(k) not in flat]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} arrays the model needs, e.g. {missing[:3]}; "
                         "was it saved from a different model?")

    def restored(keypath: Any, leaf: Any) -> Any:
        value = flat[_flat_name(keypath)]
        if _is_key(leaf):
            return jax.random.wrap_key_data(value, impl=jax.random.key_impl(jnp.zeros((), leaf.dtype)))
        return value

    return jax.tree_util.tree_unflatten(treedef, [restored(k, leaf) for k, leaf in keypaths])


def _check_shapes(saved: dict[str, Any], target: dict[str, Any], directory: Path) -> None:
    """One line naming the first array whose saved shape is not the model's."""
    for name, leaf in target.items():
        old = saved.get(name)
        if old is not None and tuple(old.shape) != tuple(leaf.shape):
            raise ValueError(f"the checkpoint in {directory} holds a different model: {name} has shape "
                             f"{tuple(old.shape)} there but {tuple(leaf.shape)} here; resume with the model it was saved from")


class Checkpointer:
    """Save (asynchronously) and restore by step, keeping the last few."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 3) -> None:
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} is a file; give a directory")
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=True)
        handlers = {"state": ocp.StandardCheckpointHandler(), "record": ocp.JsonCheckpointHandler()}
        try:  # a Grain iterator's position, one file per process
            import grain

            handlers["data"] = grain.checkpoint.CheckpointHandler()
        except ImportError:
            pass
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, record: dict[str, Any], data: Any = None) -> None:
        """Start saving ``state`` at ``step``; returns while the arrays are written in the background.

        ``data``: extra orbax args for the data position (a Grain iterator's state), saved now.
        """
        items = {"state": ocp.args.StandardSave(flatten_state(state)), "record": ocp.args.JsonSave(record)}
        if data is not None:
            items["data"] = data
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state: Any, shardings: Any, data: Any = None) -> tuple[Any, dict[str, Any]]:
        """The state at ``step`` laid out by ``shardings`` (any strategy/mesh), and its record.

        ``data``: orbax restore args for the data position (restores a Grain iterator in place).
        """
        target = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_state, shardings,
        )
        flat_target = flatten_state(target)
        _check_shapes(self.saved_arrays(step), flat_target, self.directory)
        items = {"state": ocp.args.StandardRestore(flat_target), "record": ocp.args.JsonRestore()}
        if data is not None:
            items["data"] = data
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return unflatten_state(target, restored["state"]), dict(restored["record"])

    def saved_arrays(self, step: int) -> dict[str, Any]:
        """The saved arrays of ``step`` as ``{name: metadata with .shape and .dtype}`` (nothing is read)."""
        metadata = self.manager.item_metadata(step)["state"]
        return dict(getattr(metadata, "tree", metadata))

    def arrays(self, step: int) -> dict[str, Any]:
        """The saved arrays of ``step`` as a flat dict on this process's first device (for inspection).

        Works whatever topology wrote the checkpoint (a target layout is built from its metadata).
        """
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {key: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)
                  for key, leaf in self.saved_arrays(step).items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return dict(restored["state"])

    def record(self, step: int) -> dict[str, Any]:
        return dict(self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
