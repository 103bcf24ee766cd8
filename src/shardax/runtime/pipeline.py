"""Pipeline parallelism: a stack of layers split into stages over a ``stage`` mesh axis.

The layers' parameters are stored stacked (a leading ``layers`` dimension) and split over
``stage`` in order: with S stages and L layers, stage s holds layers s*L/S .. (s+1)*L/S - 1.
The batch is cut into M microbatches that flow through the stages, one stage per iteration,
as an SPMD "shifting buffer" (the form MaxText uses): a buffer holds one microbatch's
activations per stage (its leading dimension is split over ``stage``); every iteration each
stage applies its layers to its slot (``jax.vmap`` over the stage dimension, partitioned by
``spmd_axis_name``), then the buffer shifts by one stage (XLA turns the shift into a
collective-permute between neighbouring stages) and stage 0 takes the next microbatch.

Iterations: R*M + S - 1 for R repeats; during the first and last S - 1 some stages have
nothing to do (the bubble, (S-1) / (R*M + S - 1) of the iterations). Their slots are zeros,
their outputs are never read, so nothing computed in the bubble reaches the loss or the
gradients. With R > 1 (circular) the layers are cut into R*S chunks; a microbatch leaving the
last stage comes back to stage 0 for the next chunk, which needs M >= S.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.sharding.compute import PIPELINE_CHUNK, gather_for_compute, remat_policy
from shardax.sharding.paths import path_to_str


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many stages, microbatches and repeats (circular chunks per stage) a pipeline runs."""

    stages: int
    microbatches: int
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.microbatches < 1 or self.repeats < 1:
            raise UsageError(f"`microbatches={self.microbatches}` and `pipeline_repeats={self.repeats}` must "
                             "be at least 1")
        if self.repeats > 1 and self.microbatches < self.stages:
            raise UsageError(f"`pipeline_repeats={self.repeats}` needs microbatches of at least the "
                             f"{self.stages} stages (a microbatch comes back to stage 0), not "
                             f"{self.microbatches}")

    @property
    def iterations(self) -> int:
        """Stage iterations per step: R*M + S - 1."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of stage iterations with nothing to do: (S-1) / (R*M + S - 1)."""
        return (self.stages - 1) / self.iterations

    def check_layers(self, layers: int) -> None:
        """The layers must split evenly into stages x repeats chunks; say which counts would."""
        chunks = self.stages * self.repeats
        if layers % chunks:
            lower, upper = layers - layers % chunks, layers - layers % chunks + chunks
            nearest = " or ".join(str(n) for n in (lower, upper) if n > 0)
            into = (f"{self.stages} stages" if self.repeats == 1
                    else f"{self.stages} stages x {self.repeats} repeats ({chunks} equal chunks)")
            raise UsageError(f"{layers} layers do not split into {into}; use {nearest} layers, or a stage "
                             f"count that divides {layers}")


Specs = tuple[PartitionSpec, PartitionSpec, PartitionSpec]  # storage, compute, gradient


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """How one stack of layers runs as a pipeline: over ``axis`` of ``mesh`` by ``schedule``,
    each stage's rows over ``batch_axes``. ``specs``: for each stacked parameter (its path
    within the stack), its storage, compute and gradient specs, so that each stage lays out its
    layers once, before the loop."""

    mesh: Mesh
    axis: str
    schedule: Schedule
    batch_axes: tuple[str, ...]
    specs: tuple[tuple[str, Specs], ...] = ()

    def specs_of(self, path: str) -> Specs | None:
        return dict(self.specs).get(path)


# How the stages' layers are applied side by side: ``jax.vmap`` over the stacked arrays.
# ``nnx.vmap`` compiles to the same program but needs the layers' Variables made anew inside the
# loop (benchmarks/pipeline_vmap.py compiles the step both ways; docs/benchmarks.md has its figures).
vmap_stages: Callable[..., Any] = jax.vmap

# Ops that only move or relabel a value's elements: cheaper to run again than to keep. Batching
# over the stages transposes each picked weight, and a kept transpose would be a copy of the
# chunk's weights per stage iteration all the same.
_LAYOUT_ONLY = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "copy"})


def _not_layout_only(primitive: Any, *avals: Any, **params: Any) -> bool:
    return primitive.name not in _LAYOUT_ONLY


def _stage_policy(policy: Any) -> Any:
    """The policy of a circular schedule's stage checkpoint: what the layers' remat ``policy``
    saves (everything if None), less pure layout ops, the picked chunk and what shardax never saves."""
    layers = remat_policy(policy)

    def decide(primitive: Any, *avals: Any, **params: Any) -> bool:
        return _not_layout_only(primitive) and layers(primitive, *avals, **params)

    return decide


