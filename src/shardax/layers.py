"""Shardable layers for users who write their own models.

Each parameter is declared once with logical axis names; a strategy's rules decide where they
land. ``ShardedLinear`` is the seed's example done right: it stays an ``nnx.Param`` (the seed
overwrote it with a raw array), works with or without a mesh, and its bias is sharded like
the output features it belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@contextlib.contextmanager
def metadata_only() -> Iterator[None]:
    """Record sharding annotations on new Variables without placing them (placement is ours)."""
    use = getattr(nnx, "use_eager_sharding", None)
    with use(False) if use is not None else contextlib.nullcontext():
        yield


def annotated_param(init: Any, key: jax.Array, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
    """``nnx.Param(init(key, shape))`` carrying logical ``axes`` as its sharding metadata."""
    with metadata_only():
        return nnx.Param(nnx.with_partitioning(init, axes)(key, shape))
