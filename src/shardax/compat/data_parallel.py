"""artifex's ``DataParallel`` and datarax's placement functions, one implementation.

The names and signatures follow those libraries' documentation; the behaviour is the one a careful user
expects: numpy batches are placed, sizes are checked up front, ``"shard"`` never crashes on a
bias or a scalar, and gradients are averaged, not collapsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from shardax.compat.gradients import reduce_gradients_across_devices
from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding import modes
from shardax.sharding.place import place_batch, place_tree


def create_data_parallel_sharding(mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """A sharding that splits the leading (batch) dimension over ``data_axis``."""
    if data_axis not in mesh.shape:
        raise UsageError(
            f"data_axis={data_axis!r} is not an axis of the mesh {describe_mesh(mesh)}; "
            f"use one of {tuple(mesh.axis_names)}"
        )
    return NamedSharding(mesh, PartitionSpec(data_axis))


def place_batch_on_shards(batch: Any, sharding: Sharding) -> Any:
    """Place a batch pytree with ``sharding``; see :func:`shardax.sharding.place.place_batch`."""
    return place_batch(batch, sharding)


def _is_graph_node(state: Any) -> bool:
    return isinstance(state, (nnx.Module, nnx.Optimizer)) or nnx.graph.is_graph_node(state)


def model_state_shardings(
    state: Any, mesh: Mesh, param_sharding: Any = None, *, axis: str | None = None
) -> Any:
    """The shardings ``place_model_state_on_shards`` would use, without moving anything."""
    if param_sharding is None or param_sharding == "replicate":
        return modes.replicated(state, mesh)
    if param_sharding == "shard":
        return modes.sharded_largest_dim(state, mesh, axis)[0]
    if isinstance(param_sharding, (Mapping, nnx.StateSharding)):
        keys = param_sharding.filters if isinstance(param_sharding, nnx.StateSharding) else param_sharding
        if all(isinstance(key, str) for key in keys):
            return modes.by_path_patterns(state, mesh, param_sharding)
        return modes.by_nnx_filters(state, mesh, param_sharding)
    raise UsageError(
        f"param_sharding={param_sharding!r} is not a placement mode; use one of "
        f"{', '.join(repr(m) for m in modes.MODES)}, or a dict {{path pattern: PartitionSpec}}"
    )


def place_model_state_on_shards(
    state: Any,
    mesh: Mesh,
    param_sharding: str | dict[str, PartitionSpec] | None = None,
    *,
    axis: str | None = None,
) -> Any:
    """Place a model's state on ``mesh``.

    Args:
      state: an ``nnx.State``, an ``nnx.Module`` or ``nnx.Optimizer`` (updated in place and
        returned), an optax state, a flax ``TrainState``, or any pytree of arrays.
      mesh: the device mesh.
      param_sharding: ``None``/``"replicate"`` (every device holds everything); ``"shard"``
        (FSDP-style: each leaf split over ``axis`` on its largest dimension that divides, the
        others replicated and logged); or a dict ``{path pattern: PartitionSpec}`` (globs on
        paths like ``"layers/0/kernel"``, first match wins, unmatched leaves replicated).
      axis: the mesh axis ``"shard"`` uses; ``data`` if the mesh has it, else its first axis.
    """
    if _is_graph_node(state):
        placed = place_model_state_on_shards(nnx.state(state), mesh, param_sharding, axis=axis)
        nnx.update(state, placed)
        return state
    return place_tree(state, model_state_shardings(state, mesh, param_sharding, axis=axis))


def place_nnx_state_on_shards(state: nnx.State, mesh: Mesh, filter_sharding: Any) -> nnx.State:
    """Place an NNX state by filters: ``{nnx.Param: P(None, 'model'), nnx.BatchStat: P()}``.

    Works on meshes with Auto and Explicit axes alike (placement is ``jax.device_put``).
    """
    if _is_graph_node(state):
        nnx.update(state, place_nnx_state_on_shards(nnx.state(state), mesh, filter_sharding))
        return state
    return place_tree(state, modes.by_nnx_filters(state, mesh, filter_sharding))


class DataParallel(nnx.Module):
    """Data-parallel training utilities; every method also exists as a ``*_static`` staticmethod."""

    def __init__(self) -> None:
        """A stateless helper: instances only make the call sites read naturally."""

    @staticmethod
    def create_data_parallel_sharding_static(mesh: Mesh, data_axis: str = "data") -> NamedSharding:
        return create_data_parallel_sharding(mesh, data_axis)

    @staticmethod
    def shard_batch_static(batch: Any, sharding: Sharding) -> Any:
        return place_batch(batch, sharding)

    @staticmethod
    def shard_model_state_static(
        state: Any, mesh: Mesh, param_sharding: Literal["replicate", "shard"] | dict = "replicate"
    ) -> Any:
        return place_model_state_on_shards(state, mesh, param_sharding)

    @staticmethod
    def all_reduce_gradients_static(
        gradients: Any, reduce_type: Literal["mean", "sum"] = "mean", axis_name: str = "batch"
    ) -> Any:
        return reduce_gradients_across_devices(gradients, reduce_type, axis_name)

    @staticmethod
    def replicate_params_static(params: Any, mesh: Mesh) -> Any:
        return place_model_state_on_shards(params, mesh, "replicate")

    def create_data_parallel_sharding(self, mesh: Mesh, data_axis: str = "data") -> NamedSharding:
        """A sharding splitting the leading dimension over ``data_axis``."""
        return self.create_data_parallel_sharding_static(mesh, data_axis)

    def shard_batch(self, batch: Any, sharding: Sharding) -> Any:
        """Place a batch (jax or numpy leaves; scalars replicated; sizes checked)."""
        return self.shard_batch_static(batch, sharding)

    def shard_model_state(
        self, state: Any, mesh: Mesh, param_sharding: Literal["replicate", "shard"] | dict = "replicate"
    ) -> Any:
        """Place model state: ``"replicate"``, ``"shard"`` (FSDP-style) or a dict of path patterns."""
        return self.shard_model_state_static(state, mesh, param_sharding)

    def all_reduce_gradients(
        self, gradients: Any, reduce_type: Literal["mean", "sum"] = "mean", axis_name: str = "batch"
    ) -> Any:
        """``pmean``/``psum`` of gradients over ``axis_name`` (inside ``shard_map``/``pmap``)."""
        return self.all_reduce_gradients_static(gradients, reduce_type, axis_name)

    def replicate_params(self, params: Any, mesh: Mesh) -> Any:
        """Copy ``params`` to every device of ``mesh``."""
        return self.replicate_params_static(params, mesh)

