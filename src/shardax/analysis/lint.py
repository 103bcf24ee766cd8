"""Findings a person should look at before spending accelerator time on a layout."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from shardax.analysis.collectives import Collective
from shardax.sharding.layout import owning_param
from shardax.sharding.paths import path_to_str
from shardax.sharding.place import spec_axes
from shardax.sharding.report import format_bytes
from shardax.vocabulary import LAYERS

REPLICATED_LIMIT = 1 << 20  # parameters above this many bytes should not sit whole on every device


def _shards_parameters(strategy: Any) -> bool:
    return strategy.fsdp_axis is not None or any(target for _, target in strategy.param_rules)


def replicated_parameters(layout: Any, limit: int = REPLICATED_LIMIT) -> list[str]:
    if not _shards_parameters(layout.strategy) or layout.mesh.devices.size == 1:
        return []
    findings = []
    for leaf in sorted(layout.leaves.values(), key=lambda held: -math.prod(held.shape)):
        size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if size > limit and not any(spec_axes(entry) for entry in leaf.spec):
            findings.append(f"replicated parameter {leaf.path} {leaf.shape} holds {format_bytes(size)} on "
                            "every device")
    return findings


UNEVEN_LIMIT = 1 << 16  # a fallback on a smaller tensor (a bias, a norm scale) costs too little to report


def uneven_dimensions(layout: Any, limit: int = UNEVEN_LIMIT) -> list[str]:
    """Parameters of at least ``limit`` bytes that a dimension's size kept from being sharded as ruled."""
    return [f"uneven: {leaf.path}: {'; '.join(leaf.notes)}" for leaf in layout.leaves.values()
            if leaf.notes and math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize >= limit]


def optimizer_mismatches(parallel: Any) -> list[str]:
    """Optimizer-state leaves not sharded at least like their parameter (each update would reshard)."""
    import jax

    findings = []
    layouts = parallel.layout.leaves
    pairs = jax.tree_util.tree_leaves_with_path(parallel.state_shardings.opt_state)
    shapes = jax.tree.leaves(parallel.abstract_state.opt_state)
    for (keypath, sharding), leaf in zip(pairs, shapes):
        path = path_to_str(keypath)
        owner = owning_param(path, tuple(leaf.shape), layouts)
        if owner is None:
            continue
        spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
        for dim, entry in enumerate(owner.spec):
            if not set(spec_axes(entry)) <= set(spec_axes(spec[dim])):
                findings.append(f"optimizer state {path} is {sharding.spec} but its parameter is "
                                f"{owner.spec}")
                break
    return findings


def _dims(shape: str) -> tuple[int, ...]:
    inside = re.search(r"\[([^\]]*)\]", shape)
    return tuple(int(d) for d in inside.group(1).split(",") if d.strip().isdigit()) if inside else ()


def full_parameter_gathers(layout: Any, collectives: list[Collective]) -> list[str]:
    """All-gathers producing a whole parameter that should never be whole: a stack of layers
    gathered at once, or any parameter gathered under a strategy that never gathers."""
    never_gathers = not layout.strategy.gather_axes and not layout.strategy.optimizer_axes
    by_shape: dict[tuple[int, ...], list[Any]] = {}
    for leaf in layout.leaves.values():
        by_shape.setdefault(tuple(leaf.shape), []).append(leaf)
    # An all-gather of what a reduce-scatter of the same size produced is the second half of a
    # ring all-reduce (how dp and zero1 average gradients), not a gathered parameter.
    scattered = [c.operand_bytes for c in collectives if c.kind == "reduce-scatter"]
    findings = []
    for collective in collectives:
        if collective.kind != "all-gather":
            continue
        if never_gathers and collective.bytes in scattered:
            scattered.remove(collective.bytes)
            continue
        for shape in collective.shapes:
            if not shape.startswith(("f", "bf")):
                # token positions and ids (context parallelism), not weights
                continue
            for leaf in by_shape.get(_dims(shape), []):
                stacked = (bool(layout.strategy.gather_axes) and LAYERS in (leaf.logical or ())
                           and leaf.shape[0] > 1)
                if stacked or never_gathers:
                    why = ("all layers at once" if stacked
                           else f"under {layout.strategy.name}, which never gathers")
                    findings.append(f"unexpected all-gather of the whole {leaf.path} {leaf.shape} ({why})")
    return sorted(set(findings))


def lint(parallel: Any, collectives: list[Collective] | None = None,
         limit: int = REPLICATED_LIMIT) -> list[str]:
    layout = parallel.layout
    return (replicated_parameters(layout, limit) + uneven_dimensions(layout) + optimizer_mismatches(parallel)
            + full_parameter_gathers(layout, collectives or []))
