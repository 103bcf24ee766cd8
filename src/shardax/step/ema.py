"""An exponential moving average of the trained parameters, kept in the optimizer state.

``ema_params(decay)`` is an optax transformation to put last in a chain: it leaves the updates
as they are, applies them to the parameters and folds the result into its average. Living in
the optimizer state, the average is laid out like it (split over ``data`` under zero1, zero2,
fsdp and hsdp; like the parameters under tp), checkpointed and restored with it, and skipped
with it on a step whose update is not applied. The average starts at zero and is read divided by
``1 - decay ** steps`` (as Adam corrects its moments), so that it is the parameters' own
average from the first step on, not a pull toward zero or toward the initial weights.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from shardax.errors import UsageError


class EmaState(NamedTuple):
    """``average``: the sum over steps t of (1 - decay) decay^(T-t) params_t (one leaf per trained
    parameter, float32); ``weight``: the same sum of weights, 1 - decay^T."""

    weight: jax.Array
    average: Any


def ema_params(decay: float) -> optax.GradientTransformation:
    """Keep an exponential moving average of the parameters (put it last: ``optax.chain(tx,
    shardax.ema_params(0.999))``); read it with ``ParallelModel.ema_model`` or ``averaged``."""
    if not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise UsageError(f"EMA decay {decay!r} is not between 0 and 1 (exclusive); use e.g. 0.999 (an "
                         "average over about the last 1,000 steps) or 0.9999 for long runs")

    def init(params: Any) -> EmaState:
        return EmaState(jnp.zeros([], jnp.float32),
                        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params))

    def update(updates: Any, state: EmaState, params: Any = None) -> tuple[Any, EmaState]:
        if params is None:
            raise UsageError("ema_params needs the parameters: call the optimizer's update(grads, state, "
                             "params)")
        new = optax.apply_updates(params, updates)
        average = jax.tree.map(lambda a, p: decay * a + (1 - decay) * p.astype(jnp.float32), state.average,
                               new)
        return updates, EmaState(decay * state.weight + (1 - decay), average)

    return optax.GradientTransformation(init, update)


def keeps_average(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds a moving average of the parameters (``ema_params``)."""
    return any(isinstance(leaf, EmaState)
               for leaf in jax.tree.leaves(opt_state, is_leaf=lambda node: isinstance(node, EmaState)))


def averaged(opt_state: Any, params: Any) -> Any:
    """The moving average of ``params`` held in ``opt_state`` (bias-corrected, in ``params``'
    dtypes); ``params`` themselves while no update has been applied. Refused in one line unless
    the optimizer keeps exactly one average."""
    found = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda node: isinstance(node, EmaState))
             if isinstance(leaf, EmaState)]
    if len(found) != 1:
        raise UsageError(f"the optimizer keeps {len(found)} parameter averages, where one is needed; chain "
                         "shardax.ema_params(decay) once, last: optax.chain(tx, shardax.ema_params(0.999))")
    [state] = found
    started = state.weight > 0
    correction = jnp.where(started, state.weight, 1.0)
    return jax.tree.map(lambda a, p: jnp.where(started, a / correction, p).astype(jnp.result_type(p)),
                        state.average, params)
