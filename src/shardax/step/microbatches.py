"""Splitting a batch into microbatches for gradient accumulation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardax.errors import UsageError


def split_microbatches(batch: Any, count: int) -> Any:
    """``(B, ...) -> (count, B // count, ...)``, microbatch i taking rows i, i+count, ...

    Interleaving keeps each device's rows spread evenly over the microbatches, so splitting a
    batch sharded over the data axis moves no data between devices.
    """
    def split(leaf: jax.Array) -> jax.Array:
        rows = leaf.shape[0] if leaf.ndim else 0
        if rows % count or not rows:
            raise UsageError(
                f"batch leaf of shape {leaf.shape} does not split into grad_accum={count} microbatches; "
                f"use a batch size that is a multiple of {count}"
            )
        return jnp.moveaxis(leaf.reshape(rows // count, count, *leaf.shape[1:]), 1, 0)

    return jax.tree.map(split, batch)
