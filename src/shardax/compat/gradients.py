"""Gradient reductions: collectives inside ``shard_map``/``pmap``, and plain reductions in SPMD code."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardax.errors import UsageError
from shardax.sharding.paths import map_with_path

REDUCE_TYPES = ("mean", "sum")


def check_reduce_type(reduce_type: str) -> None:
    if reduce_type not in REDUCE_TYPES:
        raise UsageError(f"reduce_type={reduce_type!r} is not supported; use 'mean' or 'sum'")


def _check_axis_bound(axis_name: Any) -> None:
    try:
        lax.axis_size(axis_name)
    except NameError:
        raise UsageError(
            f"axis_name={axis_name!r} is not a bound parallel axis here; call this inside "
            f"jax.shard_map over a mesh with axis {axis_name!r}, or inside "
            f"jax.pmap(..., axis_name={axis_name!r}), or pass the axis name you used"
        ) from None


def reduce_gradients_across_devices(
    gradients: Any, reduce_type: str = "mean", axis_name: str = "batch"
) -> Any:
    """All-reduce every gradient leaf over the parallel axis ``axis_name`` (``pmean``/``psum``).

    Only valid where ``axis_name`` is bound: inside ``jax.shard_map`` or ``jax.pmap``. Under
    ``jax.jit`` with sharded inputs the compiler inserts this reduction itself.
    """
    check_reduce_type(reduce_type)
    _check_axis_bound(axis_name)
    collective = lax.pmean if reduce_type == "mean" else lax.psum
    return jax.tree.map(lambda gradient: collective(gradient, axis_name), gradients)


def reduce_gradient_tree(gradients: Any, reduce_type: str = "mean") -> Any:
    """Reduce a leading per-replica axis of every leaf: ``(replicas, ...) -> (...)``.

    For SPMD code holding one gradient per replica stacked along dim 0 (typically sharded over
    the data axis): the compiler turns the mean/sum into the cross-device reduction.
    """
    check_reduce_type(reduce_type)
    reduce = jnp.mean if reduce_type == "mean" else jnp.sum

    def reduce_leaf(path: str, gradient: Any) -> jax.Array:
        if np.ndim(gradient) == 0:
            raise UsageError(
                f"gradient leaf {path!r} is a scalar; reduce_gradient_tree reduces a leading "
                "per-replica axis, so stack per-replica gradients as (replicas, ...) first"
            )
        return reduce(gradient, axis=0)

    return map_with_path(reduce_leaf, gradients)
