"""What a loss function may return: the mean loss, or the mean loss and a dict of metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from shardax.errors import UsageError

# loss_fn(model, batch) -> loss | (loss, {"accuracy": ..., ...})
LossFn = Callable[[Any, Any], Any]
RESERVED = ("loss", "grad_norm")


def split_loss(output: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)`` from what ``loss_fn`` returned, every value a float32 scalar.

    Each value is taken to be a mean over the batch it was given: the step averages them
    over microbatches, and evaluation over batches, like the loss.
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
        raise UsageError(f"loss_fn returned a loss of shape {jnp.shape(loss)}; return its mean over the batch (a scalar)")
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or name in RESERVED:
            raise UsageError(f"loss_fn returned a metric named {name!r}; use a string other than {RESERVED}")
        if jnp.ndim(value) != 0:
            raise UsageError(f"loss_fn returned metric {name!r} of shape {jnp.shape(value)}; "
                             "return its mean over the batch (a scalar)")
        checked[name] = jnp.asarray(value, jnp.float32)
    return jnp.asarray(loss, jnp.float32), checked
