"""The training state every strategy shards: step, parameters, optimizer state, other variables."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """A pytree: ``step`` (int32 scalar, steps taken), ``params`` (``nnx.State`` of ``nnx.Param``),
    ``opt_state`` (optax state over ``params``), ``rest`` (every other NNX variable) and
    ``skipped`` (int32 scalar: steps whose update was not applied because their loss or gradient
    norm was not finite)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rest: Any
    skipped: jax.Array
