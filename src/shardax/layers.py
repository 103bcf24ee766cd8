"""Shardable layers for users who write their own models.

Each parameter is declared once with logical axis names; a strategy's rules decide where they
land. ``ShardedLinear`` stays an ``nnx.Param`` (artifex's planned example overwrote it with a
raw array), works with or without a mesh, and its bias is sharded like the output features it
belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.sharding.compute import for_compute
from shardax.sharding.place import check_spec


@contextlib.contextmanager
def metadata_only() -> Iterator[None]:
    """Record sharding annotations on new Variables without placing them (placement is ours)."""
    use = getattr(nnx, "use_eager_sharding", None)
    with use(False) if use is not None else contextlib.nullcontext():
        yield


def annotated_param(init: Any, key: jax.Array, shape: tuple[int, ...], axes: tuple[str | None, ...],
                    kind: type[nnx.Param] = nnx.Param) -> nnx.Param:
    """``kind(init(key, shape))`` (an ``nnx.Param`` unless told) carrying logical ``axes`` as its
    sharding metadata."""
    with metadata_only():
        return kind(nnx.with_partitioning(init, axes)(key, shape))


def _place(param: nnx.Param, mesh: Mesh | None, axes: tuple[str | None, ...]) -> None:
    """Put ``param`` on ``mesh`` with ``axes`` read as mesh axis names (checked first)."""
    if mesh is None:
        return
    spec = PartitionSpec(*axes)
    check_spec(param.shape, spec, mesh, f"ShardedLinear parameter of shape {param.shape}")
    param.set_value(jax.device_put(param.get_value(), NamedSharding(mesh, spec)))


class ShardedLinear(nnx.Module):
    """``x @ kernel + bias`` with the kernel split over ``model`` by output features.

    Args:
      in_features, out_features: the kernel is ``(in_features, out_features)``.
      rngs: NNX random streams.
      mesh: if given, the parameters are placed on it now; otherwise a strategy places them.
      kernel_axes, bias_axes: logical names or mesh axes for the kernel's and bias's dimensions.
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, mesh: Mesh | None = None,
                 kernel_axes: tuple[str | None, ...] = (None, "model"),
                 bias_axes: tuple[str | None, ...] = ("model",)) -> None:
        self.kernel = annotated_param(nnx.initializers.lecun_normal(), rngs.params(),
                                      (in_features, out_features), kernel_axes)
        self.bias = annotated_param(nnx.initializers.zeros, rngs.params(), (out_features,), bias_axes)
        _place(self.kernel, mesh, kernel_axes)
        _place(self.bias, mesh, bias_axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ for_compute(self.kernel) + for_compute(self.bias)


class ColumnParallelLinear(ShardedLinear):
    """Megatron's first projection: output features (``mlp``) split over the model axis."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs) -> None:
        super().__init__(in_features, out_features, rngs=rngs, kernel_axes=("embed", "mlp"),
                         bias_axes=("mlp",))


class RowParallelLinear(ShardedLinear):
    """Megatron's second projection: input features (``mlp``) split, partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs) -> None:
        super().__init__(in_features, out_features, rngs=rngs, kernel_axes=("mlp", "embed"),
                         bias_axes=("embed",))


class ShardedEmbed(nnx.Module):
    """A ``(vocab, features)`` table: rows over the vocab axis, columns over embed."""

    def __init__(self, num_embeddings: int, features: int, *, rngs: nnx.Rngs) -> None:
        self.embedding = annotated_param(nnx.initializers.normal(0.02), rngs.params(),
                                         (num_embeddings, features), ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(for_compute(self.embedding), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits over the vocabulary for features ``x`` (a tied output head)."""
        return x @ for_compute(self.embedding).T
