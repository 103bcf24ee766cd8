"""``shardax plan``: compile the train step for a target mesh ahead of time and read what it costs.

Nothing runs and no accelerator is needed: the step is lowered and compiled from abstract
shapes, for fake CPU devices or, with a ``target`` (see :mod:`shardax.analysis.targets`), by
XLA:TPU for a TPU slice's devices. XLA's ``memory_analysis()`` and the collectives in the
compiled HLO are set beside shardax's own prediction from shapes and specs; for a target, its
cost analysis gives FLOPs and HBM bytes, and the chip's peaks a roofline step time.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import optax

from shardax.analysis.collectives import find_collectives, summarize
from shardax.analysis.heap import compile_with_heap, hbm_heap, on_chip_heap
from shardax.analysis.lint import lint
from shardax.analysis.memory import predict_memory
from shardax.analysis.plan_notes import model_notes
from shardax.analysis.targets import Target, roofline
from shardax.analysis.theory import theoretical_collective_bytes
from shardax.analysis.traffic import wire_bytes
from shardax.errors import UsageError
from shardax.mesh import describe_mesh, parse_mesh_shape
from shardax.model_parallel import ParallelModel
from shardax.models.presets import blocks_in_a_loop, flops_per_token
from shardax.models.transformer import TransformerConfig, TransformerLM, weighted_next_token_loss
from shardax.sharding.report import format_bytes
from shardax.sharding.strategies import STRATEGIES, get_strategy
from shardax.step.settings import StepSettings

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GB"``, ``"16GiB"``, ``"512MB"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise UsageError(f"`device_memory={text!r}` is not a size; write it like 80GB, 16GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclasses.dataclass
class StrategyPlan:
    strategy: str
    mesh: str
    predicted: dict[str, int]  # params, gradients, optimizer, batch, activations, state, total
    compiled: dict[str, int]  # arguments, outputs, temporaries, aliased, peak (XLA:TPU: hbm_heap, hbm_peak)
    collectives: dict[str, dict[str, float]]  # kind -> count, bytes, wire_bytes (per step, per device)
    collective_bytes: float  # what the compiled step sends per device per step
    theoretical_collective_bytes: float
    fits: bool | None
    lint: list[str]
    compile_s: float
    bubble: float | None = None  # pipeline strategies: the fraction of idle stage iterations
    target: str | None = None  # the accelerator compiled for (None: fake CPU devices)
    # a target's: flops, hbm_bytes, model_flops per device per step
    cost: dict[str, float | None] | None = None
    roofline: dict[str, Any] | None = None  # a target's: compute_s, memory_s, network_s, step_s, bound, mfu
    scan_layers: bool = True  # the model's blocks scanned, or in a Python loop

    @property
    def predicted_bytes_per_device(self) -> int:
        return self.predicted["total"]

    @property
    def compiled_bytes_per_device(self) -> int:
        return device_bytes(self.compiled)

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["predicted_bytes_per_device"] = self.predicted_bytes_per_device
        record["compiled_bytes_per_device"] = self.compiled_bytes_per_device
        return record


def compile_step(parallel, batch_size: int, seq_len: int, grad_accum: int = 1,
                 compiler_options: dict[str, Any] | None = None, **pipeline: Any):
    """The next-token train step of ``parallel`` compiled ahead of time for one batch shape
    (``pipeline``: ``microbatches`` and ``pipeline_repeats`` under a pipeline strategy;
    ``compiler_options``: XLA flags for this compile)."""
    batch = {"tokens": jax.ShapeDtypeStruct((batch_size, seq_len + 1), jax.numpy.int32,
                                            sharding=parallel.layout.batch())}
    step = parallel.with_settings(grad_accum=grad_accum, **pipeline).train_step(weighted_next_token_loss)
    return compile_with_heap(step.lower(parallel.abstract_state, batch), compiler_options)


# XLA:TPU turns a matmul whose result is reduce-scattered, or whose operand is all-gathered,
# into a loop of partial matmuls and collective-permutes ("windowed einsum", a collective
# matmul: seen on v5e slices under fsdp_tp), and its cost analysis counts a loop's body once.
# FLOPs are counted on the same step compiled without them: the same matmuls, unsplit.
WHOLE_MATMULS = {"xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
                 "xla_tpu_enable_windowed_einsum_for_all_gather": False}


def out_of_memory(error: Exception) -> bool:
    """XLA refused to compile because the step needs more memory than the device has (XLA:TPU
    checks its HBM at compile time)."""
    return "RESOURCE_EXHAUSTED" in str(error) and "memory" in str(error).lower()


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's ``memory_analysis()`` of a compiled step per device, with its peak: arguments,
    temporaries and outputs, less the outputs that reuse (alias) donated arguments. Compiled by
    XLA:TPU, also its buffer assignment's heap (``hbm_heap``) and the peak with the heap in place
    of the estimated temporaries (``hbm_peak``): what XLA:TPU holds the chip to (see
    :mod:`shardax.analysis.heap`), and the temporaries it keeps in the chip's own memory (``on_chip``)."""
    memory = compiled.memory_analysis()
    measured = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes}
    measured["peak"] = (measured["arguments"] + measured["temporaries"]
                        + measured["outputs"] - measured["aliased"])
    heap = hbm_heap(compiled)
    if heap is not None:
        measured["hbm_heap"] = heap
        measured["hbm_peak"] = measured["peak"] - measured["temporaries"] + heap
        measured["on_chip"] = on_chip_heap(compiled)
    return measured


