"""What a strategy should cost, from shapes and specs alone: bytes per device and communication.

Communication is counted as the bytes one device sends per step with ring algorithms:
an all-reduce of S bytes over n devices sends 2(n-1)/n S, an all-gather or reduce-scatter
(n-1)/n S. Data parallelism all-reduces every gradient once (ZeRO-2 reduce-scatters the
gradients and all-gathers the updated parameters: the same total); FSDP all-gathers the
parameters for the forward pass and again for the backward pass and reduce-scatters the
gradients, 3(n-1)/n of the parameter bytes; ZeRO-1, which all-reduces full gradients and
then all-gathers the updated parameters, 3(n-1)/n too; tensor parallelism adds two
all-reduces of the activations per layer in each direction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from shardax.sharding.layout import Layout
from shardax.sharding.place import spec_axes


def _axes_size(mesh_shape: dict[str, int], axes: Any) -> int:
    return math.prod(mesh_shape.get(axis, 1) for axis in axes)


def _leaf_bytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
    """Bytes per device of each part of a train step's working set."""

    params: int
    gradients: int
    optimizer: int
    batch: int
    activations: int  # an estimate: what the backward pass keeps, for shardax's transformer

    @property
    def state(self) -> int:
        """What the step takes as arguments: parameters, optimizer state and the batch."""
        return self.params + self.optimizer + self.batch

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.batch + self.activations


def _per_device(layout: Layout, attribute: str) -> int:
    shape = dict(layout.mesh.shape)
    total = 0
    for leaf in layout.leaves.values():
        spec = getattr(leaf, attribute)
        split = math.prod(_axes_size(shape, spec_axes(entry)) for entry in spec)
        total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // split
    return total


def batch_rows_per_device(layout: Layout, batch_size: int) -> int:
    split = _axes_size(dict(layout.mesh.shape), [a for a in layout.strategy.batch_axes if a in layout.mesh.shape])
    return max(batch_size // split, 1)


def activation_bytes(layout: Layout, model: Any, batch_size: int, grad_accum: int = 1) -> int:
    """Rough activation memory of ``TransformerLM`` per device (remat policy included)."""
    if model is None:
        return 0
    shape = dict(layout.mesh.shape)
    model_split = shape.get("model", 1) if "model" in str(layout.strategy.param_rules) else 1
    rows = max(batch_rows_per_device(layout, batch_size) // grad_accum, 1)
    t, d, c = model.seq_len, model.d_model, (2 if model.compute_dtype == "bfloat16" else 4)
    heads, hidden = max(model.n_heads // model_split, 1), max(model.d_ff // model_split, 1)
    per_layer = rows * t * (4 * d * 4 + 4 * heads * model.head_dim * c + 2 * hidden * c) + 2 * rows * heads * t * t * 4
    carry = rows * t * d * 4
    kept = {"none": model.n_layers * per_layer, "full": model.n_layers * carry + per_layer}.get(
        model.remat, model.n_layers * (carry + per_layer // 2) + per_layer)
    logits = 3 * rows * t * max(model.vocab_size // model_split, 1) * 4
    return kept + logits


def _sharded_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes per device of a tree laid out by ``shardings`` (shapes and specs only, no compile)."""
    import jax

    sizes = jax.tree.map(
        lambda leaf, sharding: math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize,
        abstract, shardings,
    )
    return int(sum(jax.tree.leaves(sizes)))


def predict_memory(parallel: Any, model: Any, batch_size: int, seq_len: int, grad_accum: int = 1) -> MemoryPrediction:
    """Bytes per device of a ``ParallelModel``'s step, from its shapes and shardings."""
    layout, abstract, shardings = parallel.layout, parallel.abstract_state, parallel.state_shardings
    gradient_spec = "optimizer_spec" if layout.strategy.shard_gradients else "spec"
    return MemoryPrediction(
        params=_sharded_bytes(abstract.params, shardings.params),
        gradients=_per_device(layout, gradient_spec),
        optimizer=_sharded_bytes((abstract.opt_state, abstract.step), (shardings.opt_state, shardings.step)),
        batch=batch_rows_per_device(layout, batch_size) * (seq_len + 1) * 4,
        activations=activation_bytes(layout, model, batch_size, grad_accum),
    )


def theoretical_collective_bytes(layout: Layout, model: Any, batch_size: int) -> float:
    """The least a step of this strategy must send per device (see the module docstring)."""
    shape = dict(layout.mesh.shape)
    strategy = layout.strategy
    gather = _axes_size(shape, strategy.gather_axes)
    batch_axes = [a for a in strategy.batch_axes if a in shape]
    replicas = _axes_size(shape, [a for a in batch_axes if a not in strategy.gather_axes])
    total = 0.0
    for leaf in layout.leaves.values():
        other_axes = [a for e in leaf.spec for a in spec_axes(e) if a not in strategy.gather_axes]
        within_group = _leaf_bytes(leaf) / _axes_size(shape, other_axes)  # bytes per data-parallel group
        gathered = any(a in strategy.gather_axes for e in leaf.spec for a in spec_axes(e))
        if gathered:
            total += 3 * (gather - 1) / gather * within_group
        elif gather > 1:  # a leaf FSDP could not shard is all-reduced within the group
            total += 2 * (gather - 1) / gather * within_group
        if replicas > 1:  # data parallelism across groups (dp, zero*, tp's data axis, hsdp's replicas)
            total += 2 * (replicas - 1) / replicas * within_group / (gather if gathered else 1)
            if strategy.optimizer_axes and not strategy.shard_gradients:  # ZeRO-1: all-gather updated params
                total += (replicas - 1) / replicas * within_group
    model_size = shape.get("model", 1)
    if model is not None and model_size > 1 and "model" in str(strategy.param_rules):
        rows = batch_rows_per_device(layout, batch_size)
        activation = rows * model.seq_len * model.d_model * 4
        total += (4 * model.n_layers + 2) * 2 * (model_size - 1) / model_size * activation
    return total
