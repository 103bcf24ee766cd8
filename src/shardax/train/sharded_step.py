"""The train step of every strategy: one function, laid out by a ``Layout``.

The strategy never appears as a branch here. Parameters are constrained to their compute
layout before the forward pass (for FSDP that is the all-gather), gradients to the strategy's
gradient layout (the compiler then all-reduces or reduce-scatters them), and jit's
in/out shardings keep parameters and optimizer state where the layout says.

When every parameter and gradient is replicated (``dp``, ``zero1``), the forward and backward
passes run per device inside ``shard_map`` instead, and the gradients are averaged once after
the backward pass. The compiler would otherwise reduce each scanned layer's gradients inside
the layer loop: the same bytes, but one collective per layer. A large gradient is averaged by
a ring all-reduce written as its two halves, a reduce-scatter and an all-gather: the same bytes
on the wire, but no second full copy of it (XLA:CPU's all-reduce keeps one). Small gradients
(a model of unscanned layers has dozens) are joined into buckets, one all-reduce each.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from shardax.sharding.compute import gather_for_compute
from shardax.train.state import TrainState


def _microbatches(batch: Any, count: int) -> Any:
    """``(B, ...) -> (count, B // count, ...)``, microbatch i taking rows i, i+count, ...

    Interleaving keeps each device's rows spread evenly over the microbatches, so splitting a
    batch sharded over the data axis moves no data between devices.
    """
    def split(leaf: jax.Array) -> jax.Array:
        rows = leaf.shape[0]
        if rows % count:
            raise ValueError(
                f"batch of {rows} rows does not split into grad_accum={count} microbatches; "
                f"use a batch size that is a multiple of {count}"
            )
        return jnp.moveaxis(leaf.reshape(rows // count, count, *leaf.shape[1:]), 1, 0)

    return jax.tree.map(split, batch)


# Gradients under a quarter of this are joined into buckets of up to this size and each bucket
# is averaged by one all-reduce: a model of many small weights then pays for a few collectives,
# not two per weight. Larger gradients go alone (reduce-scatter, then all-gather), so the
# buckets' copies never hold more than this many bytes of gradients.
BUCKET_BYTES = 16 << 20


def _buckets(sizes: list[int]) -> list[list[int]]:
    """Indices of gradients to reduce together: each large one alone, small ones in order, joined
    into buckets of at most ``BUCKET_BYTES``."""
    buckets: list[list[int]] = []
    small: list[int] = []
    filled = 0
    for index, size in enumerate(sizes):
        if size >= BUCKET_BYTES // 4 or size == 0:
            buckets.append([index])
            continue
        if small and filled + size > BUCKET_BYTES:
            buckets.append(small)
            small, filled = [], 0
        small.append(index)
        filled += size
    return buckets + ([small] if small else [])


def build_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    *,
    compute_shardings: Any,
    gradient_shardings: Any,
    batch_sharding: Any,
    grad_accum: int = 1,
    layer_layout: Callable[[], Any] = contextlib.nullcontext,
    replicas: tuple[Mesh, tuple[str, ...]] | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The un-jitted step ``(state, batch) -> (state, metrics)``; see ``ParallelModel.train_step``.

    ``layer_layout()`` is entered while the loss is traced, so layers that read their weights
    through ``for_compute`` gather (and reduce-scatter) them one layer at a time.
    ``replicas=(mesh, axes)``: every parameter and gradient is replicated and the batch is split
    over ``axes``, so gradients may be computed per device and averaged once (module doc).
    """

    replica_count = 1 if replicas is None else int(np.prod([replicas[0].shape[axis] for axis in replicas[1]]))

    def loss_and_rest(params: Any, rest: Any, batch: Any, *, local: bool) -> tuple[jax.Array, Any]:
        if not local:
            params = jax.tree.map(gather_for_compute, params, compute_shardings, gradient_shardings)
        model = nnx.merge(graphdef, params, rest)
        with contextlib.nullcontext() if local else layer_layout():
            loss = loss_fn(model, batch)
        return loss, nnx.split(model, nnx.Param, ...)[2]

    def gradients(params: Any, rest: Any, batch: Any, *, local: bool = False) -> tuple[jax.Array, Any, Any]:
        grad_fn = jax.value_and_grad(functools.partial(loss_and_rest, local=local), has_aux=True)
        if grad_accum == 1:
            (loss, rest), grads = grad_fn(params, rest, batch)
            return loss, grads, rest

        def accumulate(carry, micro):
            loss_sum, grad_sum, rest = carry
            if not local:
                micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
            (loss, rest), grads = grad_fn(params, rest, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), rest), None

        zeros = jax.tree.map(jnp.zeros_like, params)  # varying when the parameters are
        loss_sum = jnp.zeros((), jnp.float32)
        if local:  # per device (inside shard_map) each device's running loss is its own
            loss_sum = lax.pcast(loss_sum, replicas[1], to="varying")
        (loss, grads, rest), _ = jax.lax.scan(accumulate, (loss_sum, zeros, rest), _microbatches(batch, grad_accum))
        return loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads), rest

    def gradients_per_device(params: Any, rest: Any, batch: Any) -> tuple[jax.Array, Any, Any]:
        mesh, axes = replicas
        leaves, tree = jax.tree.flatten(params)
        buckets = _buckets([leaf.size * np.dtype(leaf.dtype).itemsize for leaf in leaves])

        def mean_shard(grads: list[jax.Array]) -> jax.Array:
            """The mean of a bucket of ``grads``, flattened and joined; or this device's slice of
            the mean of one large gradient, flattened and padded to split evenly."""
            if len(grads) > 1:
                return lax.psum(jnp.concatenate([grad.reshape(-1) for grad in grads]), axes) / replica_count
            flat = grads[0].reshape(-1)
            if flat.size % replica_count:
                flat = jnp.pad(flat, (0, replica_count - flat.size % replica_count))
            return lax.psum_scatter(flat, axes, tiled=True) / replica_count

        def on_device(params: Any, rest: Any, batch: Any) -> tuple[jax.Array, Any, Any]:
            # Varying parameters keep one gradient per device (shard_map would otherwise sum
            # the gradient of a replicated input itself); the buckets' reductions are the only ones.
            params = jax.tree.map(lambda value: lax.pcast(value, axes, to="varying"), params)
            loss, grads, rest = gradients(params, rest, batch, local=True)
            grads = jax.tree.leaves(grads)
            return lax.pmean(loss, axes), [mean_shard([grads[i] for i in bucket]) for bucket in buckets], rest

        loss, shards, rest = jax.shard_map(
            on_device, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axes)),
            out_specs=(PartitionSpec(), [PartitionSpec() if len(bucket) > 1 else PartitionSpec(axes) for bucket in buckets],
                       PartitionSpec()),
        )(params, rest, batch)
        grads: list[Any] = [None] * len(leaves)
        for bucket, shard in zip(buckets, shards):  # a bucket is whole; a large gradient split over the replicas
            start = 0
            for i in bucket:
                grads[i] = shard[start:start + leaves[i].size].reshape(leaves[i].shape)
                start += leaves[i].size
        # the gradient layout (replicated) then makes the compiler all-gather the slices
        return loss, jax.tree.unflatten(tree, grads), rest

    def per_device_fits(state: TrainState, batch: Any) -> bool:
        """Per-device gradients need several devices, no non-parameter state and rows that split evenly."""
        if replica_count <= 1 or jax.tree.leaves(state.rest):
            return False
        return all(np.ndim(leaf) >= 1 and np.shape(leaf)[0] % (replica_count * grad_accum) == 0
                   for leaf in jax.tree.leaves(batch))

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        if per_device_fits(state, batch):
            loss, grads, rest = gradients_per_device(state.params, state.rest, batch)
        else:
            loss, grads, rest = gradients(state.params, state.rest, batch)
        grads = jax.lax.with_sharding_constraint(grads, gradient_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rest=rest)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return step