def device_bytes(measured: dict[str, int]) -> int:
    """What one device needs of ``compiled_memory``'s figures: XLA:TPU's heap-based peak where
    known, else the memory analysis's peak."""
    return measured.get("hbm_peak", measured["peak"])


def transformer_for(model: TransformerConfig, strategy: Any, mesh_shape: str | None = None, tx: Any = None,
                    target: Target | None = None):
    """``TransformerLM(model)`` parallelized by ``strategy`` (a name or a ``Strategy``) over
    ``mesh_shape`` (default: the strategy's own) of fake CPU devices or a ``target``'s devices,
    built abstractly: what ``shardax plan`` compiles."""
    settings = StepSettings.resolve(strategy, mesh_shape,
                                    devices=target.devices() if target is not None else None)
    return ParallelModel.create(lambda rngs: TransformerLM(model, rngs=rngs), tx or optax.adamw(1e-3),
                                settings)


def plan_strategy(model: TransformerConfig, strategy: str, mesh_shape: str | None, *, batch_size: int,
                  grad_accum: int = 1, device_memory: int | None = None,
                  tx: optax.GradientTransformation | None = None, microbatches: int | None = None,
                  pipeline_repeats: int = 1, context_attention: str = "all-gather",
                  target: Target | None = None) -> StrategyPlan:
    """Compile one strategy's step and measure it (see the module docstring).
    ``microbatches`` and ``pipeline_repeats``: the schedule of a pipeline strategy; ``context_attention``:
    how attention spans a sequence split over a ``context`` axis; ``target``: a TPU slice to compile for
    (default: fake CPU devices); its chip's HBM is then the default ``device_memory``."""
    parallel = transformer_for(model, strategy, mesh_shape, tx, target)
    resolved, mesh = parallel.strategy, parallel.mesh  # a pipeline's schedule: for pipeline strategies only
    pipeline = ({"microbatches": microbatches, "pipeline_repeats": pipeline_repeats} if resolved.pipeline_axis
                else {})
    schedule = parallel.with_settings(**pipeline).schedule()
    context = (parallel.with_settings(context_attention=context_attention).context_attention()
               if "context" in mesh.shape else None)
    if context is not None:
        pipeline["context_attention"] = context
    started = time.perf_counter()
    compiled = compile_step(parallel, batch_size, model.seq_len, grad_accum, **pipeline)
    compile_s = time.perf_counter() - started
    measured = compiled_memory(compiled)
    whole = _whole_matmuls(compiled, parallel, batch_size, model.seq_len, grad_accum, pipeline, measured)
    compiler, on_chip = ("cpu", 0) if target is None else (target.chip.platform, target.chip.on_chip_bytes)
    prediction = predict_memory(parallel, model, batch_size, model.seq_len, grad_accum, schedule,
                                context or "all-gather", compiler=compiler, on_chip=on_chip)
    predicted = dataclasses.asdict(prediction) | {"state": prediction.state, "total": prediction.total}
    collectives = find_collectives(compiled.as_text())
    summary = {kind: {"count": entry["count"], "bytes": entry["bytes"], "wire_bytes": 0.0}
               for kind, entry in summarize(collectives).items()}
    for collective in collectives:
        summary[collective.kind]["wire_bytes"] += wire_bytes(collective,
                                                             mesh.devices.size) * collective.executions
    if target is not None and device_memory is None:
        device_memory = int(target.per_device()["hbm_bytes"])
    plan = StrategyPlan(
        strategy=resolved.name, mesh=describe_mesh(mesh), predicted=predicted, compiled=measured,
        scan_layers=model.scan_layers,
        collectives=summary, collective_bytes=sum(entry["wire_bytes"] for entry in summary.values()),
        theoretical_collective_bytes=theoretical_collective_bytes(
            parallel.layout, model, batch_size, schedule, context or "all-gather", compiler=compiler),
        fits=None if device_memory is None else device_bytes(measured) <= device_memory,
        lint=(lint(parallel, collectives) + model_notes(model, parallel, target, schedule)
              + _collective_matmul_note(measured, device_memory)),
        compile_s=compile_s, bubble=None if schedule is None else schedule.bubble,
        target=None if target is None else target.name)
    if target is not None:
        _add_costs(plan, target, model, resolved, mesh_shape, tx, batch_size, grad_accum, whole or compiled,
                   pipeline)
    return plan


