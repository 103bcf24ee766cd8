"""Where each leaf of a model state goes: replicate, shard (FSDP-style), path patterns, NNX filters.

Each function returns a tree of ``NamedSharding`` shaped like the state's leaves; nothing is
moved here (``place.place_tree`` does that), so the same plans serve abstract trees too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.paths import leaves_with_paths, map_with_path, path_matches, path_to_str
from shardax.sharding.place import check_spec
from shardax.sharding.strategies import Strategy
from shardax.vocabulary import DATA

logger = logging.getLogger(__name__)

MODES = ("replicate", "shard")


def default_shard_axis(mesh: Mesh) -> str:
    """The axis ``"shard"`` mode uses unless told: ``data`` if the mesh has it, else its first axis."""
    return DATA if DATA in mesh.shape else mesh.axis_names[0]


def replicated(tree: Any, mesh: Mesh) -> Any:
    """Every leaf on every device."""
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


def shard_strategy(axis: str) -> Strategy:
    """``"shard"`` mode as a ``Strategy``: FSDP over ``axis`` with no rules, so each leaf goes on its
    largest dimension that divides (the same placement engine as ``parallelize``'s strategies)."""
    return Strategy(f"shard over {axis}", param_rules=(), fsdp_axis=axis, gather_axes=(axis,),
                    required_axes=(axis,),
                    description=f"every leaf split over {axis} on its largest dimension that divides")


def sharded_largest_dim(tree: Any, mesh: Mesh, axis: str | None = None) -> tuple[Any, list[str]]:
    """FSDP-style plan: each leaf sharded over ``axis`` on its largest dimension that divides.

    Returns the shardings and the paths of leaves that had no such dimension (replicated).
    """
    axis = axis or default_shard_axis(mesh)
    if axis not in mesh.shape:
        raise UsageError(
            f"shard axis {axis!r} is not in the mesh {describe_mesh(mesh)}; "
            f"use one of {tuple(mesh.axis_names)}"
        )
    strategy = shard_strategy(axis)
    replicated_paths: list[str] = []

    def plan(path: str, leaf: Any) -> NamedSharding:
        shape = tuple(np.shape(leaf))
        spec, _ = strategy.param_spec(None, shape, mesh, f"leaf {path!r}")
        if mesh.shape[axis] > 1 and not any(spec):
            replicated_paths.append(path)
        return NamedSharding(mesh, spec)

    shardings = map_with_path(plan, tree)
    if replicated_paths:
        logger.info(
            "replicated %d leaves with no dimension divisible by %s=%d: %s",
            len(replicated_paths), axis, mesh.shape[axis], ", ".join(replicated_paths),
        )
    return shardings, replicated_paths


def _as_spec(value: Any, where: str) -> PartitionSpec:
    if isinstance(value, NamedSharding):
        return value.spec
    if isinstance(value, PartitionSpec):
        return value
    if value is None:
        return PartitionSpec()
    raise UsageError(f"{where} maps to {value!r}; give a jax.sharding.PartitionSpec or NamedSharding")


def by_path_patterns(tree: Any, mesh: Mesh, patterns: Mapping[str, Any]) -> Any:
    """Shardings from ``{"glob/pattern": PartitionSpec}``; the first matching pattern wins.

    Unmatched leaves are replicated; a pattern that matches no leaf is an error (a typo would
    otherwise silently replicate what the user meant to shard).
    """
    used = {pattern: False for pattern in patterns}

    def plan(path: str, leaf: Any) -> NamedSharding:
        for pattern, value in patterns.items():
            if path_matches(pattern, path):
                used[pattern] = True
                spec = _as_spec(value, f"pattern {pattern!r}")
                check_spec(np.shape(leaf), spec, mesh, f"leaf {path!r} (pattern {pattern!r})")
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, PartitionSpec())

    shardings = map_with_path(plan, tree)
    unused = [pattern for pattern, hit in used.items() if not hit]
    if unused:
        paths = [path for path, _ in leaves_with_paths(tree)]
        raise UsageError(
            f"sharding pattern {unused[0]!r} matches no leaf of the state; patterns are globs on "
            f"paths such as {paths[:4]} (a bare name like 'kernel' matches any path ending in it)"
        )
    return shardings


def by_nnx_filters(state: Any, mesh: Mesh, filter_sharding: Any) -> Any:
    """Shardings from NNX filters, e.g. ``{nnx.Param: P(None, 'model'), ...: P()}``.

    ``filter_sharding`` is a mapping or an ``nnx.StateSharding``; the first filter that matches
    a Variable wins, unmatched Variables are replicated, and a filter matching nothing is an error.
    """
    pairs = list(
        zip(filter_sharding.filters, filter_sharding.shardings)
        if isinstance(filter_sharding, nnx.StateSharding)
        else dict(filter_sharding).items()
    )
    predicates = [nnx.filterlib.to_predicate(f) for f, _ in pairs]
    used = [False] * len(pairs)
    by_path: dict[str, NamedSharding] = {}

    def is_variable(node: Any) -> bool:
        return isinstance(node, nnx.Variable)

    for keypath, node in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable):
        parts = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in keypath)
        path = path_to_str(keypath)
        value = node.get_value() if is_variable(node) else node
        for index, (predicate, (filter_, target)) in enumerate(zip(predicates, pairs)):
            if predicate(parts, node):
                used[index] = True
                spec = _as_spec(target, f"filter {filter_!r}")
                check_spec(np.shape(value), spec, mesh, f"leaf {path!r} (filter {filter_!r})")
                by_path[path] = NamedSharding(mesh, spec)
                break
    unused = [filter_ for (filter_, _), hit in zip(pairs, used) if not hit]
    if unused:
        raise UsageError(
            f"NNX filter {unused[0]!r} matches no Variable of the state; check the filter against "
            f"the state's paths, e.g. {list(by_path)[:4] or [p for p, _ in leaves_with_paths(state)][:4]}"
        )
    return map_with_path(lambda path, _: by_path.get(path, NamedSharding(mesh, PartitionSpec())), state)
