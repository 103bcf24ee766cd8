"""What a part computes, as a loss: the program tensor parallelism reads each part's split off.

Under ``tp``, ``fsdp_tp`` and ``pp_tp`` the weights nobody annotated are split as Megatron would,
read off a program that uses them (``shardax.sharding.derive``). For a lone model that program
is its loss; for a part of a run it is the part's ``forward``, or else the user's own step with
that part in it and the other parts as stand-ins of their shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.model_state import holding_arrays
from shardax.step.parts import NamedModules, StepFn


def forward_as_loss(forward: Callable[[nnx.Module, Any], Any]) -> Callable[[nnx.Module, Any], jax.Array]:
    """A scalar of what ``forward`` computes, for reading tensor-parallel splits off its program."""

    def loss(model: nnx.Module, batch: Any) -> jax.Array:
        return sum((jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(forward(model, batch))),
                   jnp.zeros((), jnp.float32))

    return loss


class Reading(NamedModules):
    """The parts as the user's step sees them while shardax reads a part's use off it: modules
    by name; ``update`` keeps the gradients given (what a step that reports no metric computes)."""

    def __init__(self, modules: dict[str, nnx.Module]) -> None:
        self._modules, self.given = modules, []

    def update(self, name: str, grads: Any) -> None:
        self.given.append(grads)


def stand_in(leaf: Any) -> jax.Array:
    """An array of ``leaf``'s shape and dtype (RNG keys included) for another part's weights."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        key = jax.random.key(0)
        return jnp.broadcast_to(key, leaf.shape) if leaf.shape else key
    return jnp.zeros(leaf.shape, leaf.dtype)


def step_as_loss(step_fn: StepFn, name: str, parts: dict[str, Any]) -> Callable[..., jax.Array]:
    """A scalar of what the user's ``step_fn`` computes, as a loss of part ``name`` (the other
    parts enter as zeros of their shapes): tensor-parallel splits are read off the step itself,
    so that no part needs its ``forward`` spelled out."""
    shapes: dict[str, tuple[nnx.GraphDef, Any, Any]] = {}

    def loss(model: nnx.Module, batch: Any) -> jax.Array:
        if not shapes:
            for other, part in parts.items():
                shapes[other] = nnx.split(nnx.eval_shape(lambda p=part: holding_arrays(p.model)(nnx.Rngs(0))),
                                          nnx.Param, ...)
        modules = {}
        for other, (graphdef, params, rest) in shapes.items():
            stand_ins = [jax.tree.map(stand_in, tree) for tree in (params, rest)]
            modules[other] = model if other == name else nnx.merge(graphdef, *stand_ins, copy=True)
            trained = parts[other].optimizer is not None
            modules[other].train() if trained else modules[other].eval()
        reading = Reading(modules)
        metrics = jax.tree.leaves(step_fn(reading, batch))
        outputs = metrics or jax.tree.leaves(reading.given)  # a step that reports nothing: its updates
        return sum((jnp.sum(leaf.astype(jnp.float32)) for leaf in outputs
                    if jnp.issubdtype(leaf.dtype, jnp.inexact)), jnp.zeros((), jnp.float32))

    return loss