def _pick(leaf: jax.Array, repeat: jax.Array) -> jax.Array:
    """``leaf[repeat]``: a circular pass's chunk of the stage's layers, as one custom-gradient
    primitive named ``PIPELINE_CHUNK`` inside, so that the stage's remat policy picks it again in
    the backward pass. (Named bare, the dynamic slice under the name would be saveable on its
    own, and every stage iteration kept a copy of its chunk's weights: 59 MB of the 184 MB of
    temporaries of an 8-layer, d_model 256 model's step on ``stage=4,data=2`` with R = 2.)"""

    @jax.custom_vjp
    def picked(leaf: jax.Array, repeat: jax.Array) -> jax.Array:
        return checkpoint_name(jax.lax.dynamic_index_in_dim(leaf, repeat, 0, keepdims=False), PIPELINE_CHUNK)

    def forward(leaf: jax.Array, repeat: jax.Array) -> tuple[jax.Array, jax.Array]:
        return picked(leaf, repeat), repeat

    def backward(repeat: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, None]:
        whole = jnp.zeros(leaf.shape, cotangent.dtype)
        return jax.lax.dynamic_update_index_in_dim(whole, cotangent, repeat, 0), None

    picked.defvjp(forward, backward)
    return picked(leaf, repeat)


def _stage_major(leaf: jax.Array, schedule: Schedule) -> jax.Array:
    """``(L, ...) -> (R, S, L/(R*S), ...)``: chunk (r, s) holds layers (r*S + s)*L/(R*S) onwards."""
    chunk = leaf.shape[0] // (schedule.stages * schedule.repeats)
    return leaf.reshape(schedule.repeats, schedule.stages, chunk, *leaf.shape[1:])


def _groups(run: PipelineRun, rows: int) -> tuple[int, Any]:
    """The batch's data-parallel groups: how many, and the mesh axes they are split over for
    ``spmd_axis_name`` (None: one group). ``rows`` must split into groups x microbatches."""
    batch = tuple(a for a in run.batch_axes if a in run.mesh.shape and run.mesh.shape[a] > 1)
    groups = math.prod(run.mesh.shape[a] for a in batch)
    microbatches = run.schedule.microbatches
    if rows % (groups * microbatches):
        raise UsageError(f"a batch of {rows} rows does not split into {groups} data-parallel groups x "
                         f"`microbatches={microbatches}`; use a batch size that is a multiple of "
                         f"{groups * microbatches}")
    return groups, (batch if len(batch) > 1 else batch[0]) if batch else None


def _chunked(run: PipelineRun, groups: int, spmd: Any, keypath: Any, variable: nnx.Variable) -> nnx.Variable:
    """One stacked parameter laid out for the loop: as compute wants it, cut into chunks over the
    stages, and copied once per data-parallel group."""
    # Laid out for compute once, before the loop: under FSDP each stage gathers its weights
    # here (and its gradients are reduce-scattered once, after the loop), not at every
    # iteration. Then cut into (repeats, stages, layers per chunk), stages over the axis (a
    # circular schedule regroups the layers here, once per step), and with data-parallel
    # groups copied once per group, each copy on its group's devices (no data moves): the
    # gradient of each copy accumulates locally through the iterations, and the copy's
    # transpose sums them once, after the loop.
    mesh, axis = run.mesh, run.axis
    value = variable[...]
    specs = run.specs_of(path_to_str(keypath))
    rest: tuple[Any, ...] = ()
    if specs is not None:
        storage, compute, gradient = specs
        rest = tuple(compute)[1:]
        if compute != storage or gradient != storage:
            value = gather_for_compute(value, NamedSharding(mesh, compute), NamedSharding(mesh, gradient))
    value = _stage_major(value, run.schedule)
    value = jax.lax.with_sharding_constraint(
        value, NamedSharding(mesh, PartitionSpec(None, axis, None, *rest)))
    if spmd is not None:
        value = jnp.broadcast_to(value, (groups, *value.shape))
        value = jax.lax.with_sharding_constraint(
            value, NamedSharding(mesh, PartitionSpec(spmd, None, axis, None, *rest)))
    return variable.replace(value)


StageFunction = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]  # (chunk, x, riders) -> (x, recorded)


