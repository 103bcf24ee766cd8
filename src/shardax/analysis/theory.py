"""What a strategy should send, from shapes and specs alone: bytes per device per step.

Communication is counted as the bytes one device sends per step with ring algorithms:
an all-reduce of S bytes over n devices sends 2(n-1)/n S, an all-gather or reduce-scatter
(n-1)/n S. Data parallelism all-reduces every gradient once (ZeRO-2 reduce-scatters the
gradients and all-gathers the updated parameters: the same total); FSDP all-gathers the
parameters for the forward pass and again for the backward pass and reduce-scatters the
gradients, 3(n-1)/n of the parameter bytes; ZeRO-1, which all-reduces full gradients and
then all-gathers the updated parameters, 3(n-1)/n too; tensor parallelism adds two
all-reduces of the activations per layer in each direction. The memory model is in
``shardax.analysis.memory``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from shardax.analysis.memory import (
    batch_rows_per_device,
    bytes_per_group,
    check_compiler,
    model_split_dims,
    replica_count,
    size_of_axes,
    split_into_stages,
)
from shardax.sharding.layout import Layout
from shardax.sharding.place import spec_axes
from shardax.vocabulary import CONTEXT, MODEL


def pipeline_point_to_point_bytes(layout: Layout, model: Any, batch_size: int, schedule: Any) -> float:
    """What a pipeline step sends between stages per device: one microbatch's activations each
    iteration forward and back (R*M + S - 1 each), one more roll each way to hand the last
    outputs back, the outputs handed out over the stages after the loop (and their gradients
    back), and the gradient of the microbatches, which arrives at stage 0, summed to every
    stage (each computes the embeddings of the whole batch)."""
    rows = batch_rows_per_device(layout, batch_size) // schedule.microbatches
    slot = rows * model.seq_len * model.d_model * 4
    stages = schedule.stages
    shift = 2 * (schedule.iterations + 1) * slot
    hand_out = (2 * (stages - 1) / stages * schedule.microbatches * slot
                if schedule.microbatches % stages == 0 else 0)
    hand_in = 2 * (stages - 1) / stages * schedule.microbatches * slot
    return shift + hand_out + hand_in


def circular_regroup_share(schedule: Any) -> float:
    """The share of its layers a stage must receive (and send back as gradients) to run a
    circular schedule. The stack is stored in order, so stage s holds chunks s*R .. s*R + R - 1
    of the R*S chunks; it runs chunks s, S + s, ..., (R-1)*S + s. It keeps those it holds
    already and receives the rest: averaged over the stages, 1 - (chunks kept) / (R*S)."""
    stages, repeats = schedule.stages, schedule.repeats
    kept = sum(1 for s in range(stages) for j in range(repeats) if (s * repeats + j) % stages == s)
    return 1.0 - kept / (stages * repeats)


def context_attention_bytes(layout: Layout, model: Any, batch_size: int,
                            variant: str = "all-gather") -> float:
    """What attention over a sequence split C ways sends per device per step (0 without a
    ``context`` axis). With K the bytes of one device's share of a layer's keys (as many of its
    values), G the same in float32 and I of the share's token positions (as many of its document
    ids), per layer:

    - ``all-gather``: keys and values gathered in the forward pass and their gradients
      reduce-scattered, (C-1) * 4K; positions and documents, the same for every layer, gathered
      once per step. Under ``--remat none`` the backward pass reuses the gathered keys and
      values; under any other remat it gathers them again, with the positions and documents
      its mask is made of: (C-1) * (2K + 2I) more per layer.
    - ``ring``: C-1 hops of keys, values, positions and documents forward; backward, C-1 hops of
      keys and values with their float32 gradients, then one hop that brings the gradients
      home: (C-1) * (2K + 2I) + (C-1) * (2K + 2G) + 2G.

    Besides, the per-token losses come back from the zig-zag order: (C-1)/C of each row's
    float32 losses."""
    shards = dict(layout.mesh.shape).get(CONTEXT, 1)
    if model is None or shards == 1:
        return 0.0
    rows = batch_rows_per_device(layout, batch_size)
    heads = model.n_heads // model_split_dims(layout)["heads"]
    tokens = rows * model.seq_len // shards  # one device's share of the sequence
    keys = tokens * heads * model.head_dim * np.dtype(model.dtype).itemsize
    ints = tokens * 4
    grads = tokens * heads * model.head_dim * 4
    once = (shards - 1) * tokens * 4  # the losses back in order
    if variant == "all-gather":
        per_layer = (shards - 1) * 4 * keys
        if model.remat != "none":  # gathered again for the backward pass
            per_layer += (shards - 1) * (2 * keys + 2 * ints)
        once += (shards - 1) * 2 * ints
    else:
        per_layer = (shards - 1) * (2 * keys + 2 * ints) + (shards - 1) * (2 * keys + 2 * grads) + 2 * grads
    return float(model.n_layers * per_layer + once)


# What each compiler sends in a narrower dtype than the stored float32 (``compiler`` below):
# XLA:CPU sends what is stored; XLA:TPU, at JAX's default precision, multiplies float32 in
# bfloat16 and converts FSDP's weight matrices before it gathers them; XLA:GPU sends whatever
# the model computes in its compute dtype in that dtype: the weights it gathers, their
# gradients, and tensor parallelism's activations.


def _narrowing(leaf: Any, compute: Any, compiler: str) -> float:
    """The share of ``leaf``'s stored bytes its gather for compute sends (1.0: all of them)."""
    if compiler == "cpu" or not jnp.issubdtype(leaf.dtype, jnp.floating):
        return 1.0
    travels = jnp.dtype(compute or leaf.dtype).itemsize
    if compiler == "tpu" and len(leaf.shape) >= 2:
        travels = 2
    return min(travels / jnp.dtype(leaf.dtype).itemsize, 1.0)