def collective_matmuls(compiled: Any) -> bool:
    """Whether XLA:TPU made some of the step's matmuls collective matmuls (``WHOLE_MATMULS``)."""
    return "windowed_dot_general" in compiled.as_text()


def _whole_matmuls(compiled: Any, parallel: Any, batch_size: int, seq_len: int, grad_accum: int,
                   pipeline: dict[str, Any], measured: dict[str, int]) -> Any:
    """The same step compiled with whole matmuls where XLA:TPU made collective matmuls (its peak
    noted in ``measured``), else None."""
    if parallel.mesh.devices.flat[0].platform != "tpu" or not collective_matmuls(compiled):
        return None
    whole = compile_step(parallel, batch_size, seq_len, grad_accum, compiler_options=WHOLE_MATMULS,
                         **pipeline)
    measured["peak_without_collective_matmuls"] = device_bytes(compiled_memory(whole))
    return whole


# LIBTPU_INIT_ARGS that keep XLA:TPU from making collective matmuls (as WHOLE_MATMULS does for one compile)
WHOLE_MATMULS_FLAGS = " ".join(f"--{flag}=false" for flag in WHOLE_MATMULS)


def _collective_matmul_note(measured: dict[str, int], device_memory: int | None) -> list[str]:
    """Where XLA:TPU's collective matmuls hold 5% or more of the peak: how much, and how to go without."""
    whole = measured.get("peak_without_collective_matmuls")
    peak = device_bytes(measured)
    if whole is None or whole > 0.95 * peak:
        return []
    fits = device_memory is not None and whole <= device_memory < peak
    return ["collective matmuls: XLA:TPU overlaps some of the step's collectives with their matmuls "
            f"(windowed einsums), and they hold {format_bytes(peak - whole)} more per device here: "
            f"{format_bytes(peak)}, {format_bytes(whole)} without them"
            + (", which fits" if fits else "") + f"; to go without them (if "
            f"the step's time allows), start the run with LIBTPU_INIT_ARGS=\"{WHOLE_MATMULS_FLAGS}\""]


