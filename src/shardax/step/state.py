"""The training state every strategy shards: step, parameters, optimizer state, other variables."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """A pytree: ``step`` (int32 scalar), ``params`` (``nnx.State`` of ``nnx.Param``),
    ``opt_state`` (optax state over ``params``) and ``rest`` (every other NNX variable)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rest: Any
