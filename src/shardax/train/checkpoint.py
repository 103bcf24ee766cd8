"""Checkpoints with orbax: asynchronous saves, restores straight into a target layout.

A checkpoint holds the whole ``TrainState`` (parameters, optimizer state, step) as a flat dict
of arrays plus a JSON record (data position, seed and RNG, the run's settings). Restoring
into another strategy or mesh is restoring into that layout's abstract state: orbax reads
each device's pieces where they now belong.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from shardax.sharding.paths import path_to_str

logger = logging.getLogger(__name__)


def flatten_state(tree: Any) -> dict[str, Any]:
    """``{"params.blocks.qkv": leaf, ...}``: a flat dict orbax stores as one array each."""
    return {path_to_str(keypath).replace("/", "."): leaf for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def unflatten_state(template: Any, flat: dict[str, Any]) -> Any:
    """Put ``flat``'s arrays back into ``template``'s structure (same paths)."""
    keypaths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [path_to_str(k) for k, _ in keypaths if path_to_str(k).replace("/", ".") not in flat]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} arrays the model needs, e.g. {missing[:3]}; "
                         "was it saved from a different model?")
    return jax.tree_util.tree_unflatten(treedef, [flat[path_to_str(k).replace("/", ".")] for k, _ in keypaths])


class Checkpointer:
    """Save every ``save_every`` steps (asynchronously) and restore by step, keeping the last few."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 3) -> None:
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "record"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
        """Start saving ``state`` at ``step``; returns while the write goes on in the background."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(flatten_state(state)), record=ocp.args.JsonSave(record))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict[str, Any]]:
        """The state at ``step`` laid out by ``shardings`` (any strategy/mesh), and its record."""
        target = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_state, shardings,
        )
        flat_target = flatten_state(target)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(flat_target), record=ocp.args.JsonRestore())
        )
        return unflatten_state(target, restored["state"]), dict(restored["record"])

    def arrays(self, step: int) -> dict[str, Any]:
        """The saved arrays of ``step`` as a flat dict on this process's first device (for inspection).

        Works whatever topology wrote the checkpoint (a target layout is built from its metadata).
        """
        metadata = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "state")
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {key: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device) for key, leaf in tree.items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return dict(restored["state"])

    def record(self, step: int) -> dict[str, Any]:
        return dict(self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
