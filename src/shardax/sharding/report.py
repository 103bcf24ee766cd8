"""A sharding report a person reads: every leaf's layout and what it costs each device."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from shardax.sharding.paths import path_to_str
from shardax.sharding.rules import logical_axes_of


@dataclasses.dataclass(frozen=True)
class LeafReport:
    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: tuple[str | None, ...] | None
    spec: str
    bytes: int  # the whole array
    bytes_per_device: int  # the largest shard any device holds
    replicated: bool  # every device holds all of it (on a mesh of more than one device)


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    return f"{count:.2f} TB"


def _leaf_report(path: str, node: Any) -> LeafReport | None:
    value = node.get_value() if isinstance(node, nnx.Variable) else node
    sharding = getattr(value, "sharding", None)
    if sharding is None or not hasattr(value, "shape"):
        return None
    shape = tuple(value.shape)
    itemsize = value.dtype.itemsize  # (an RNG key dtype is no numpy dtype, but has a size)
    full = math.prod(shape) * itemsize
    per_device = math.prod(sharding.shard_shape(shape)) * itemsize
    devices = len(sharding.device_set)
    spec = str(getattr(sharding, "spec", "replicated" if sharding.is_fully_replicated else sharding))
    return LeafReport(
        path=path, shape=shape, dtype=str(value.dtype),
        logical=logical_axes_of(node) if isinstance(node, nnx.Variable) else None,
        spec=spec, bytes=full, bytes_per_device=per_device,
        replicated=devices > 1 and per_device == full and full > 0,
    )


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Rows sorted with the largest replicated leaves first, then the largest sharded ones."""

    leaves: list[LeafReport]
    num_devices: int

    @property
    def bytes_per_device(self) -> int:
        return sum(leaf.bytes_per_device for leaf in self.leaves)

    @property
    def replicated_bytes(self) -> int:
        """What each device would hold with every leaf replicated."""
        return sum(leaf.bytes for leaf in self.leaves)

    @property
    def fraction(self) -> float:
        return self.bytes_per_device / max(self.replicated_bytes, 1)

    def largest_replicated(self, count: int = 5) -> list[LeafReport]:
        return [leaf for leaf in self.leaves if leaf.replicated][:count]

    def summary(self) -> str:
        return (
            f"{format_bytes(self.bytes_per_device)} per device vs {format_bytes(self.replicated_bytes)} "
            f"replicated ({100 * self.fraction:.1f}%) over {len(self.leaves)} arrays on {self.num_devices} "
            "devices"
        )

    def table(self, max_rows: int | None = 30) -> str:
        header = ("path", "shape", "logical axes", "spec", "per device", "replicated")
        rows = [header] + [
            (leaf.path, "x".join(map(str, leaf.shape)) or "()",
             ",".join(str(a) for a in leaf.logical or ()) or "-", leaf.spec,
             format_bytes(leaf.bytes_per_device), "yes" if leaf.replicated else "")
            for leaf in self.leaves[:max_rows]
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        hidden = len(self.leaves) - (len(rows) - 1)
        if hidden > 0:
            lines.append(f"... {hidden} more")
        return "\n".join(lines + [self.summary()])

    def __str__(self) -> str:
        return self.table()


def report(tree: Any) -> ShardingReport:
    """Report on every array (or abstract array with a sharding) in ``tree``.

    Works on concrete states, on ``jax.ShapeDtypeStruct`` trees carrying shardings, and on a
    ``ParallelModel`` (its abstract state as it would be laid out).
    """
    if hasattr(tree, "abstract_state") and hasattr(tree, "state_shardings"):
        tree = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            tree.abstract_state, tree.state_shardings,
        )
    rows = []
    devices: set = set()
    for keypath, node in jax.tree_util.tree_leaves_with_path(tree,
                                                             is_leaf=lambda n: isinstance(n, nnx.Variable)):
        row = _leaf_report(path_to_str(keypath), node)
        if row is not None:
            rows.append(row)
            value = node.get_value() if isinstance(node, nnx.Variable) else node
            devices |= set(value.sharding.device_set)
    rows.sort(key=lambda leaf: (not leaf.replicated, -leaf.bytes_per_device, leaf.path))
    return ShardingReport(leaves=rows, num_devices=len(devices))
