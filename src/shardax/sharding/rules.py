"""Logical axis names and the rules that map them onto mesh axes.

Parameters are annotated once with logical names (``embed``, ``mlp``, ``heads``, ...); a rules
table, a tuple of ``(logical_name, mesh_axes)`` pairs in the format ``nnx.logical_axis_rules``
takes, decides where each name lands on a given mesh. A name may appear several times: the
first of its targets that exists on the mesh and divides the dimension wins, so an uneven
dimension falls back to the next rule (or to replication) instead of failing mid-run.
"""

from __future__ import annotations

import math
from typing import Any, Union

from jax.sharding import Mesh, PartitionSpec

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.place import spec_axes
from shardax.vocabulary import LAYERS

BATCH = "batch"
# Logical names used by shardax's layers and models.
LOGICAL_AXES = ("batch", "length", "embed", "mlp", "heads", "kv", "vocab", LAYERS, "expert")

MeshAxes = Union[str, tuple[str, ...], None]
Rules = tuple[tuple[str, MeshAxes], ...]


def data_parallel_rules(data_axis: str = "data") -> Rules:
    """Rules for pure data parallelism: the batch is split over ``data_axis``, nothing else is.

    Every other logical name maps to ``None`` (replicated), so models annotated for model
    parallelism run data-parallel under these rules unchanged.
    """
    return ((BATCH, data_axis),) + tuple((name, None) for name in LOGICAL_AXES if name != BATCH)


def logical_axes_of(variable: Any) -> tuple[str | None, ...] | None:
    """The logical axis names an NNX Variable was declared with, or ``None`` if unannotated."""
    get_metadata = getattr(variable, "get_metadata", None)
    metadata = get_metadata() if get_metadata else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


def unannotated(logical: tuple[str | None, ...] | None) -> bool:
    """Whether logical names say nothing beyond a stack: none at all, or only the leading
    ``layers`` that ``shardax.blocks.LayerStack`` gives the parameters it stacks."""
    return (logical is None
            or (len(logical) > 0 and logical[0] == LAYERS and all(n is None for n in logical[1:])))


def _targets(name: str, rules: Rules, mesh: Mesh, where: str) -> list[MeshAxes]:
    targets = [target for logical, target in rules if logical == name]
    if targets:
        return targets
    if name in mesh.shape:  # a mesh axis written directly (as artifex's ShardedLinear writes it)
        return [name]
    known = sorted({logical for logical, _ in rules})
    raise UsageError(
        f"{where}: logical axis {name!r} has no rule (rules cover {known}); add "
        f"({name!r}, <mesh axis or None>) to the rules"
    )


def resolve_spec(
    logical: tuple[str | None, ...],
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: Rules,
    where: str,
) -> tuple[PartitionSpec, list[str]]:
    """Turn one array's logical names into a PartitionSpec on ``mesh``.

    Returns the spec and notes on dimensions that fell back because they do not divide. Mesh
    axes the mesh lacks, or of size 1, count as ``None``. Two logical names of one array that
    would land on the same mesh axis are an error naming both.
    """
    if len(logical) != len(shape):
        raise UsageError(
            f"{where}: {len(logical)} logical axes {logical} for an array of shape {tuple(shape)}; "
            "give one name (or None) per dimension"
        )
    entries: list[MeshAxes] = []
    notes: list[str] = []
    owner: dict[str, str] = {}
    for dim, name in enumerate(logical):
        chosen: tuple[str, ...] = ()
        for target in _targets(name, rules, mesh, where) if name is not None else []:
            axes = tuple(a for a in spec_axes(target) if mesh.shape.get(a, 1) > 1)
            if not axes:
                break
            clash = next((a for a in axes if a in owner), None)
            if clash is not None:
                raise UsageError(
                    f"{where}: logical axes {owner[clash]!r} and {name!r} both map to mesh axis "
                    f"{clash!r} (mesh {describe_mesh(mesh)}); map one of them elsewhere or to None"
                )
            size = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % size == 0:
                chosen = axes
                break
            notes.append(f"{name}={shape[dim]} does not divide {'+'.join(axes)}={size}")
        owner.update({a: name for a in chosen})
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*entries), notes


def add_axis_to_largest_dim(
    spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, axis: str,
    logical: tuple[str | None, ...] | None = None,
) -> PartitionSpec | None:
    """``spec`` with ``axis`` added on the largest still-unsharded dimension that divides by it.

    A stacked ``layers`` dimension is never chosen: a layer's slice must look the same inside a
    scan as its stack does outside. Returns ``spec`` unchanged when it already uses ``axis``
    (or the axis is absent/size 1), and ``None`` when no dimension can take it.
    """
    size = mesh.shape.get(axis, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if size == 1 or any(axis in spec_axes(entry) for entry in entries):
        return PartitionSpec(*entries)
    names = logical if logical is not None and len(logical) == len(shape) else (None,) * len(shape)
    free = [
        (shape[d], -d) for d, entry in enumerate(entries)
        if entry is None and shape[d] % size == 0 and names[d] != LAYERS
    ]
    if not free:
        return None
    entries[-max(free)[1]] = axis
    return PartitionSpec(*entries)
