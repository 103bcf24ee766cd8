"""``shardax plan``: compile the train step for a target mesh ahead of time and read what it costs.

Nothing runs and no accelerator is needed: the step is lowered and compiled for fake CPU
devices from abstract shapes, then XLA's ``memory_analysis()`` and the collectives in the
compiled HLO are set beside shardax's own prediction from shapes and specs.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import optax

from shardax.analysis.collectives import find_collectives, summarize
from shardax.analysis.lint import lint
from shardax.analysis.theory import predict_memory, theoretical_collective_bytes
from shardax.analysis.traffic import wire_bytes
from shardax.errors import UsageError
from shardax.mesh import DeviceMeshManager, describe_mesh
from shardax.model_parallel import parallelize
from shardax.models.transformer import TransformerConfig, TransformerLM, weighted_next_token_loss
from shardax.sharding.report import format_bytes
from shardax.sharding.strategies import STRATEGIES, default_mesh, get_strategy

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GB"``, ``"16GiB"``, ``"512MB"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise UsageError(f"--device-memory {text!r} is not a size; write it like 80GB, 16GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclasses.dataclass
class StrategyPlan:
    strategy: str
    mesh: str
    predicted: dict[str, int]  # params, gradients, optimizer, batch, activations, state, total
    compiled: dict[str, int]  # arguments, outputs, temporaries, aliased, peak
    collectives: dict[str, dict[str, float]]  # kind -> count, bytes, wire_bytes (per step, per device)
    collective_bytes: float  # what the compiled step sends per device per step
    theoretical_collective_bytes: float
    fits: bool | None
    lint: list[str]
    compile_s: float
    bubble: float | None = None  # pipeline strategies: the fraction of idle stage iterations

    @property
    def predicted_bytes_per_device(self) -> int:
        return self.predicted["total"]

    @property
    def compiled_bytes_per_device(self) -> int:
        return self.compiled["peak"]

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["predicted_bytes_per_device"] = self.predicted_bytes_per_device
        record["compiled_bytes_per_device"] = self.compiled_bytes_per_device
        return record


def compile_step(parallel, batch_size: int, seq_len: int, grad_accum: int = 1, **pipeline: Any):
    """The next-token train step of ``parallel`` compiled ahead of time for one batch shape
    (``pipeline``: ``microbatches`` and ``pipeline_repeats`` under a pipeline strategy)."""
    batch = {"tokens": jax.ShapeDtypeStruct((batch_size, seq_len + 1), jax.numpy.int32,
                                            sharding=parallel.layout.batch())}
    step = parallel.train_step(weighted_next_token_loss, grad_accum=grad_accum, **pipeline)
    return step.lower(parallel.abstract_state, batch).compile()


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's ``memory_analysis()`` of a compiled step per device, with its peak: arguments,
    temporaries and outputs, less the outputs that reuse (alias) donated arguments."""
    memory = compiled.memory_analysis()
    measured = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes}
    measured["peak"] = measured["arguments"] + measured["temporaries"] + measured["outputs"] - measured["aliased"]
    return measured


def plan_strategy(model: TransformerConfig, strategy: str, mesh_shape: str | None, *, batch_size: int,
                  grad_accum: int = 1, device_memory: int | None = None,
                  tx: optax.GradientTransformation | None = None, microbatches: int | None = None,
                  pipeline_repeats: int = 1, context_attention: str = "all-gather") -> StrategyPlan:
    """Compile one strategy's step on fake devices and measure it (see the module docstring).
    ``microbatches`` and ``pipeline_repeats``: the schedule of a pipeline strategy;
    ``context_attention``: how attention spans a sequence split over a ``context`` axis."""
    resolved = get_strategy(strategy)
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape or default_mesh(resolved.name))
    parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), tx or optax.adamw(1e-3), mesh, resolved)
    # the pipeline's schedule applies to the pipeline strategies only (the others of a plan ignore it)
    pipeline = {"microbatches": microbatches, "pipeline_repeats": pipeline_repeats} if resolved.pipeline_axis else {}
    schedule = parallel.schedule(**pipeline)
    context = parallel.context_attention(context_attention) if "context" in mesh.shape else None
    if context is not None:
        pipeline["context_attention"] = context
    started = time.perf_counter()
    compiled = compile_step(parallel, batch_size, model.seq_len, grad_accum, **pipeline)
    compile_s = time.perf_counter() - started
    measured = compiled_memory(compiled)
    prediction = predict_memory(parallel, model, batch_size, model.seq_len, grad_accum, schedule, context or "all-gather")
    predicted = dataclasses.asdict(prediction) | {"state": prediction.state, "total": prediction.total}
    collectives = find_collectives(compiled.as_text())
    summary = {kind: {"count": entry["count"], "bytes": entry["bytes"], "wire_bytes": 0.0}
               for kind, entry in summarize(collectives).items()}
    for collective in collectives:
        summary[collective.kind]["wire_bytes"] += wire_bytes(collective, mesh.devices.size) * collective.executions
    return StrategyPlan(
        strategy=resolved.name, mesh=describe_mesh(mesh), predicted=predicted, compiled=measured,
        collectives=summary, collective_bytes=sum(entry["wire_bytes"] for entry in summary.values()),
        theoretical_collective_bytes=theoretical_collective_bytes(parallel.layout, model, batch_size, schedule,
                                                                  context or "all-gather"),
        fits=None if device_memory is None else measured["peak"] <= device_memory,
        lint=(lint(parallel, collectives) + _looped_layers_note(model, parallel) + _bfloat16_note(model)
              + _bubble_note(schedule)),
        compile_s=compile_s, bubble=None if schedule is None else schedule.bubble,
    )