def _looked_up(leaf: Any) -> bool:
    """A table whose rows are looked up by token (an ``nnx.Embed``'s ``embedding``, or one whose
    first logical axis is the vocabulary): its gradient is scattered, and summed, in float32."""
    return leaf.path.split("/")[-1] == "embedding" or bool(leaf.logical and leaf.logical[0] == "vocab")


def _gradient_narrowing(leaf: Any, compute: Any, compiler: str) -> float:
    """The share of ``leaf``'s stored bytes its gradient's reduction sends: XLA:GPU reduces the
    gradients of what was computed in the compute dtype in that dtype, before converting them."""
    if compiler != "cuda" or _looked_up(leaf):
        return 1.0
    return _narrowing(leaf, compute, compiler)


def _parameter_bytes(layout: Layout, schedule: Any, compute: Any, compiler: str) -> float:
    """What the parameters and their gradients send per device: FSDP's gathers and reduce-scatters,
    a circular schedule's regrouping, and the gradients summed over context and data-parallel copies."""
    shape = dict(layout.mesh.shape)
    strategy = layout.strategy
    gather = size_of_axes(shape, strategy.gather_axes)
    replicas = replica_count(layout)
    # each device of a context axis computes the gradients of its share of the sequence: they are
    # summed over it first, then over the batch axes (two all-reduces, as XLA compiles them)
    context = shape.get(CONTEXT, 1)
    stages = shape.get(strategy.pipeline_axis, 1) if schedule is not None else 1
    total = 0.0
    for leaf in layout.leaves.values():
        within_group = bytes_per_group(leaf, shape, strategy)
        gathered = any(a in strategy.gather_axes for e in leaf.spec for a in spec_axes(e))
        staged = stages > 1 and split_into_stages(leaf, strategy)
        narrowed = _narrowing(leaf, compute, compiler)
        gradient = _gradient_narrowing(leaf, compute, compiler) * within_group
        if gathered:  # a pipeline gathers its stage's weights once per step, not again for the backward pass
            total += (1 if staged else 2) * narrowed * (gather - 1) / gather * within_group
            total += (gather - 1) / gather * gradient
        elif gather > 1:  # a leaf FSDP could not shard is all-reduced within the group
            total += 2 * (gather - 1) / gather * gradient
        if staged and schedule.repeats > 1:
            # a circular schedule regroups the stage's layers, and their gradients
            total += 2 * circular_regroup_share(schedule) * within_group
        # under a pipeline, what is not split into stages (embeddings, the head) is used by rows
        # split over the stages too, so its gradients are summed over them as well
        copies = replicas * (stages if stages > 1 and not staged else 1)
        if context > 1:
            total += 2 * (context - 1) / context * gradient / (gather if gathered else 1)
        if copies > 1:  # data parallelism across groups (dp, zero*, tp's data axis, hsdp's replicas)
            total += 2 * (copies - 1) / copies * gradient / (gather if gathered else 1)
            if strategy.optimizer_axes and not strategy.shard_gradients:  # ZeRO-1: all-gather updated params
                total += (copies - 1) / copies * within_group
    return total


