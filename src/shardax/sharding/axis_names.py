"""A model's own axis names: models that annotate themselves in their authors' mesh vocabulary.

Open implementations name their sharding after the mesh they were written for: weights declared
with ``nnx.with_partitioning(init, ("fsdp", "tp"))``, activations constrained with
``jax.lax.with_sharding_constraint(x, P("fsdp", None, "tp"))``. ``axis_names={"fsdp": "data",
"tp": "model"}`` says which of shardax's mesh axes each of those names plays. shardax then
works on the same devices under the model's names (``data`` called ``fsdp``, ``model`` called
``tp``; a mapped axis the mesh lacks, such as ``tp`` under ``dp``, is there with size 1), so
the model's bare ``PartitionSpec``s resolve inside the step; and the strategy decides what the
weights' names do: a name mapped to ``data`` splits its dimension where the strategy stores
parameters over ``data`` (fsdp, fsdp_tp, hsdp) and nowhere else, ``model`` likewise under the
tensor-parallel strategies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
from jax.sharding import Mesh

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.place import spec_axes

AxisNames = Union[str, Mapping[str, str], None]
# The mesh axes a model's names may play. The pipeline's ``stage`` and the ``context`` axis are
# driven by shardax's own blocks, which name them themselves.
MAPPABLE = ("data", "model", "replica")


def parse_axis_names(axis_names: AxisNames) -> dict[str, str]:
    """``{model_name: shardax_axis}`` from a dict or ``"fsdp=data,tp=model"``, checked."""
    if axis_names is None:
        return {}
    if isinstance(axis_names, str):
        pairs = [part.partition("=") for part in axis_names.split(",") if part.strip()]
        if any(not sep or not name.strip() or not axis.strip() for name, sep, axis in pairs):
            raise UsageError(f"axis_names {axis_names!r}: write it as 'model_name=mesh_axis,...', "
                             "e.g. 'fsdp=data,tp=model'")
        axis_names = {name.strip(): axis.strip() for name, _, axis in pairs}
    if not isinstance(axis_names, Mapping):
        raise UsageError(f"axis_names={axis_names!r}; give a dict such as {{'fsdp': 'data', 'tp': 'model'}}")
    mapping = {str(name): str(axis) for name, axis in axis_names.items()}
    for name, axis in mapping.items():
        if axis not in MAPPABLE:
            raise UsageError(f"axis_names maps {name!r} to {axis!r}; map the model's names onto one of "
                             f"{', '.join(MAPPABLE)}")
        if name in MAPPABLE and name != axis:
            raise UsageError(f"axis_names maps {name!r} to {axis!r}, but {name!r} is one of shardax's mesh "
                             f"axes; map it to itself or leave it out")
    taken: dict[str, str] = {}
    for name, axis in mapping.items():
        if axis in taken:
            raise UsageError(f"axis_names maps both {taken[axis]!r} and {name!r} to {axis!r}; "
                             "one name per mesh axis")
        taken[axis] = name
    return mapping


def named_mesh(mesh: Mesh, mapping: dict[str, str]) -> Mesh:
    """``mesh``'s devices under the model's axis names, every mapped name present (size 1 where
    the mesh lacks its axis)."""
    if not mapping:
        return mesh
    renamed = {axis: name for name, axis in mapping.items()}
    clash = sorted(set(mapping) & (set(mesh.axis_names) - set(mapping.values())))
    if clash:
        raise UsageError(f"axis_names uses {clash[0]!r}, which is already an axis of the mesh "
                         f"{describe_mesh(mesh)}; name the mesh's axes data/model/replica")
    names = tuple(renamed.get(axis, axis) for axis in mesh.axis_names)
    extra = tuple(name for name, axis in mapping.items() if axis not in mesh.shape)
    devices = np.asarray(mesh.devices).reshape(mesh.devices.shape + (1,) * len(extra))
    types = tuple(mesh.axis_types) + (mesh.axis_types[0],) * len(extra)
    return Mesh(devices, names + extra, axis_types=types)


def named_strategy(strategy: Any, mapping: dict[str, str]) -> Any:
    """``strategy`` with its mesh axes called by the model's names, plus a rule for each name:
    its dimension goes where the strategy stores parameters on that axis, else stays whole."""
    if not mapping:
        return strategy
    renamed = {axis: name for name, axis in mapping.items()}

    def rename(target: Any) -> Any:
        axes = tuple(renamed.get(a, a) for a in spec_axes(target))
        return None if not axes else axes[0] if len(axes) == 1 else axes

    rules = tuple((logical, rename(target)) for logical, target in strategy.param_rules)
    storing = {a for _, target in rules
               for a in spec_axes(target)} | {renamed.get(strategy.fsdp_axis, strategy.fsdp_axis)}
    rules += tuple((name, name if name in storing else None) for name in mapping)
    names = lambda axes: tuple(renamed.get(a, a) for a in axes)  # noqa: E731
    return dataclasses.replace(
        strategy, param_rules=rules, batch_axes=names(strategy.batch_axes),
        fsdp_axis=renamed.get(strategy.fsdp_axis, strategy.fsdp_axis),
        gather_axes=names(strategy.gather_axes), optimizer_axes=names(strategy.optimizer_axes),
        required_axes=names(strategy.required_axes),
        pipeline_axis=renamed.get(strategy.pipeline_axis, strategy.pipeline_axis),
    )
