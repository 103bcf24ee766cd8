"""``shardax train``: the command line. Flags override a YAML config file, which overrides presets.

Bad input (flags, data, a checkpoint directory) ends with one line on stderr and exit code 2;
nothing already saved is touched before every setting has been checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

STRATEGY_NAMES = ("dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "hsdp")
EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """A problem with what the user gave; printed as one line, no traceback."""


def _train_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="train the transformer LM on text",
                                   description="Train a byte-level transformer LM with any parallelism strategy.")
    add = parser.add_argument
    add("--config", help="YAML file of settings (flag names with _ or -); flags given here win")
    add("--strategy", choices=STRATEGY_NAMES, help="how state and work are split (default dp)")
    add("--mesh", help="device mesh, e.g. data=4,model=2 (default: all devices on data)")
    add("--preset", help="model size: tiny, notebook, small, medium, large, 1b (default tiny)")
    add("--steps", type=int, help="optimizer steps (default: the preset's)")
    add("--batch-size", type=int, help="global batch size in sequences")
    add("--grad-accum", type=int, help="microbatches per step (default 1)")
    add("--seq-len", type=int, help="bytes per training sequence")
    add("--lr", type=float, help="peak learning rate")
    add("--seed", type=int, help="seed for initialisation and data order (default 0)")
    add("--data", nargs="+", help="text files or folders (default: the Python standard library's source)")
    add("--precision", choices=("float32", "bfloat16"), help="compute dtype; parameters stay float32")
    add("--remat", choices=("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
        help="what the backward pass recomputes instead of storing")
    add("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
        help="apply the blocks with a scan (default; compile time flat in depth) or, with --no-scan-layers, "
             "in a Python loop (faster for shallow models on CPU, but every layer's activations stay live: "
             "--remat then saves no memory)")
    add("--eval-every", type=int, help="steps between validation evaluations (default 100; 0: only at the end)")
    add("--eval-batches", type=int, help="validation batches per evaluation (default 4)")
    add("--log-every", type=int, help="steps between metric records (default 10)")
    add("--checkpoint-dir", help="directory for checkpoints")
    add("--checkpoint-every", type=int, help="steps between checkpoints (default: only at the end)")
    add("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    add("--metrics", help="JSON-lines metrics file; a PNG of the loss curves is written beside it")
    add("--devices", type=int, help="simulated CPU devices when running on CPU (default 8)")
    add("--sample-bytes", type=int, help="length of the greedy sample at the end (default 160; 0: none)")
    return parser


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise UsageError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise UsageError(f"--config {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"--config {path}: expected a mapping of settings, got {type(loaded).__name__}")
    return {str(key).replace("-", "_"): value for key, value in loaded.items()}


def train_config(args: argparse.Namespace):
    """Presets < YAML file < flags, as a ``TrainConfig``."""
    from shardax.train.trainer import TrainConfig

    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    values = _load_yaml(args.config) if args.config else {}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise UsageError(f"--config {args.config}: unknown setting {unknown[0]!r}; known: {', '.join(sorted(fields))}")
    values.update({k: v for k, v in vars(args).items() if k in fields and v is not None})
    if isinstance(values.get("data"), str):
        values["data"] = [values["data"]]
    return TrainConfig(**values)


def _configure_jax(devices: int) -> None:
    """Before JAX starts: simulated CPU devices, quiet logs."""
    import jax

    if devices < 1:
        raise UsageError(f"--devices {devices} must be at least 1")
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # JAX already started in this process (shardax used as a library)
        if jax.devices()[0].platform == "cpu" and jax.device_count() != devices:
            raise UsageError(f"--devices {devices}: JAX already started here with {jax.device_count()} devices") from None
    logging.getLogger("absl").setLevel(logging.ERROR)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _join_cluster(devices: int) -> None:
    """Simulated CPU devices, then the JAX cluster if this process is one of several."""
    from shardax.distributed import detect_cluster, init_distributed

    if detect_cluster().num_processes > 1:
        devices = int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", devices))
    _configure_jax(devices)
    init_distributed()


def _train(args: argparse.Namespace) -> int:
    config = train_config(args)
    _join_cluster(config.devices)
    from shardax.train.trainer import run

    result = run(config)
    if result.final_val_loss is not None and not result.final_val_loss < result.unigram_loss:
        print(f"warning: validation loss {result.final_val_loss:.4f} is not below the unigram baseline "
              f"{result.unigram_loss:.4f}; train longer or raise --lr", file=sys.stderr)
    return 0


def _launch_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch", help="run a command as N processes of one JAX cluster on this machine",
        description="Start N processes wired together through a coordinator on 127.0.0.1, e.g. "
                    "shardax launch -n 2 -- shardax train --strategy fsdp")
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="how many processes")
    parser.add_argument("--devices-per-process", type=int, help="simulated CPU devices each (default 8 // n)")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command to run")
    return parser


def _launch(args: argparse.Namespace) -> int:
    from shardax.launch import launch

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    devices = args.devices_per_process or max(1, 8 // max(args.num_processes, 1))
    return launch(command, args.num_processes, devices)


def _plan(args: argparse.Namespace) -> int:
    from shardax.plan_cli import mesh_devices, run_plan

    import jax

    try:
        jax.config.update("jax_platforms", "cpu")  # fake CPU devices stand in for the target
    except RuntimeError:
        pass
    _configure_jax(mesh_devices(args.mesh, args.devices))
    return run_plan(args)


def main(argv: list[str] | None = None) -> int:
    from shardax.plan_cli import add_plan_parser

    parser = argparse.ArgumentParser(prog="shardax", description="Train Flax NNX models across devices and hosts.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _train_parser(subparsers)
    add_plan_parser(subparsers, STRATEGY_NAMES)
    _launch_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return {"train": _train, "plan": _plan, "launch": _launch}[args.command](args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        print(f"shardax {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"shardax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