def _bubble_note(schedule: Any) -> list[str]:
    """A pipeline that idles more than a quarter of its stage iterations."""
    if schedule is None or schedule.bubble <= 0.25:
        return []
    # the fewest microbatches (a multiple of the stages) that bring the bubble to 25% or less
    enough = schedule.stages
    while (schedule.stages - 1) / (schedule.repeats * enough + schedule.stages - 1) > 0.25:
        enough += schedule.stages
    return [f"pipeline bubble {100 * schedule.bubble:.0f}%: {schedule.stages - 1} of every "
            f"{schedule.iterations} stage iterations idle ((S-1)/(R*M+S-1) with S={schedule.stages}, "
            f"M={schedule.microbatches}, R={schedule.repeats}); --microbatches {enough} brings it to "
            f"{100 * (schedule.stages - 1) / (schedule.repeats * enough + schedule.stages - 1):.0f}%"]


def _bfloat16_note(model: TransformerConfig) -> list[str]:
    if model.compute_dtype != "bfloat16":
        return []
    return ["bfloat16 compute on fake CPU devices: XLA:CPU computes bfloat16 in float32 and keeps both widths, "
            "so its compiled peak overstates an accelerator's (the small preset under dp needs 730 MB in bfloat16 "
            "and 715 MB in float32); the prediction counts the residuals at the widths autodiff keeps them"]


def _looped_layers_note(model: TransformerConfig, parallel: Any) -> list[str]:
    if model.scan_layers:
        return []
    return [f"layers in a Python loop (scan_layers=False): XLA keeps every layer's activations live whatever "
            f"the remat policy, so remat only costs time; use scanned layers to save memory. The peak predicted "
            f"for {parallel.strategy.name} with looped layers is rough (up to 20% off XLA:CPU's)"]


def plan_all(model: TransformerConfig, strategies: list[str] | None, mesh_shape: str | None, **options: Any
             ) -> tuple[list[StrategyPlan], list[str]]:
    """Plans for each strategy (all by default); strategies the mesh cannot host are listed as skipped."""
    plans, skipped = [], []
    for name in strategies or list(STRATEGIES):
        try:
            plans.append(plan_strategy(model, name, mesh_shape, **options))
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
    if fitting:
        best = min(fitting, key=lambda p: (p.collective_bytes, p.compiled["peak"]))
        budget = f"within {format_bytes(device_memory)} per device" if device_memory else "(no --device-memory given)"
        others = ", ".join(f"{p.strategy} {format_bytes(p.collective_bytes)}" for p in fitting if p is not best)
        return (f"Recommended: {best.strategy} on mesh {best.mesh}. It needs {format_bytes(best.compiled['peak'])} "
                f"per device {budget} and sends {format_bytes(best.collective_bytes)} per device per step, the "
                f"least of the strategies that fit" + (f" (others: {others})." if others else "."))
    smallest = min(plans, key=lambda p: p.compiled["peak"])
    need = smallest.compiled["peak"] / max(device_memory or 1, 1)
    hints = [f"about {need:.1f}x the devices with {smallest.strategy} (its state shrinks with the data axis)"]
    if model.remat == "none":
        hints.append("--remat full (activations kept per layer only at its input)")
    hints.append("--grad-accum 4 or more (a quarter of the activations)")
    hints.append("tensor parallelism (fsdp_tp) to split activations and weights further")
    return (f"Nothing fits {format_bytes(device_memory)} per device: the smallest is {smallest.strategy} with "
            f"{format_bytes(smallest.compiled['peak'])}. To fit, try " + "; ".join(hints) + ".")