def _tensor_parallel_bytes(layout: Layout, model: Any, batch_size: int, schedule: Any,
                           compiler: str) -> float:
    """What tensor parallelism sends per device: two all-reduces of the activations per layer in
    each direction (XLA:GPU sends them in the compute dtype), and those around the embedding and
    the head, in float32 (0 without a split ``model`` axis)."""
    shape = dict(layout.mesh.shape)
    model_size = shape.get(MODEL, 1)
    if model is None or model_size <= 1 or MODEL not in str(layout.strategy.param_rules):
        return 0.0
    rows = batch_rows_per_device(layout, batch_size)
    activation = rows * model.seq_len * model.d_model * 4 / shape.get(CONTEXT, 1)
    layers, ends = model.n_layers, activation
    if compiler == "cuda":
        activation *= jnp.dtype(getattr(model, "compute_dtype", None) or "float32").itemsize / 4
    if schedule is not None:  # each stage runs its L/(R*S) layers on a microbatch per iteration
        layers = model.n_layers // (schedule.stages * schedule.repeats) * schedule.iterations
        if schedule.microbatches % schedule.stages == 0:  # the head works on rows split over the stages
            ends = activation / schedule.stages
        activation /= schedule.microbatches
    return (4 * layers * activation + 2 * ends) * 2 * (model_size - 1) / model_size


def expert_exchange_bytes(layout: Layout, model: Any, batch_size: int) -> float:
    """What a mixture of experts split over an ``expert`` axis of X devices sends per device per
    step (0 without one): in each layer two all-to-alls forward (the token copies out to their
    experts' devices, the results back) and their two transposes backward, each of X slots of
    ``tokens x min(top_k, E / X)`` rows of ``d_model`` in the compute dtype, of which (X-1)/X
    leave the device; a remat policy other than ``none`` runs the forward pair again. Plus the
    copies' counts, one int32 per expert, out once per layer."""
    axis = dict(layout.strategy.param_rules).get("expert")
    shards = layout.mesh.shape.get(axis, 1) if axis else 1
    if shards <= 1 or not getattr(model, "n_experts", 0):
        return 0.0
    token_axes = [a for a in layout.strategy.batch_axes if a in layout.mesh.shape] + [
        a for a in (CONTEXT,) if a in layout.mesh.shape]
    tokens = batch_size * model.seq_len // size_of_axes(dict(layout.mesh.shape), token_axes)
    slots = tokens * min(model.experts_per_token, model.n_experts // shards)
    share = (shards - 1) / shards
    exchange = shards * slots * model.d_model * jnp.dtype(model.dtype).itemsize * share
    passes = 4 + (2 if model.remat != "none" else 0)
    return model.n_layers * (passes * exchange + model.n_experts * 4 * share)


def experts_bytes(layout: Layout) -> tuple[int, int]:
    """(the bytes of every expert's weights, of those one device stores) in ``layout``."""
    whole = held = 0
    for leaf in layout.leaves.values():
        if leaf.logical and "expert" in leaf.logical:
            size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            split = int(np.prod([layout.mesh.shape[a] for entry in leaf.spec for a in spec_axes(entry)]))
            whole, held = whole + size, held + size // split
    return whole, held


def theoretical_collective_bytes(layout: Layout, model: Any, batch_size: int, schedule: Any = None,
                                 context_attention: str = "all-gather",
                                 compiler: str = "cpu") -> float:
    """The least a step of this strategy must send per device (see the module docstring).

    ``compiler``: the platform compiled for, one of ``shardax.analysis.memory.COMPILERS``, which
    decides the dtype things travel in. ``"cpu"``: as stored. ``"tpu"``: the weight matrices FSDP
    gathers travel in bfloat16 (XLA:TPU multiplies float32 in bfloat16 at JAX's default
    precision, and converts before it gathers), vectors in the compute dtype, gradients in the
    parameters' dtype. ``"cuda"``: what is computed in the compute dtype travels in it: gathered
    weights, their gradients (not a looked-up table's, scattered in float32), tensor
    parallelism's activations.
    """
    check_compiler(compiler)
    total = context_attention_bytes(layout, model, batch_size, context_attention)
    total += 0.0 if schedule is None else pipeline_point_to_point_bytes(layout, model, batch_size, schedule)
    compute = getattr(model, "compute_dtype", None)
    total += _parameter_bytes(layout, schedule, compute, compiler)
    total += _tensor_parallel_bytes(layout, model, batch_size, schedule, compiler)
    return total + expert_exchange_bytes(layout, model, batch_size)
