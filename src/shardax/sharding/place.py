"""Put arrays on a mesh: checked specs, batches (host-local slices -> global arrays), whole trees."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.paths import map_with_path

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, bool, complex)


def is_array_like(value: Any) -> bool:
    """Arrays and Python/numpy numbers: what can be placed on devices."""
    return isinstance(value, ARRAY_TYPES)


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names: ``None`` -> (), ``"data"`` -> ("data",)."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def axes_size(mesh: Mesh, entry: Any) -> int:
    """How many shards one spec entry cuts a dimension into."""
    return math.prod(mesh.shape[axis] for axis in spec_axes(entry))


def check_spec(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh, where: str, fix: str = "") -> None:
    """Raise a one-line ``ValueError`` unless ``spec`` fits ``shape`` on ``mesh``.

    Checks that every axis exists, no axis is used twice, the spec is not longer than the
    array's rank, and each sharded dimension divides by its axes' total size.
    """
    entries = tuple(spec)
    used: list[str] = []
    for entry in entries:
        for axis in spec_axes(entry):
            if axis not in mesh.shape:
                raise UsageError(
                    f"{where}: PartitionSpec {spec} names mesh axis {axis!r}, but the mesh "
                    f"{describe_mesh(mesh)} has axes {tuple(mesh.axis_names)}"
                )
            if axis in used:
                raise UsageError(
                    f"{where}: PartitionSpec {spec} uses mesh axis {axis!r} twice "
                    f"(mesh {describe_mesh(mesh)}); an axis can shard one dimension only"
                )
            used.append(axis)
    if len(entries) > len(shape):
        raise UsageError(
            f"{where}: PartitionSpec {spec} has {len(entries)} entries but the array has shape "
            f"{tuple(shape)} (rank {len(shape)}); give at most one entry per dimension"
        )
    for dim, entry in enumerate(entries):
        size = axes_size(mesh, entry)
        if size > 1 and shape[dim] % size:
            axes = "+".join(spec_axes(entry))
            raise UsageError(
                f"{where}: dimension {dim} has size {shape[dim]}, which does not divide over mesh "
                f"axis {axes!r} of size {size} (mesh {describe_mesh(mesh)}); "
                + (fix or f"shard a dimension that divides by {size}, or leave this one as None")
            )


def _fit_to_rank(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    """Drop trailing ``None`` entries a lower-rank leaf does not have (``P('data', None)`` on a 1-D leaf)."""
    entries = tuple(spec)
    while len(entries) > ndim and entries[-1] is None:
        entries = entries[:-1]
    return PartitionSpec(*entries)


def _local_positions(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many distinct positions along ``axes`` this process's devices occupy."""
    local = np.vectorize(lambda device: device.process_index == jax.process_index())(mesh.devices)
    columns = [mesh.axis_names.index(axis) for axis in axes]
    return len({tuple(row[columns]) for row in np.argwhere(local)})


def global_shape_of_local(local_shape: tuple[int, ...], sharding: NamedSharding) -> tuple[int, ...]:
    """The global shape of an array of which this process holds ``local_shape`` under ``sharding``."""
    mesh = sharding.mesh
    shape = list(local_shape)
    for dim, entry in enumerate(tuple(sharding.spec)):
        axes = spec_axes(entry)
        if axes:
            shape[dim] = shape[dim] * axes_size(mesh, entry) // _local_positions(mesh, axes)
    return tuple(shape)


def place_batch(batch: Any, sharding: Sharding) -> Any:
    """Place every leaf of ``batch`` with ``sharding`` (typically ``P('data')`` on the leading dim).

    numpy and jax arrays are both placed; 0-d leaves (scalars) are replicated. With several
    processes, each process passes only its own slice of the batch (host-local data) and gets
    back global arrays; a jax array that is already global is resharded instead.
    """
    if not isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding), batch)
    mesh = sharding.mesh

    def place(path: str, leaf: Any) -> jax.Array:
        where = f"batch leaf {path!r}"
        if not is_array_like(leaf):
            raise UsageError(
                f"{where} is a {type(leaf).__name__}; a batch holds jax or numpy arrays and numbers"
            )
        if np.ndim(leaf) == 0:
            return jax.device_put(leaf, NamedSharding(mesh, PartitionSpec()))
        spec = _fit_to_rank(sharding.spec, np.ndim(leaf))
        leaf_sharding = NamedSharding(mesh, spec)
        already_global = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        if jax.process_count() == 1 or already_global:
            _check_batch_leaf(np.shape(leaf), spec, mesh, where)
            return jax.device_put(leaf, leaf_sharding)
        local = np.asarray(leaf)
        global_shape = global_shape_of_local(local.shape, leaf_sharding)
        _check_batch_leaf(global_shape, spec, mesh, where + f" (this process holds {local.shape[0]} rows)")
        return jax.make_array_from_process_local_data(leaf_sharding, local, global_shape)

    return map_with_path(place, batch)


def abstract_batch(batch: Any, sharding: NamedSharding) -> Any:
    """``batch`` as ``jax.ShapeDtypeStruct``s of the global batch laid out by ``sharding``, each
    checked as ``place_batch`` would (a one-line error for rows that do not split). Arrays are
    this process's rows, as ``place_batch`` takes them; ``ShapeDtypeStruct``s are global already."""
    mesh = sharding.mesh

    def shape_of(path: str, leaf: Any) -> jax.ShapeDtypeStruct:
        if not isinstance(leaf, jax.ShapeDtypeStruct) and not is_array_like(leaf):
            raise UsageError(f"batch leaf {path!r} is a {type(leaf).__name__}; a batch holds jax or numpy "
                             "arrays and numbers")
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype if hasattr(leaf, "dtype")
                                              else np.asarray(leaf).dtype)
        shape = tuple(np.shape(leaf))
        spec = _fit_to_rank(sharding.spec, len(shape)) if shape else PartitionSpec()
        leaf_sharding = NamedSharding(mesh, spec)
        if shape and jax.process_count() > 1 and not isinstance(leaf, jax.ShapeDtypeStruct):
            shape = global_shape_of_local(shape, leaf_sharding)
        if shape:
            _check_batch_leaf(shape, spec, mesh, f"batch leaf {path!r}")
        return jax.ShapeDtypeStruct(shape, dtype, sharding=leaf_sharding)

    return map_with_path(shape_of, batch)


def _check_batch_leaf(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh, where: str) -> None:
    size = axes_size(mesh, spec[0]) if len(spec) else 1
    multiple = -(-shape[0] // size) * size if size else shape[0]
    check_spec(
        shape,
        spec,
        mesh,
        where,
        fix=f"use a batch size that is a multiple of {size} (e.g. {multiple}) or drop the remainder",
    )


def place_tree(tree: Any, shardings: Any) -> Any:
    """``jax.device_put`` each array leaf of ``tree`` with the matching leaf of ``shardings``.

    Leaves that are not arrays (strings, callables kept in a pytree) are returned unchanged.
    """
    return jax.tree.map(
        lambda leaf, sharding: jax.device_put(leaf, sharding) if is_array_like(leaf) else leaf,
        tree,
        shardings,
    )
