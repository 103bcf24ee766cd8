"""The train step of every strategy: one function, laid out by a ``Layout``.

The strategy never appears as a branch here. Parameters are constrained to their compute
layout before the forward pass (for FSDP that is the all-gather), gradients to the strategy's
gradient layout (the compiler then all-reduces or reduce-scatters them), and jit's
in/out shardings keep parameters and optimizer state where the layout says.

When every parameter and gradient is replicated (``dp``, ``zero1``), the forward and backward
passes run per device inside ``shard_map`` instead, and the gradients are averaged once after
the backward pass. The compiler would otherwise reduce each scanned layer's gradients inside
the layer loop: the same bytes, but one collective per layer. The average is a ring
all-reduce written as its two halves, a reduce-scatter and an all-gather: the same bytes on
the wire, but no second full copy of the gradients (XLA:CPU's tuple all-reduce keeps one).
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

        def mean_shard(grad: jax.Array) -> jax.Array:
            """This device's slice of the mean gradient, flattened and padded to split evenly."""
            flat = grad.reshape(-1)
            if flat.size % replica_count:
                flat = jnp.pad(flat, (0, replica_count - flat.size % replica_count))
            return lax.psum_scatter(flat, axes, tiled=True) / replica_count

        def on_device(params: Any, rest: Any, batch: Any) -> tuple[jax.Array, Any, Any]:
            # Varying parameters keep one gradient per device (shard_map would otherwise sum
            # the gradient of a replicated input itself); the reduce-scatter is the one reduction.
            params = jax.tree.map(lambda value: lax.pcast(value, axes, to="varying"), params)
            loss, grads, rest = gradients(params, rest, batch, local=True)
            return lax.pmean(loss, axes), jax.tree.map(mean_shard, grads), rest

        loss, shards, rest = jax.shard_map(
            on_device, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axes)),
            out_specs=(PartitionSpec(), PartitionSpec(axes), PartitionSpec()),
        )(params, rest, batch)
        # the gradient layout (replicated) then makes the compiler all-gather the slices
        grads = jax.tree.map(lambda shard, param: shard[:param.size].reshape(param.shape), shards, params)
        return loss, grads, rest

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