def step_cost(model: TransformerConfig, strategy: Any, mesh_shape: str | None, tx: Any, target: Target,
              batch_size: int, grad_accum: int, compiled: Any) -> tuple[float | None, float | None]:
    """FLOPs and HBM bytes per device of one step, from XLA's cost analysis.

    XLA counts a loop's body once however often it runs, so for scanned layers the step is
    compiled again with one and with two layers in a Python loop, and the cost extrapolated
    linearly to the model's depth (every layer costs the same). Gradient accumulation's loop
    likewise: one microbatch's step is costed and multiplied by ``grad_accum`` (which counts
    the optimizer's update, a few FLOPs per parameter, that many times too)."""
    if target.chip.platform == "cuda":  # XLA:GPU has no cost analysis without a GPU
        return None, None
    if not model.scan_layers and grad_accum == 1:
        if compiled is None or collective_matmuls(compiled):
            compiled = compile_step(transformer_for(model, strategy, mesh_shape, tx, target), batch_size,
                                    model.seq_len, compiler_options=WHOLE_MATMULS)
        cost = compiled.cost_analysis()
        return float(cost["flops"]), float(cost["bytes accessed"])
    costs = []
    for layers in (1, 2):
        shallow = dataclasses.replace(model, n_layers=layers, scan_layers=False)
        parallel = transformer_for(shallow, strategy, mesh_shape, tx, target)
        cost = compile_step(parallel, batch_size // grad_accum, model.seq_len,
                            compiler_options=WHOLE_MATMULS).cost_analysis()
        costs.append((float(cost["flops"]), float(cost["bytes accessed"])))
    (flops_1, bytes_1), (flops_2, bytes_2) = costs
    extra = model.n_layers - 1
    return (grad_accum * (flops_1 + extra * (flops_2 - flops_1)),
            grad_accum * (bytes_1 + extra * (bytes_2 - bytes_1)))


_WITHOUT_PIPELINE = {"pp": "dp", "pp_fsdp": "fsdp", "pp_tp": "tp"}


def _add_costs(plan: StrategyPlan, target: Target, model: TransformerConfig, strategy: Any,
               mesh_shape: str | None, tx: Any, batch_size: int, grad_accum: int, compiled: Any,
               pipeline: dict[str, Any]) -> None:
    devices = len(target.devices())
    model_flops = flops_per_token(model) * batch_size * model.seq_len / devices
    if strategy.pipeline_axis:
        # XLA counts the schedule's loop body once: cost the same step without the pipeline (its
        # stage axis folded into data) and spread it over the busy stage iterations
        mesh = dict(parse_mesh_shape(plan.mesh))
        mesh["data"] = mesh.get("data", 1) * mesh.pop(strategy.pipeline_axis)
        flat = ",".join(f"{axis}={size}" for axis, size in mesh.items())
        work = step_cost(model, get_strategy(_WITHOUT_PIPELINE.get(strategy.name, "dp")), flat, tx, target,
                         batch_size, grad_accum, None)
        flops, hbm = None, None
        work = (model_flops, 0.0) if work[0] is None else work
        compute_flops, hbm_bytes = (value / (1 - (plan.bubble or 0.0)) for value in work)
    elif pipeline.get("context_attention"):  # the ring's loop: the model's FLOPs, HBM traffic not estimated
        flops, hbm = None, None
        compute_flops, hbm_bytes = model_flops, 0.0
    else:
        flops, hbm = step_cost(model, strategy, mesh_shape, tx, target, batch_size, grad_accum, compiled)
        compute_flops, hbm_bytes = (model_flops, 0.0) if flops is None else (flops, hbm)
    plan.cost = {"flops": flops, "hbm_bytes": hbm, "model_flops": model_flops}
    bound = roofline(target, compute_flops, hbm_bytes, plan.collective_bytes, model_flops)
    plan.roofline = dataclasses.asdict(bound) | {"step_s": bound.step_s, "bound": bound.bound,
                                                 "mfu": bound.mfu}


