"""The notes ``shardax plan`` adds to a plan about the model itself: where a figure of this
compile says less than it seems (XLA:CPU's bfloat16, looped layers, a GPU step traced without
cuDNN, a SwiGLU MLP's prediction) and what the layout does (a pipeline's bubble, the experts'
bytes per device)."""

from __future__ import annotations

from typing import Any

from shardax.analysis.targets import Target
from shardax.analysis.theory import experts_bytes
from shardax.models.transformer import TransformerConfig, attention_implementation
from shardax.sharding.report import format_bytes


def model_notes(model: TransformerConfig, parallel: Any, target: Target | None,
                schedule: Any) -> list[str]:
    """Every note that applies to ``model`` laid out as ``parallel`` for ``target`` (None: fake
    CPU devices) with a pipeline ``schedule`` (None: no pipeline), in the plan's order."""
    return (looped_layers_note(model, parallel, target) + bfloat16_note(model, target)
            + swiglu_note(model) + experts_note(model, parallel) + deviceless_attention_note(model, target)
            + bubble_note(schedule))


def bubble_note(schedule: Any) -> list[str]:
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


def deviceless_attention_note(model: TransformerConfig, target: Target | None) -> list[str]:
    """A GPU target's step traces XLA's attention where a GPU would run cuDNN's fused kernel."""
    if (target is None or target.chip.platform != "cuda"
            or attention_implementation(model, "gpu")[0] != "cudnn"):
        return []
    return ["attention: on GPUs this model runs cuDNN's fused kernel, but tracing it needs cuDNN, which a "
            "host without a GPU lacks, so this compile holds XLA's attention and its score matrices: the "
            "peak overstates a GPU's (small, batch 64, dp on one H100: 3.14 GB compiled on a CPU host, 1.99 "
            "GB on the GPU, benchmark 23)"]


def bfloat16_note(model: TransformerConfig, target: Target | None = None) -> list[str]:
    if model.compute_dtype != "bfloat16" or target is not None:
        return []
    return ["bfloat16 compute on fake CPU devices: XLA:CPU computes bfloat16 in float32 and keeps both "
            "widths, so its compiled peak overstates an accelerator's (the small preset under dp needs 730 "
            "MB in bfloat16 and 715 MB in float32); the prediction counts the residuals at the widths "
            "autodiff keeps them"]


def experts_note(model: TransformerConfig, parallel: Any) -> list[str]:
    if not model.n_experts:
        return []
    whole, held = experts_bytes(parallel.layout)
    return [f"experts: {format_bytes(held)} of their {format_bytes(whole)} per device ({held / whole:.3g} of "
            f"them; {model.n_experts} experts, {model.experts_per_token} per token)"]


def swiglu_note(model: TransformerConfig) -> list[str]:
    if model.mlp != "swiglu":
        return []
    return ["a SwiGLU MLP (the Llama family, every preset since shardax 0.2): the predicted peak's "
            "working-set factors were fitted on GELU MLPs, and XLA:CPU's compiled peak of the tiny preset "
            "runs 2-4% above the prediction under full remat and 6-11% above it without; the compiled figure "
            "is the one to go by"]


def looped_layers_note(model: TransformerConfig, parallel: Any, target: Any) -> list[str]:
    if model.scan_layers or target is not None:
        # XLA:TPU and XLA:GPU free a looped layer's activations under remat
        return []
    return ["layers in a Python loop (scan_layers=False): XLA:CPU keeps every layer's activations live "
            "whatever the remat policy, so remat only costs time here (not on GPUs or TPUs). The peak "
            f"predicted for {parallel.strategy.name} with looped layers is rough (up to 20% off XLA:CPU's)"]
