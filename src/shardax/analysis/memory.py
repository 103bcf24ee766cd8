"""What a strategy should keep on each device, from shapes and specs alone (no compile).

The state is exact (each leaf's shard; for a TPU target in XLA:TPU's tiles, ``tiled_bytes``);
the activations are autodiff's residuals under the remat policy plus a working set with factors
fitted to XLA:CPU's compiled peaks (``benchmarks/plan_fit.py``; see ``WORKING_SET``), or for a
TPU target the residuals as XLA:TPU keeps them and factors fitted to its peaks
(``WORKING_SET_TPU``); pipelines and context parallelism on top.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from shardax.analysis.residuals import STAND_IN, traced_residuals
from shardax.analysis.tiles import kept_bytes, round_up, stored_bytes, tiled_bytes
from shardax.errors import UsageError
from shardax.model_state import trained_part
from shardax.sharding.layout import Layout
from shardax.sharding.paths import path_to_str
from shardax.sharding.place import spec_axes
from shardax.vocabulary import LAYERS


def size_of_axes(mesh_shape: dict[str, int], axes: Any) -> int:
    return math.prod(mesh_shape.get(axis, 1) for axis in axes)


def _leaf_bytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def bytes_per_group(leaf, mesh_shape: dict[str, int], strategy: Any) -> float:
    """A leaf's bytes on each device of a data-parallel group: split over every axis of its
    spec but the ones the strategy gathers over for compute."""
    kept = [a for e in leaf.spec for a in spec_axes(e) if a not in strategy.gather_axes]
    return _leaf_bytes(leaf) / size_of_axes(mesh_shape, kept)


def split_into_stages(leaf, strategy: Any) -> bool:
    return strategy.pipeline_axis is not None and any(
        a == strategy.pipeline_axis for e in leaf.spec for a in spec_axes(e))


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


# The platforms a plan is compiled for, as ``compiler`` arguments name them.
COMPILERS = ("cpu", "tpu", "cuda")


def check_compiler(compiler: str) -> None:
    if compiler not in COMPILERS:
        raise UsageError(f"compiler={compiler!r}; use one of {', '.join(COMPILERS)} "
                         f"(the platform the step is compiled for)")


def _per_device(layout: Layout, attribute: str, tiled: bool = False, only: set[str] | None = None) -> int:
    """Bytes per device of the leaves (those in ``only``, if given) laid out by ``attribute``."""
    shape = dict(layout.mesh.shape)
    total = 0
    for path, leaf in layout.leaves.items():
        if only is not None and path not in only:
            continue
        splits = [size_of_axes(shape, spec_axes(entry)) for entry in getattr(leaf, attribute)]
        splits += [1] * (len(leaf.shape) - len(splits))
        itemsize = np.dtype(leaf.dtype).itemsize
        if tiled:  # each device's block, rounded up where a dimension does not split evenly
            total += tiled_bytes(tuple(round_up(size, split) // split
                                       for size, split in zip(leaf.shape, splits)),
                                 itemsize)
        else:
            total += math.prod(leaf.shape) * itemsize // math.prod(splits)
    return total


def batch_rows_per_device(layout: Layout, batch_size: int) -> int:
    split = size_of_axes(dict(layout.mesh.shape),
                       [a for a in layout.strategy.batch_axes if a in layout.mesh.shape])
    return max(batch_size // split, 1)


def model_split_dims(layout: Layout) -> dict[str, int]:
    """How many ways the parameters split heads, MLP width and vocabulary over axes other than
    the batch axes (tensor parallelism); 1 where any parameter keeps that dimension whole."""
    shape = dict(layout.mesh.shape)
    batch_axes = set(layout.strategy.batch_axes)
    split = {"heads": 0, "mlp": 0, "vocab": 0}
    for leaf in layout.leaves.values():
        for name, entry in zip(leaf.logical or (), leaf.spec):
            if name in split:
                ways = size_of_axes(shape, [axis for axis in spec_axes(entry) if axis not in batch_axes])
                split[name] = ways if split[name] == 0 else min(split[name], ways)
    return {name: ways or 1 for name, ways in split.items()}


def _actual_sizes(model: Any, rows: int, split: dict[str, int]) -> dict[int, int]:
    """Each stand-in size -> its size on one device."""
    size = STAND_IN
    return {size["rows"]: rows, size["seq"]: model.seq_len, size["heads"] * size["head"]: model.d_model,
            size["heads"]: max(model.n_heads // split["heads"], 1), size["head"]: model.head_dim,
            size["head"] // 2: model.head_dim // 2, size["mlp"]: max(model.d_ff // split["mlp"], 1),
            size["vocab"]: max(model.vocab_size // split["vocab"], 1), size[LAYERS]: model.n_layers}


def _looped_residual_bytes(model: Any, rows: int, split: dict[str, int]) -> int:
    """What autodiff keeps for blocks in a Python loop without remat, per device: traced with one
    and with two blocks, each further block keeping what the second added."""
    model = dataclasses.replace(model, scan_layers=False, remat="none")
    actual = _actual_sizes(model, rows, split)
    one, two = (sum(math.prod(actual.get(dim, dim) for dim in kept.dims) * kept.itemsize
                    for kept in traced_residuals(model, layers) if not kept.parameter)
                for layers in (1, 2))
    return one + (model.n_layers - 1) * (two - one)


def residual_bytes(layout: Layout, model: Any, rows: int) -> tuple[int, int]:
    """(all residuals, one layer's residuals without remat) per device, for ``rows`` rows."""
    return _residual_bytes(model, rows, model_split_dims(layout))[:2]


def _weight_copy_bytes(layout: Layout, model: Any, compiler: str) -> int:
    """The bfloat16 copies of the stacked layer weights among what XLA:TPU keeps (none elsewhere)."""
    model = dataclasses.replace(model, scan_layers=True)
    actual, shards = _actual_sizes(model, 1, model_split_dims(layout)), size_of_axes(
        dict(layout.mesh.shape), layout.strategy.gather_axes)
    return sum(kept_bytes(kept, tuple(actual.get(dim, dim) for dim in kept.dims), compiler, shards)
               for kept in traced_residuals(model) if kept.parameter)


def _residual_bytes(model: Any, rows: int, split: dict[str, int], compiler: str = "cpu",
                    shards: int = 1) -> tuple[int, int, int]:
    """(all residuals, one layer's residuals without remat, the part of those that are the
    sequence x sequence attention scores) per device, for ``rows`` rows, as ``compiler`` keeps them
    (``shards``: how many ways FSDP splits the weights)."""
    # Traced with scanned layers whatever the model uses: a loop of blocks keeps the same
    # residuals per layer, and stacking shows which of them belong to a layer.
    model = dataclasses.replace(model, scan_layers=True)
    actual = _actual_sizes(model, rows, split)

    def total(residuals: Any) -> tuple[int, int, int]:
        every = per_layer = scores = 0
        for kept in residuals:
            nbytes = kept_bytes(kept, tuple(actual.get(dim, dim) for dim in kept.dims), compiler, shards)
            every += nbytes
            if kept.dims and kept.dims[0] == STAND_IN[LAYERS] and not kept.parameter:
                per_layer += nbytes // model.n_layers
                if kept.dims.count(STAND_IN["seq"]) >= 2:
                    scores += nbytes // model.n_layers
        return every, per_layer, scores

    every, _, _ = total(traced_residuals(model))
    _, layer, scores = total(traced_residuals(dataclasses.replace(model, remat="none")))
    return every, layer, scores


# The backward pass of one scanned layer needs more than what was saved for it: cotangents,
# values recomputed under remat, the layer's full weight gradient and, under FSDP, its
# gathered weights. The working set is taken to be linear in, in order: one layer's residuals
# without remat other than the attention scores, the scores (sequence x sequence per head:
# their softmax gradient needs more, and grows with the square of the sequence), what tensor
# parallelism leaves of a layer's residuals unsplit (the all-reduced activations exist whole on
# every device while a layer is recomputed and differentiated), one layer's weights, and one
# layer's weights again when the strategy gathers them. Blocks in a Python loop keep every
# layer's activations live whatever the remat policy (XLA:CPU schedules the recomputation
# early), and a gathering strategy gathers every layer's weights up front: their activations
# are taken to be linear in all the residuals autodiff names (XLA fuses some of them away) and
# in every layer's gathered weights. That model is rough (see docs/plan.md). XLA:TPU holds more of
# a loop's activations where the strategy gathers weights or reduce-scatters gradients layer by
# layer (zero2, fsdp, hsdp, fsdp_tp: 1.26-1.79x dp's working set on `small`), a third term there:
# the residuals again for those strategies (0 for XLA:CPU, whose fit predates it).
WORKING_SET_TERMS = {"none": ("layer", "scores", "unsplit", "weights", "gathered"),
                     "looped": ("residuals", "gathered_layers", "sharded_residuals"),
                     "looped_remat": ("residuals", "gathered_layers")}
WORKING_SET_TERMS["full"] = WORKING_SET_TERMS["dots"] = WORKING_SET_TERMS["none"]
# Fitted by benchmarks/plan_fit.py (minimax relative error against XLA:CPU's compiled peak) over
# compiled steps of every preset from tiny to 1b, sequences of 512 and 1024, a 1024-wide model,
# under every strategy, with microbatches and a 2x4 tensor mesh, and the shapes tests/test_plan.py
# checks. The shapes of benchmarks/suite.py HELD_OUT_SHAPES (and held_out_large_rows) were never
# fitted on: docs/plan.md reports the error there. "full" comes from the refit that added steps
# with many rows per device (one device holding the whole batch); it was better on both held-out
# sets (worst 11.0% -> 7.6% and 14.2% -> 7.5%). For the other classes that refit was no better
# on them, and their earlier factors stay.
WORKING_SET = {"none": (0.473, 0.728, 0.299, 1.441, 0.25), "full": (1.615, 1.35, 0.0, 0.897, 0.0),
               "dots": (0.637, 1.683, 0.0, 1.117, 0.547), "looped": (0.971, 0.809, 0.0)}
# For a TPU target: the residuals as XLA:TPU keeps them (``tiles.kept_bytes``) and factors fitted by
# ``benchmarks/plan_fit.py --target tpu-v5p-16 --heap`` to XLA:TPU's heap-based peak
# (``plan.device_bytes``: what XLA:TPU allocates and checks against the chip, 0.75-0.94 of its
# memory analysis) on the steps above its floor of 300 MB per chip (below it XLA:TPU holds a
# varying part of the temporaries in the chip's own memory), 2048-wide layers among them.
# XLA:TPU recomputes under remat in a Python loop too, so looped blocks under remat are a class
# of their own there. Each chip holds some temporaries in its own memory, not HBM
# (``held_on_chip``; 48 MB on v5p), subtracted before fitting. Worst error on the steps
# fitted: 3%, 3%, 15%, 7% and 41% (none, dots, full, looped, looped_remat). On the held-out steps
# of XLA:CPU's shapes and of two sets fixed for XLA:TPU (suite.HELD_OUT_TPU_SHAPES, _2), 102 of
# 150 within 5%: scanned without remat 41 of 44, dots 34 of 37, full 19 of 36 (worst 24%: XLA:TPU
# packs the same buffers differently per strategy), looped 7 of 19, looped under remat 1 of 14.
WORKING_SET_TPU = {"none": (1.067, 1.207, 0.103, 0.926, 0.0), "full": (1.119, 1.624, 0.0, 0.075, 1.422),
                   "dots": (1.084, 1.752, 0.092, 0.943, 0.0), "looped": (0.531, 2.31, 0.147),
                   "looped_remat": (0.188, 2.019)}


def working_set_class(model: Any, compiler: str = "cpu") -> str:
    """Which fitted factors a model uses: ``looped`` (blocks in a Python loop; on XLA:TPU, which
    recomputes in a loop too, ``looped_remat`` under a remat policy), else by remat policy
    ``none``, ``full`` or ``dots`` (both dots policies)."""
    if not model.scan_layers:
        return "looped_remat" if compiler == "tpu" and model.remat != "none" else "looped"
    return model.remat if model.remat in ("none", "full") else "dots"


def working_set_terms(layout: Layout, model: Any, batch_size: int, grad_accum: int = 1,
                      compiler: str = "cpu") -> dict[str, int]:
    """Bytes per device of a ``TransformerLM``'s step: ``kept`` (the residuals autodiff keeps
    under the remat policy, exact, counted whole) and the terms of its class (see
    ``WORKING_SET_TERMS``): with scanned layers, one layer's residuals without remat other than
    the attention scores, the scores, what tensor parallelism leaves unsplit, one layer's weights,
    and those weights again when the strategy gathers them; with blocks in a loop, every layer's
    residuals, with a gathering strategy every layer's weights, and the residuals again where the
    strategy gathers weights or shards gradients."""
    rows = max(batch_rows_per_device(layout, batch_size) // grad_accum, 1)
    split = model_split_dims(layout)
    d, f = model.d_model, model.d_ff
    mlp = 3 if model.mlp == "swiglu" else 2  # gate, up and down; or in and out
    weights = (4 * d * d // split["heads"] + mlp * d * f // split["mlp"]) * 4
    gathers = bool(layout.strategy.gather_axes)
    if not model.scan_layers:
        residuals, layerwise = (_looped_residual_bytes(model, rows, split),
                                gathers or layout.strategy.shard_gradients)
        return {"kept": 0, "residuals": residuals,
                "gathered_layers": model.n_layers * weights if gathers else 0,
                "sharded_residuals": residuals if layerwise else 0}
    shards = size_of_axes(dict(layout.mesh.shape), layout.strategy.gather_axes)
    kept, layer, scores = _residual_bytes(model, rows, split, compiler, shards)
    unsplit = (_residual_bytes(model, rows, dict.fromkeys(split, 1), compiler)[1] - layer
               if max(split.values()) > 1 else 0)
    return {"kept": kept, "layer": layer - scores, "scores": scores, "unsplit": unsplit, "weights": weights,
            "gathered": weights if gathers else 0}


def working_set_factors(kind: str, compiler: str = "cpu") -> tuple[float, ...]:
    """The fitted factors of a class of model for ``compiler`` (XLA:TPU's where they were fitted)."""
    return WORKING_SET_TPU[kind] if compiler == "tpu" and kind in WORKING_SET_TPU else WORKING_SET[kind]


def activation_bytes(layout: Layout, model: Any, batch_size: int, grad_accum: int = 1,
                     compiler: str = "cpu") -> int:
    """Activation memory of ``TransformerLM`` per device: the residuals autodiff keeps under the
    model's remat policy, plus the working set of one layer's backward pass (see above)."""
    if model is None:
        return 0
    terms, kind = (working_set_terms(layout, model, batch_size, grad_accum, compiler),
                   working_set_class(model, compiler))
    factors = working_set_factors(kind, compiler)
    return int(terms["kept"]
               + sum(factor * terms[name] for name, factor in zip(WORKING_SET_TERMS[kind], factors)))


def pipeline_activation_bytes(layout: Layout, model: Any, batch_size: int, schedule: Any,
                              compiler: str = "cpu") -> int:
    """Activation memory per device of ``TransformerLM`` run as a pipeline (``schedule``).

    Every iteration keeps, for the backward pass, what its stage's chunk of L/(R*S) layers keeps
    for one microbatch: as a model of (R*M + S - 1) * L/(R*S) layers on a microbatch's rows
    would. Besides: stage 0's store (every microbatch of the group at the stage boundary) and
    the rolling buffer, and the stage's weights as the loop uses them: their gradient summed
    through the iterations, and, where the loop runs on a copy (one per data-parallel group,
    or FSDP's gathered weights), the copy. And, when a chunk has several layers, one iteration's
    residuals again: the scan over the chunk stacks them inside the loop over iterations, and
    they are copied into (and, for the backward pass, out of) the loop's stack, as XLA:CPU and
    XLA:TPU both compile it. XLA:TPU's loop reads the stage's float32 weights (no bfloat16 copies
    among the residuals); under FSDP it reduces the summed gradient into a float32 buffer as large
    and gathers the weights in bfloat16: 2.5 times the stage's weights, else once (the sum)."""
    shape, strategy = dict(layout.mesh.shape), layout.strategy
    groups = size_of_axes(shape, strategy.batch_axes)
    rows = batch_rows_per_device(layout, batch_size) // schedule.microbatches
    chunk = model.n_layers // (schedule.stages * schedule.repeats)
    virtual = dataclasses.replace(model, n_layers=schedule.iterations * chunk)
    boundary = rows * model.seq_len * model.d_model * 4  # one microbatch's activations between stages
    stage_weights = sum(bytes_per_group(leaf, shape, strategy) for leaf in layout.leaves.values()
                        if split_into_stages(leaf, strategy))
    copies = (2.5 if strategy.gather_axes else 1) if compiler == "tpu" else 1 + (1 if groups > 1 else 0)
    weight_copies = _weight_copy_bytes(layout, virtual, compiler) // virtual.n_layers  # a layer's
    kept = (activation_bytes(layout, virtual, rows * groups, compiler=compiler)
            - weight_copies * virtual.n_layers)
    # a chunk of one layer is no scan: its residuals go straight into the loop's stack
    one_fewer = activation_bytes(layout, dataclasses.replace(virtual, n_layers=virtual.n_layers - chunk),
                                 rows * groups, compiler=compiler) \
        - weight_copies * (virtual.n_layers - chunk) if chunk > 1 else kept
    return int(kept + (kept - one_fewer) + (schedule.microbatches + 2) * boundary + copies * stage_weights)


def _sharded_bytes(abstract: Any, shardings: Any, tiled: bool = False) -> int:
    """Bytes per device of a tree laid out by ``shardings`` (shapes and specs only, no compile);
    ``tiled``: in XLA:TPU's tiles (``tiled_bytes``)."""
    sizes = jax.tree.map(lambda leaf, sharding: stored_bytes(sharding.shard_shape(leaf.shape),
                                                              np.dtype(leaf.dtype).itemsize, tiled),
                         abstract, shardings)
    return int(sum(jax.tree.leaves(sizes)))


def context_activation_bytes(layout: Layout, model: Any, batch_size: int, grad_accum: int = 1,
                             variant: str = "all-gather", compiler: str = "cpu") -> int:
    """``activation_bytes`` with the sequence split over a ``context`` axis of C: each device keeps
    1/C of every activation (under ``all-gather`` its scores are its share of the queries against
    the whole sequence); ``ring`` keeps no scores at all (its backward pass recomputes them)."""
    shards = dict(layout.mesh.shape).get("context", 1)
    if shards == 1 or model is None:
        return activation_bytes(layout, model, batch_size, grad_accum, compiler)
    if variant == "ring":
        terms, kind = (working_set_terms(layout, model, batch_size, grad_accum, compiler),
                       working_set_class(model, compiler))
        if "scores" in terms:  # scanned layers (blocks in a loop keep no separate scores term)
            saved_scores = model.n_layers * terms["scores"] if model.remat != "full" else 0
            terms = terms | {"kept": terms["kept"] - saved_scores, "scores": 0}
        whole = terms["kept"] + sum(f * terms[name] for name, f in zip(WORKING_SET_TERMS[kind],
                                                                       working_set_factors(kind, compiler)))
        return int(whole) // shards
    return activation_bytes(layout, model, batch_size, grad_accum, compiler) // shards


def replica_count(layout: Layout) -> int:
    """How many copies of the state the batch axes that do not gather hold (1 for FSDP)."""
    shape, kept = dict(layout.mesh.shape), set(layout.strategy.batch_axes) - set(layout.strategy.gather_axes)
    return size_of_axes(shape, [a for a in layout.strategy.batch_axes if a in shape and a in kept])


def held_on_chip(on_chip: int, temporaries: int) -> int:
    """What of a step's ``temporaries`` XLA:TPU keeps in the chip's own memory, not HBM: a fifth of
    them, up to the ``on_chip`` bytes the chip gives them (memory space 1 of its buffer assignments
    on v5p: 12 of 62 MB for `tiny` at batch 64, 44 of 193 MB for `small` at 16, 47-50 MB from
    about 250 MB up)."""
    return min(on_chip, temporaries // 5)


def _trained_paths(parallel: Any) -> set[str] | None:
    """The paths of the parameters the optimizer updates (None: every one)."""
    if getattr(parallel, "trainable", None) is None:
        return None
    trained = trained_part(parallel.abstract_state.params, parallel.trainable)
    return {path_to_str(keypath) for keypath, _ in jax.tree_util.tree_flatten_with_path(trained)[0]}


def predict_memory(parallel: Any, model: Any, batch_size: int, seq_len: int, grad_accum: int = 1,
                   schedule: Any = None, context_attention: str = "all-gather",
                   compiler: str = "cpu", on_chip: int = 0) -> MemoryPrediction:
    """Bytes per device of a ``ParallelModel``'s step, from its shapes and shardings (and its
    pipeline ``schedule``, if it runs one); for ``compiler="tpu"``, the state and gradients in
    XLA:TPU's tiles, and outside a pipeline the activations less what of the temporaries the chip
    keeps in its own memory (``held_on_chip``, up to ``on_chip``: ``Chip.on_chip_bytes``), not HBM."""
    check_compiler(compiler)
    layout, abstract, shardings = parallel.layout, parallel.abstract_state, parallel.state_shardings
    tiled = compiler == "tpu"
    # With blocks in a loop, XLA:CPU keeps ZeRO-2's gradients whole, as data parallelism does.
    looped = model is not None and not model.scan_layers
    gradient_spec = "optimizer_spec" if layout.strategy.shard_gradients and not looped else "spec"
    # gradients of the trained parameters only (LoRA: the adapters; a frozen weight has none)
    gradients, replicas = (_per_device(layout, gradient_spec, tiled, _trained_paths(parallel)),
                           replica_count(layout))
    # HSDP reduce-scatters the gradients over every device, then all-gathers them over the
    # replicas into their FSDP shards: the smaller piece is kept besides. With accumulation
    # XLA:CPU keeps it for some shapes and not others (medium yes, small no): half is counted.
    scattered = 0
    if replicas > 1 and layout.strategy.gather_axes:
        scattered = gradients // replicas // (2 if grad_accum > 1 else 1)
    # accumulation: the sum and one microbatch's
    gradients = gradients * (2 if grad_accum > 1 else 1) + scattered
    if schedule is not None:
        activations = pipeline_activation_bytes(layout, model, batch_size, schedule, compiler)
    else:
        activations = context_activation_bytes(layout, model, batch_size, grad_accum, context_attention,
                                               compiler)
        activations -= held_on_chip(on_chip, gradients + activations)
    return MemoryPrediction(
        params=_sharded_bytes(abstract.params, shardings.params, tiled), gradients=gradients,
        optimizer=_sharded_bytes((abstract.opt_state, abstract.step, abstract.skipped),
                                 (shardings.opt_state, shardings.step, shardings.skipped), tiled),
        batch=stored_bytes((batch_rows_per_device(layout, batch_size), seq_len + 1), 4, tiled),
        activations=activations)
