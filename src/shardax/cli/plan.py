"""``shardax plan``: print (or emit as JSON) what each strategy costs for a preset on a mesh."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from shardax.cli.devices import configure_jax
from shardax.vocabulary import CONTEXT_ATTENTIONS, PRECISIONS, REMAT_POLICIES


def add_plan_parser(subparsers: Any, strategies: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="compile the train step for a mesh ahead of time and report memory and communication",
        description="Compile the train step on fake CPU devices, or with --target for a TPU slice by "
                    "XLA:TPU itself (no accelerator needed either way), and compare XLA's bytes per device "
                    "and collectives with shardax's predictions.")
    add = parser.add_argument
    add("--preset", help="model size (default tiny)")
    add("--init-from", metavar="DIR",
        help="plan a Hugging Face checkpoint's model, as shardax train --init-from builds "
             "it: only DIR/config.json is read, no weights")
    add("--lora-rank", type=int, metavar="R",
        help="plan fine-tuning with LoRA adapters of rank R (the other weights "
             "frozen), as shardax train --lora-rank")
    add("--lora-alpha", type=float, metavar="A", help="the adapters' scale is A / R (default: R)")
    add("--lora-targets", metavar="LIST", help="projections that get adapters (default: the model's own)")
    add("--mesh", help="target mesh, e.g. data=64 or data=8,model=8 (default: each strategy's own)")
    add("--strategy", choices=strategies, action="append", help="strategy to plan (repeatable; default: all)")
    add("--devices", type=int, help="fake devices (default: the mesh's size, or 8)")
    add("--device-memory", help="memory of one device, e.g. 80GB, to say what fits")
    add("--batch-size", type=int, help="global batch (default: the preset's)")
    add("--seq-len", type=int, help="sequence length (default: the preset's)")
    add("--grad-accum", type=int, default=1, help="microbatches per step")
    add("--microbatches", type=int,
        help="pipeline strategies: microbatches through the stages (default: one per stage)")
    add("--pipeline-repeats", type=int, default=1,
        help="pipeline strategies: times round the stages (circular)")
    add("--context-attention", choices=CONTEXT_ATTENTIONS, default="all-gather",
        help="meshes with a context axis: attention by all-gather (default) or ring")
    add("--remat", choices=REMAT_POLICIES)
    add("--precision", choices=PRECISIONS, default="float32")
    add("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
        help="plan the blocks scanned or, with --no-scan-layers, in a Python loop (default: as shardax train "
             "lays them on the target: a loop for GPUs under dp, zero1 and tp, else a scan)")
    add("--target", help="compile for a TPU slice with XLA:TPU, e.g. tpu-v5p-8, tpu-v5e-16, tpu-v6e-64 "
                         "(needs pip install \"shardax[tpu-plan]\"), or for H100s with XLA:GPU, e.g. h100-8 "
                         "(needs shardax[gpu-plan]): HBM fit, FLOPs, roofline step time and MFU")
    add("--fit", action="store_true",
        help="with --target: the largest batch that fits for each remat policy, "
             "and the gradient accumulation that reaches --batch-size")
    add("--json", action="store_true", help="print a JSON list, one object per strategy")
    return parser


def mesh_devices(mesh: str | None, devices: int | None) -> int:
    """Fake devices to create: as asked, else exactly what a fully specified mesh needs, else 8."""
    if devices:
        return devices
    if mesh and "-1" not in mesh:
        from shardax.mesh import parse_mesh_shape

        size = 1
        for _, axis in parse_mesh_shape(mesh):
            size *= axis
        return size
    return 8


def _row(plan: Any) -> list[str]:
    from shardax.sharding.report import format_bytes

    ratio = (plan.collective_bytes / plan.theoretical_collective_bytes if plan.theoretical_collective_bytes
             else 0)
    fits = "-" if plan.fits is None else ("yes" if plan.fits else "no")
    return [plan.strategy, plan.mesh, format_bytes(plan.predicted["params"]),
            format_bytes(plan.predicted["optimizer"]), format_bytes(plan.predicted["gradients"]),
            format_bytes(plan.predicted["activations"]),
            f"{format_bytes(plan.predicted['state'])} / {format_bytes(plan.compiled['arguments'])}",
            format_bytes(plan.compiled["temporaries"]),
            f"{format_bytes(plan.predicted['total'])} / {format_bytes(plan.compiled['peak'])}",
            f"{format_bytes(plan.collective_bytes)} ({ratio:.2f}x)", fits]


def print_plans(plans: list[Any], skipped: list[str], recommendation: str, model_description: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal or console.width < 160:
        console = Console(highlight=False, soft_wrap=True, width=170)
    table = Table(title=f"shardax plan: {model_description}")
    for header in ("strategy", "mesh", "params", "optimizer", "grads", "activations",
                   "state pred. / XLA", "XLA temp", "peak pred. / XLA", "sent per step (vs theory)", "fits"):
        table.add_column(header)
    for plan in plans:
        table.add_row(*_row(plan))
    console.print(table)
    console.print("Bytes are per device. 'state' = parameters + optimizer state + this device's batch rows, "
                  "predicted from shapes and specs vs XLA's compiled arguments; 'peak' adds gradients and "
                  "activations (what autodiff keeps, plus one layer's backward working set) vs XLA's peak; "
                  "'sent' counts ring-algorithm bytes of the compiled collectives against the strategy's "
                  "theoretical minimum.")
    for plan in plans:
        if plan.bubble is not None:
            console.print(f"pipeline [{plan.strategy}]: bubble {100 * plan.bubble:.1f}% of stage iterations "
                          "idle",
                          markup=False)
    print_findings(console, plans, skipped)
    console.print(recommendation)


def _target_row(plan: Any) -> list[str]:
    from shardax.sharding.report import format_bytes

    cost, bound = plan.cost, plan.roofline
    ratio = (plan.collective_bytes / plan.theoretical_collective_bytes if plan.theoretical_collective_bytes
             else 0)
    flops = (f"{cost['flops'] / 1e9:.2f} G ({cost['flops'] / cost['model_flops']:.2f}x)" if cost["flops"]
             else f"{cost['model_flops'] / 1e9:.2f} G (model)")
    needs = format_bytes(plan.compiled_bytes_per_device)
    if "hbm_peak" in plan.compiled:  # and XLA's memory analysis, which estimates more
        needs += f" ({format_bytes(plan.compiled['peak'])})"
    return [plan.strategy, plan.mesh, needs, "yes" if plan.fits else "no",
            f"{format_bytes(plan.collective_bytes)} ({ratio:.2f}x)", flops, f"{bound['step_s'] * 1e3:.3f} ms",
            bound["bound"], f"{100 * bound['mfu']:.1f}%"]


def print_findings(console: Any, plans: list[Any], skipped: list[str]) -> None:
    """Each lint finding once, with the strategies it holds for; then the strategies skipped."""
    findings: dict[str, list[str]] = {}
    for plan in plans:
        for finding in plan.lint:
            findings.setdefault(finding, []).append(plan.strategy)
    for finding, strategies in findings.items():
        console.print(f"lint [{', '.join(strategies)}]: {finding}", markup=False)
    for line in skipped:
        console.print(f"skipped {line}")


def print_target_plans(plans: list[Any], skipped: list[str], target: Any, description: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardax.sharding.report import format_bytes

    console = Console(highlight=False, soft_wrap=True, width=max(Console().width, 150))
    compiler = "XLA:GPU" if target.chip.platform == "cuda" else "XLA:TPU"
    table = Table(title=f"shardax plan: {description} on {target.describe()} ({compiler})")
    heap = any("hbm_peak" in plan.compiled for plan in plans)
    for header in ("strategy", "mesh", "HBM per chip (estimate)" if heap else "peak per chip",
                   f"fits {format_bytes(target.per_device()['hbm_bytes'])}", "sent per step (vs theory)",
                   "FLOPs (vs 6N·tokens + attention)", "roofline step", "bound", "MFU"):
        table.add_column(header)
    for plan in plans:
        table.add_row(*_target_row(plan))
    console.print(table)
    heap_note = ("HBM per chip is what XLA:TPU's buffer assignment reserves (its heap, the arguments and the "
                 "outputs), which XLA:TPU checks against the chip; in brackets, XLA's memory analysis, an "
                 "estimate that runs higher. " if heap else "")
    console.print(f"Per device, as {compiler} compiled the step for this target. {heap_note}The roofline "
                  "step is the slowest of compute (FLOPs / peak), HBM traffic (XLA's bytes accessed / "
                  "bandwidth) and ICI or NVLink traffic (bytes sent / bandwidth) as if they overlapped "
                  "perfectly: a lower bound on the step time, so the MFU is an upper bound. A pipeline's "
                  "compute and HBM traffic are those of the same step without the pipeline, spread over its "
                  "busy stage iterations (XLA counts a loop's body once).")
    print_findings(console, plans, skipped)


def run_fit(args: argparse.Namespace, model: Any, target: Any, batch_size: int) -> int:
    from shardax.analysis.fit import accumulation_for, batch_granule, best, fit
    from shardax.errors import UsageError
    from shardax.sharding.report import format_bytes

    if not args.strategy or len(args.strategy) != 1:
        raise UsageError("--fit searches one strategy at a time; add --strategy NAME (e.g. --strategy fsdp)")
    strategy = args.strategy[0]
    pipeline = {"microbatches": args.microbatches, "pipeline_repeats": args.pipeline_repeats}
    results = fit(model, strategy, args.mesh, target, **pipeline)
    if args.json:
        json.dump([{"remat": r.remat, "batch_size": r.batch_size, "compiles": r.probes,
                    "tokens_per_s": r.tokens_per_s, "plan": r.plan.to_json() if r.plan else None}
                   for r in results], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(f"{strategy} on {target.describe()}, sequences of {model.seq_len}, "
          f"{format_bytes(target.per_device()['hbm_bytes'])} per chip:")
    for r in results:
        if not r.batch_size:
            print(f"  remat {r.remat:<34} nothing fits ({r.probes} compiles)")
            continue
        bound = r.plan.roofline
        print(f"  remat {r.remat:<34} largest batch {r.batch_size:>6}: "
              f"{format_bytes(r.plan.compiled_bytes_per_device)} per chip, roofline "
              f"{bound['step_s'] * 1e3:.2f} ms ({bound['bound']}-bound), MFU {100 * bound['mfu']:.1f}%, "
              f"{r.tokens_per_s:,.0f} tokens/s ({r.probes} compiles)")
    chosen = best(results)
    line = f"Best: --remat {chosen.remat} --batch-size {chosen.batch_size}"
    if batch_size > chosen.batch_size:
        granule = batch_granule(strategy, args.mesh, target, args.microbatches)
        steps, micro = accumulation_for(batch_size, chosen, granule)
        line += (f"; for a global batch of {batch_size}: --batch-size {batch_size} --grad-accum {steps} "
                 f"(microbatches of {micro})")
    print(line)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from shardax.analysis.plan import parse_bytes, plan_all, recommend
    from shardax.models.presets import blocks_in_a_loop, get_preset

    target = _target(args)
    model = _model(args)
    preset = get_preset(args.preset or "tiny")
    # no --scan-layers: each strategy's blocks as shardax train lays them on the target's platform
    layout_for = ("gpu" if args.scan_layers is None and target is not None and target.chip.platform == "cuda"
                  else None)
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    batch_size = args.batch_size or preset.batch_size
    if args.fit:
        if layout_for is not None and args.strategy:
            model = dataclasses.replace(model, scan_layers=not blocks_in_a_loop(layout_for, args.strategy[0]))
        return run_fit(args, model, target, batch_size)
    plans, skipped = plan_all(model, args.strategy, args.mesh, batch_size=batch_size,
                              grad_accum=args.grad_accum, device_memory=memory,
                              microbatches=args.microbatches, pipeline_repeats=args.pipeline_repeats,
                              context_attention=args.context_attention, target=target, layout_for=layout_for)
    if args.json:
        json.dump([plan.to_json() for plan in plans], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    description = f"{_described(args, model)}, batch {batch_size}" + _looped(plans)
    if target is not None:
        print_target_plans(plans, skipped, target, description)
        print(recommend(plans, memory or int(target.per_device()["hbm_bytes"]), model))
        return 0
    print_plans(plans, skipped, recommend(plans, memory, model), description)
    return 0


def _model(args: argparse.Namespace) -> Any:
    """The model to plan: the preset's, or ``--init-from``'s as ``shardax train`` builds it."""
    from shardax.errors import UsageError
    from shardax.lm.config import check_model_choice, model_config

    check_model_choice(args.preset, args.init_from, args.lora_rank, args.lora_alpha, args.lora_targets)
    if args.lora_rank is not None and args.lora_rank < 1:
        raise UsageError(f"--lora-rank {args.lora_rank} must be at least 1")
    overrides: dict[str, Any] = {"compute_dtype": args.precision}
    for name in ("seq_len", "remat", "scan_layers"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    return model_config(args.preset or "tiny", args.init_from, overrides, args.lora_rank, args.lora_alpha,
                        args.lora_targets)


def _described(args: argparse.Namespace, model: Any) -> str:
    """The title's model: its name, parameters, and what LoRA trains of them."""
    from shardax.models.presets import parameter_count

    name = f"{args.init_from} (config.json)" if args.init_from else args.preset or "tiny"
    described = (f"{name} ({parameter_count(model) / 1e9:.2f}B parameters" if parameter_count(model) >= 1e9
                 else f"{name} ({parameter_count(model) / 1e6:.1f}M parameters")
    if model.lora_rank:
        described += f", LoRA rank {model.lora_rank} on {','.join(model.lora_targets)}"
    return described + ")"


def _looped(plans: list[Any]) -> str:
    """What the table's title says of strategies planned with their blocks in a Python loop."""
    looped = [plan.strategy for plan in plans if not plan.scan_layers]
    return f", blocks in a Python loop under {', '.join(looped)}" if looped else ""


def _target(args: argparse.Namespace) -> Any:
    """The ``--target`` slice (checked, with XLA:TPU's compiler present), or None."""
    from shardax.errors import UsageError

    if args.fit and not args.target:
        raise UsageError("--fit searches against a chip's memory; add --target (e.g. --target tpu-v5p-8)")
    if not args.target:
        return None
    from shardax.analysis.targets import parse_target, require_compiler

    target = parse_target(args.target)
    require_compiler(target)
    return target


def plan_command(args: argparse.Namespace) -> int:
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")  # fake CPU devices stand in for the target
    except RuntimeError:
        pass
    configure_jax(mesh_devices(args.mesh, args.devices))
    return run_plan(args)
