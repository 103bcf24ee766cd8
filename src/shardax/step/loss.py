"""What a loss function may return: the mean loss, or the mean loss and a dict of metrics.

A loss that is a mean over a varying number of things (the tokens of a packed or padded batch
that count) reports that number as ``"weight"`` beside its metrics. Gradient accumulation
then weights each microbatch by it and divides once by the total, so k microbatches give the
same update as the whole batch; evaluation averages batches by it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from shardax.errors import UsageError

# loss_fn(model, batch) -> loss | (loss, {"accuracy": ..., "weight": tokens, ...})
LossFn = Callable[[Any, Any], Any]
RESERVED = ("loss", "grad_norm")
WEIGHT = "weight"


def split_loss(output: Any) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
    """``(loss, metrics, weight)`` from what ``loss_fn`` returned, every value a float32 scalar.

    Each value is taken to be a mean over the batch it was given (over ``weight`` things when the
    loss reports one, else over its rows): the step averages them over microbatches, and
    evaluation over batches, like the loss. ``weight`` is None when none was reported; it is
    never differentiated.
    """
    if isinstance(output, tuple):
        if len(output) != 2 or not isinstance(output[1], Mapping):
            raise UsageError(
                f"loss_fn returned a tuple of {len(output)} ({', '.join(type(o).__name__ for o in output)}); "
                "return the mean loss, or (loss, {'name': scalar, ...})"
            )
        loss, metrics = output
    else:
        loss, metrics = output, {}
    if jnp.ndim(loss) != 0:
        raise UsageError(f"loss_fn returned a loss of shape {jnp.shape(loss)}; return its mean over the "
                         "batch (a scalar)")
    checked, weight = {}, None
    for name, value in metrics.items():
        if not isinstance(name, str) or name in RESERVED:
            raise UsageError(f"loss_fn returned a metric named {name!r}; use a string other than {RESERVED}")
        if jnp.ndim(value) != 0:
            raise UsageError(f"loss_fn returned metric {name!r} of shape {jnp.shape(value)}; "
                             "return its mean over the batch (a scalar)")
        if name == WEIGHT:
            weight = jax.lax.stop_gradient(jnp.asarray(value, jnp.float32))
        else:
            checked[name] = jnp.asarray(value, jnp.float32)
    return jnp.asarray(loss, jnp.float32), checked, weight


def weighted_mean(total: jax.Array, weight: jax.Array) -> jax.Array:
    """``total / weight``, and 0 where nothing counted (a batch of padding only)."""
    return total / jnp.where(weight > 0, weight, 1.0)