def plan_all(model: TransformerConfig, strategies: list[str] | None, mesh_shape: str | None,
             layout_for: str | None = None, **options: Any) -> tuple[list[StrategyPlan], list[str]]:
    """Plans for each strategy (all by default); strategies the mesh cannot host are listed as
    skipped. ``layout_for``: a platform (``gpu``) whose default layout of the blocks each strategy
    takes, as ``shardax train`` lays them there (``blocks_in_a_loop``); else the model's."""
    plans, skipped = [], []
    # the expert-parallel strategies are data-parallel for a model without experts: listed for one with them
    for name in strategies or [n for n in STRATEGIES
                               if model.n_experts or "expert" not in STRATEGIES[n].required_axes]:
        laid = model if layout_for is None else dataclasses.replace(
            model, scan_layers=not blocks_in_a_loop(layout_for, name))
        try:
            plans.append(plan_strategy(laid, name, mesh_shape, **options))
        except UsageError as error:  # the mesh cannot host it; anything else is a bug and propagates
            if strategies:  # asked for by name: the user should hear why it cannot run
                raise
            skipped.append(f"{name}: {error}")
    return plans, skipped


def recommend(plans: list[StrategyPlan], device_memory: int | None, model: TransformerConfig) -> str:
    """One paragraph: the least communication that fits, or what would make the model fit."""
    if not plans:
        return "No strategy could be compiled for this mesh."
    fitting = [p for p in plans if p.fits is not False]
    if fitting and all(p.roofline for p in fitting):  # compiled for a target: the fastest step that fits
        best = min(fitting, key=lambda p: (p.roofline["step_s"], p.compiled_bytes_per_device))
        others = ", ".join(f"{p.strategy} {p.roofline['step_s'] * 1e3:.3f} ms"
                           for p in fitting if p is not best)
        return (f"Recommended: {best.strategy} on mesh {best.mesh}: the shortest roofline step, "
                f"{best.roofline['step_s'] * 1e3:.3f} ms ({best.roofline['bound']}-bound, MFU at most "
                f"{100 * best.roofline['mfu']:.1f}%), {format_bytes(best.compiled_bytes_per_device)} per "
                f"device within {format_bytes(device_memory)}" + (f" (others: {others})." if others else "."))
    if fitting:
        best = min(fitting, key=lambda p: (p.collective_bytes, p.compiled_bytes_per_device))
        budget = (f"within {format_bytes(device_memory)} per device"
                  if device_memory else "(no --device-memory given)")
        others = ", ".join(f"{p.strategy} {format_bytes(p.collective_bytes)}"
                           for p in fitting if p is not best)
        return (f"Recommended: {best.strategy} on mesh {best.mesh}. It needs "
                f"{format_bytes(best.compiled_bytes_per_device)} per device {budget} and sends "
                f"{format_bytes(best.collective_bytes)} per device per step, the least of the strategies "
                "that fit" + (f" (others: {others})." if others else "."))
    smallest = min(plans, key=lambda p: p.compiled_bytes_per_device)
    need = smallest.compiled_bytes_per_device / max(device_memory or 1, 1)
    hints = [f"about {need:.1f}x the devices with {smallest.strategy} (its state shrinks with the data axis)"]
    if model.remat == "none":
        hints.append("--remat full (activations kept per layer only at its input)")
    hints.append("--grad-accum 4 or more (a quarter of the activations)")
    hints.append("tensor parallelism (fsdp_tp) to split activations and weights further")
    return (f"Nothing fits {format_bytes(device_memory)} per device: the smallest is {smallest.strategy} "
            f"with {format_bytes(smallest.compiled_bytes_per_device)}. To fit, try " + "; ".join(hints) + ".")