def run_pipeline(apply_layers: StageFunction, layers: Any, x: jax.Array, riders: Any = None, *,
                 run: PipelineRun, remat: Any = None) -> tuple[jax.Array, Any]:
    """``apply_layers(layers, x, riders)`` computed as the pipeline ``run`` (see the module docstring).

    ``layers`` is a pytree whose leaves have the stacked-layers dimension first; ``x`` is the
    activations of the global batch, ``(B, ...)``; ``riders`` a pytree of other per-row inputs
    (leading dimension B: positions, masks) or None. ``apply_layers(chunk, x, riders)`` applies
    a chunk of the stack (the same pytree, fewer layers) to one microbatch and its riders and
    returns ``(x, recorded)``: the new activations and a pytree of what each layer of the chunk
    recorded about its rows (leading dimension: the chunk's layers; a mixture of experts' router
    statistics), means over the rows. Returns the activations and ``recorded`` for every layer
    (leading dimension L), the mean over the microbatches (and data-parallel groups): what one
    pass over the whole batch records, rows being equal in number in each microbatch.
    ``remat``: the JAX remat policy the layers run under (None: save everything). Under a
    circular schedule (``run.schedule.repeats > 1``) each stage iteration runs under one
    checkpoint with that policy, so ``apply_layers`` should add none of its own (nested, the
    outer one would keep what the inner one recomputes).

    The batch's data-parallel groups run the pipeline side by side (``jax.vmap`` over the
    groups, partitioned over the batch axes): each group accumulates its own gradients through
    the iterations, and they are summed across groups once, after the loop, instead of at
    every iteration."""
    layer_count = jax.tree.leaves(layers)[0].shape[0]
    run.schedule.check_layers(layer_count)
    rows = x.shape[0]
    groups, spmd = _groups(run, rows)
    chunks = jax.tree_util.tree_map_with_path(functools.partial(_chunked, run, groups, spmd), layers,
                                              is_leaf=lambda node: isinstance(node, nnx.Variable))
    pipeline = functools.partial(_pipeline, apply_layers, run.mesh, run.axis, run.schedule, remat)
    every_layer = lambda leaf: leaf.reshape(layer_count, *leaf.shape[3:])  # noqa: E731  (R, S, L/(R*S), ...)
    if spmd is None:
        out, recorded = pipeline(chunks, x, riders)
        return out, jax.tree.map(every_layer, recorded)
    grouped = lambda leaf: leaf.reshape(groups, rows // groups, *leaf.shape[1:])  # noqa: E731
    pipeline = jax.vmap(pipeline, in_axes=(0, 0, 0), spmd_axis_name=spmd)
    out, recorded = pipeline(chunks, grouped(x), jax.tree.map(grouped, riders))
    return out.reshape(x.shape), jax.tree.map(lambda leaf: every_layer(leaf.mean(0)), recorded)


def _constrain(mesh: Mesh, value: jax.Array, *leading: Any) -> jax.Array:
    """``value`` with its leading dimensions laid out over the mesh axes ``leading``, the others whole."""
    rest = (None,) * (value.ndim - len(leading))
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, PartitionSpec(*leading, *rest)))


