"""The train step of every strategy: one function, laid out by a ``Layout``.

The strategy never appears as a branch here. Parameters are constrained to their compute
layout before the forward pass (for FSDP that is the all-gather), gradients to the strategy's
gradient layout (the compiler then all-reduces or reduce-scatters them), and jit's
in/out shardings keep parameters and optimizer state where the layout says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

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
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The un-jitted step ``(state, batch) -> (state, metrics)``; see ``ParallelModel.train_step``.

    ``layer_layout()`` is entered while the loss is traced, so layers that read their weights
    through ``for_compute`` gather (and reduce-scatter) them one layer at a time.
    """

    def loss_and_rest(params: Any, rest: Any, batch: Any) -> tuple[jax.Array, Any]:
        params = jax.tree.map(gather_for_compute, params, compute_shardings, gradient_shardings)
        model = nnx.merge(graphdef, params, rest)
        with layer_layout():
            loss = loss_fn(model, batch)
        return loss, nnx.split(model, nnx.Param, ...)[2]

    grad_fn = jax.value_and_grad(loss_and_rest, has_aux=True)

    def gradients(params: Any, rest: Any, batch: Any) -> tuple[jax.Array, Any, Any]:
        if grad_accum == 1:
            (loss, rest), grads = grad_fn(params, rest, batch)
            return loss, grads, rest

        def accumulate(carry, micro):
            loss_sum, grad_sum, rest = carry
            micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
            (loss, rest), grads = grad_fn(params, rest, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), rest), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss, grads, rest), _ = jax.lax.scan(
            accumulate, (jnp.zeros((), jnp.float32), zeros, rest), _microbatches(batch, grad_accum)
        )
        return loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads), rest

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        loss, grads, rest = gradients(state.params, state.rest, batch)
        grads = jax.lax.with_sharding_constraint(grads, gradient_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rest=rest)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return step