def _roll_and_file(mesh: Mesh, axis: str, count: int, buffer: jax.Array, store: jax.Array,
                   finished: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Roll the buffer one stage on; file what reached stage 0 (pass ``finished``) in the store."""
    rolled = _constrain(mesh, jnp.roll(buffer, 1, axis=0), axis, None)
    filed = store.at[:, finished % count].set(rolled)
    return rolled, jnp.where(finished >= 0, filed, store)


def _stage_function(apply_layers: StageFunction, rider_micro: Any, repeats: int,
                    remat: Any) -> Callable[..., tuple[jax.Array, Any]]:
    """One stage's work in an iteration: its chunk of layers on its slot, with its microbatch's riders."""
    def stage(chunks_of_stage: Any, repeat: jax.Array, which: jax.Array, slot: jax.Array) -> Any:
        if repeats == 1:  # the stage's one chunk: a constant of the loop, never saved per iteration
            chunk = jax.tree.map(lambda leaf: leaf[0], chunks_of_stage)
        else:  # this pass's chunk, picked anew in the backward pass rather than saved per iteration
            chunk = jax.tree.map(lambda leaf: _pick(leaf, repeat), chunks_of_stage)
        own = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, which, 0, keepdims=False),
                           rider_micro)
        return apply_layers(chunk, slot, own)  # its weights laid out already, once, before the loop

    if repeats > 1:  # one checkpoint per stage iteration, with the layers' remat policy (see _stage_policy)
        stage = jax.checkpoint(stage, policy=_stage_policy(remat))
    return stage


def _recorded(total: Any, new: Any, repeat: jax.Array, valid: jax.Array, repeats: int) -> Any:
    """``total`` (R, S, ...) plus what each stage recorded this iteration (``new``, (S, ...)) at its
    repeat, where the stage had a microbatch (the bubble's slots are not rows of the batch)."""
    taken = (jnp.arange(repeats)[:, None] == repeat[None, :]) & valid[None, :]  # (R, S)
    def add(whole: jax.Array, now: jax.Array) -> jax.Array:
        return whole + jnp.where(taken.reshape(*taken.shape, *(1,) * (now.ndim - 1)), now[None], 0)

    return jax.tree.map(add, total, new)


def _pipeline(apply_layers: StageFunction, mesh: Mesh, axis: str, schedule: Schedule, remat: Any, chunks: Any,
              x: jax.Array, riders: Any) -> tuple[jax.Array, Any]:
    """The pipeline of one data-parallel group's rows ``x`` (see ``run_pipeline``).

    Each iteration the buffer (one slot per stage) rolls by one stage, a collective-permute:
    stage s receives stage s-1's output, and stage 0 the last stage's, which it files in its
    ``store`` (one row per microbatch, where the microbatches wait at the start). Stage 0 then
    takes its next microbatch from the store: a new one, or under a circular schedule the
    filed output of one coming round again. After the last iteration the store holds the
    outputs; its microbatches are handed out over the stages, so what follows the layers (the
    head, the loss) works on rows split over the stages too. What the layers record is summed
    per chunk (R, S, ...) over the microbatches, and returned as their mean."""
    stages, count, repeats = schedule.stages, schedule.microbatches, schedule.repeats
    constrain = functools.partial(_constrain, mesh)
    roll_and_file = functools.partial(_roll_and_file, mesh, axis, count)
    # microbatch m takes rows m*b .. (m+1)*b - 1 of the group (all on the group's devices)
    split = lambda leaf: leaf.reshape(count, x.shape[0] // count, *leaf.shape[1:])  # noqa: E731
    micro = split(x)
    stage = _stage_function(apply_layers, jax.tree.map(split, riders), repeats, remat)
    # (R, S, ...) -> vmap over S (axis 1); each stage picks its repeat's chunk and its microbatch's riders
    stages_apply = vmap_stages(stage, in_axes=(1, 0, 0, 0), spmd_axis_name=axis)
    index = jnp.arange(stages)
    per_stage = lambda flags: flags.reshape(-1, *(1,) * x.ndim)  # noqa: E731

    def iteration(carry: tuple[jax.Array, jax.Array, Any], step: jax.Array) -> tuple[tuple[Any, ...], None]:
        buffer, store, recorded = carry
        rolled, store = roll_and_file(buffer, store, step - stages)
        # stage 0 takes its next microbatch from its store: a new one, or one coming round again
        inputs = jnp.where(per_stage(index == 0), store[:, step % count], rolled)
        working = step - index  # which pass over the microbatches each stage is on
        valid = (working >= 0) & (working < repeats * count)
        inputs = constrain(jnp.where(per_stage(valid), inputs, 0), axis, None)
        repeat = jnp.clip(working // count, 0, repeats - 1)
        buffer, now = stages_apply(chunks, repeat, working % count, inputs)
        recorded = _recorded(recorded, now, repeat, valid, repeats)
        return (constrain(buffer, axis, None), constrain(store, axis, None, None), recorded), None

    buffer = constrain(jnp.zeros((stages, *micro.shape[1:]), x.dtype), axis, None)
    # the microbatches start in stage 0's store (moved there once; their gradients come back once)
    store = jnp.zeros((stages, *micro.shape), x.dtype).at[0].set(micro)
    store = constrain(store, axis, None, None)
    shapes = jax.eval_shape(stages_apply, chunks, index * 0, index * 0, buffer)[1]
    recorded = jax.tree.map(lambda leaf: jnp.zeros((repeats, *leaf.shape), leaf.dtype), shapes)
    (buffer, store, recorded), _ = jax.lax.scan(iteration, (buffer, store, recorded),
                                                jnp.arange(schedule.iterations))
    _, store = roll_and_file(buffer, store, jnp.asarray(schedule.iterations - stages))
    outputs = store[0]  # (M, b, ...) on stage 0: hand the microbatches out over the stages
    if count % stages == 0:
        outputs = constrain(outputs, axis, None)
    return outputs.reshape(x.shape), jax.tree.map(lambda total: total / count, recorded)
