"""``shardax train``: the command line of the LM job. Flags override a YAML file, which overrides presets.

Bad input (flags, data, a checkpoint directory) ends with one line on stderr and exit code 2;
nothing already saved is touched before every setting has been checked.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from shardax.cli import signals
from shardax.cli.devices import configure_jax
from shardax.cli.errors import UsageError
from shardax.errors import Stopped
from shardax.vocabulary import (
    ATTENTION_KERNELS,
    CONTEXT_ATTENTIONS,
    NONFINITE_MODES,
    PRECISIONS,
    REMAT_POLICIES,
    STRATEGY_NAMES,
)


def _add_model_flags(group: Any) -> None:
    add = group.add_argument
    add("--preset",
        help="model size: tiny, small, medium, large, 1b (default tiny; each Llama-shaped, so every run "
             "exports with shardax export --hf)")
    add("--model", metavar="MODULE:FACTORY",
        help="train your own model instead of shardax's transformer: the function FACTORY of MODULE "
             "(importable from the current directory or PYTHONPATH), called FACTORY(vocab_size=V, seq_len=T, "
             "rngs=nnx.Rngs) and returning an nnx.Module whose __call__(tokens) gives (batch, T, V) logits; "
             "--preset then only sets the run's defaults")
    add("--init-from", metavar="DIR",
        help="fine-tune a Hugging Face checkpoint (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, "
             "mixtral, qwen2_moe, qwen3_moe; a run's own export too): its model, weights (read straight into "
             "shards) and tokenizer.json")
    add("--lora-rank", type=int, metavar="R",
        help="fine-tune with LoRA adapters of rank R on the projections of --lora-targets, the other weights "
             "frozen (no optimizer state); 0: full fine-tuning (default)")
    add("--lora-alpha", type=float, metavar="A",
        help="the adapters' scale is A / R (default: R, a scale of 1)")
    add("--lora-targets", metavar="LIST",
        help="projections to adapt, by Hugging Face name: any of q,k,v,o,gate,up,down (default: all the "
             "model has)")
    add("--ema", type=float, metavar="DECAY",
        help="keep an exponential moving average of the weights with this decay (e.g. 0.999), laid out like "
             "the optimizer state and checkpointed; shardax export --ema and generate --ema use it")
    add("--precision", choices=PRECISIONS, help="compute dtype; trained parameters stay float32")
    add("--remat", choices=REMAT_POLICIES,
        help="what the backward pass recomputes instead of storing")
    add("--attention", choices=ATTENTION_KERNELS,
        help="attention kernel: auto (default: cuDNN's fused kernel on a GPU with bfloat16 and head "
             "dimension a multiple of 8 up to 256, else XLA; the run says which and why), xla, or cudnn")
    add("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
        help="apply the blocks with a scan (compile time flat in depth) or, with --no-scan-layers, in a "
             "Python loop (steps 1.14-1.27x faster on an H100). Default: a loop on GPUs under dp, zero1 and "
             "tp, a scan elsewhere (on XLA:CPU a loop keeps every layer's activations live: --remat then "
             "saves no memory)")


def _add_data_flags(group: Any) -> None:
    add = group.add_argument
    add("--data", nargs="+",
        help="text, .jsonl or .parquet files or folders, or a directory written by shardax "
              "prepare (default: the Python standard library's source)")
    add("--tokenizer",
        help="bytes, bpe, or a tokenizer.json: tokenize --data into shards first (cached; see shardax "
             "prepare) and pack documents; default: bytes held in memory for --data, a BPE of 1024 "
             "tokens for the built-in corpus")
    add("--vocab-size", type=int,
        help="with --tokenizer bpe: vocabulary to train (default 4096; 1024 for the "
             "built-in corpus)")
    add("--field", help="the text field of .jsonl / .parquet inputs (default text)")
    add("--format", dest="data_format", metavar="FORMAT",
        help="documents, conversations or preferences (pairs, trained with DPO), or MODULE:CLASS, a data "
             "format of your own (shardax.data.registry.DataFormat); default: read off each file's first "
             "record")
    add("--no-packing", dest="packing", action="store_const", const=False,
        help="conversations: one a row (default: whole conversations packed into rows, kept apart)")
    add("--dpo-beta", type=float, help="preference pairs (prompt, chosen, rejected): DPO's beta, how far the "
                                       "model may move from the reference (default 0.1)")
    add("--dpo-label-smoothing", type=float,
        help="preference pairs: the share of pairs taken to be mislabelled "
             "(conservative DPO; default 0)")
    add("--chat-template",
        help="conversations (.jsonl/.parquet of messages or prompt/completion): the template "
             "to render them with, a checkpoint's folder or a .jinja file (default: the "
             "tokenizer's own, else shardax's built-in one)")
    add("--seq-len", type=int,
        help="tokens per training sequence (bytes with the byte tokenizer; default: the "
             "preset's, 64 for tiny)")


def _add_parallelism_flags(group: Any) -> None:
    add = group.add_argument
    add("--strategy", choices=STRATEGY_NAMES, help="how state and work are split (default dp)")
    add("--mesh", help="device mesh over every device, e.g. data=4,model=2 (default: all devices on data)")
    add("--devices", type=int, help="simulated CPU devices when running on CPU (default 8)")
    add("--grad-accum", type=int, help="microbatches per step (default 1)")
    add("--microbatches", type=int,
        help="pipeline strategies (pp, pp_fsdp, pp_tp): microbatches flowing through the "
             "stages (default: one per stage); the bubble is (S-1)/(R*M+S-1)")
    add("--pipeline-repeats", type=int,
        help="pipeline strategies: times round the stages, each stage holding that many "
             "chunks of layers (a circular schedule; default 1)")
    add("--context-attention", choices=CONTEXT_ATTENTIONS,
        help="a mesh with a context axis (the sequence split over it, e.g. data=2,context=4): gather every "
             "share's keys and values (all-gather, default) or pass them round the devices (ring)")


def _add_run_flags(group: Any) -> None:
    add = group.add_argument
    add("--config", help="YAML file of settings (flag names with _ or -); flags given here win")
    add("--steps", type=int,
        help="optimizer steps: the schedule's length and the last step (default: the preset's)")
    add("--batch-size", type=int, help="global batch size in sequences")
    add("--lr", type=float, help="peak learning rate")
    add("--seed", type=int, help="seed for initialisation and data order (default 0)")
    add("--on-nonfinite", choices=NONFINITE_MODES,
        help="a NaN/Inf loss or gradient norm: stop the run, keeping the last good checkpoint (default), or "
             "skip that update and count it (metric skipped_steps)")
    add("--sample-tokens", "--sample-bytes", dest="sample_bytes", type=int, metavar="N",
        help="tokens of text sampled at the end (bytes with the byte tokenizer; default 160; 0: none)")
    add("--sample-temperature", type=float, help="sampling temperature (default 0.7; 0: greedy)")
    add("--sample-top-k", type=int, help="draw from the k most likely tokens (default 10; 0: all)")


def _add_checkpoint_flags(group: Any) -> None:
    add = group.add_argument
    add("--run-dir", metavar="DIR",
        help="the run's directory: its config.yaml, tokenizer.json, metrics.jsonl, metrics.png and "
             "checkpoints/ (default: a new one under runs/, named by the time and strategy); with --resume, "
             "the run to continue")
    add("--checkpoint-dir", help="directory for checkpoints (default: the run directory's checkpoints/)")
    add("--checkpoint-every", type=int, help="steps between checkpoints (default: only at the end)")
    add("--keep-checkpoints", type=int, help="how many of the latest checkpoints to keep (default 3)")
    add("--resume", action="store_true", default=None,
        help="continue the run of --run-dir from its latest good checkpoint: model, seed, batch size, data, "
             "schedule and data position come from there, the other settings from its config.yaml; strategy, "
             "mesh, processes, remat, precision and logging may change with flags")
    add("--extend-to", type=int, metavar="N",
        help="with --resume: train to step N instead of the saved run's end; past the schedule's end the "
             "learning rate stays at its final value")


def _add_logging_flags(group: Any) -> None:
    add = group.add_argument
    add("--eval-every", type=int,
        help="steps between validation evaluations (default 100; 0: only at the end)")
    add("--eval-batches", type=int, help="validation batches per evaluation (default 4)")
    add("--log-every", type=int, help="steps between metric records (default 10)")
    add("--metrics",
        help="JSON-lines metrics file, a PNG of the loss curves beside it (default: the run directory's "
             "metrics.jsonl)")
    add("--tracker", action="append", metavar="KIND:DIR",
        help="also log the run to tensorboard:DIR, mlflow:DIR (a local MLflow file store) or wandb:DIR (W&B, "
             "offline); repeat for several")


# --help's groups, in its order: each a title, what it holds, and the function adding its flags
GROUPS = (("model", "the model: its size or checkpoint, LoRA, and how it computes", _add_model_flags),
          ("data", "the training text and its tokenizer", _add_data_flags),
          ("parallelism", "how the devices share the state and the work", _add_parallelism_flags),
          ("run", "the schedule, the seed and the closing sample", _add_run_flags),
          ("checkpoints", "where the run writes, and resuming it", _add_checkpoint_flags),
          ("logging", "evaluation, metrics and trackers", _add_logging_flags))


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The ``train`` subcommand's parser; its flags come in ``GROUPS``, in ``--help``'s order."""
    parser = subparsers.add_parser(
        "train", help="train the transformer LM (or your own, --model) on text",
        description="Train a transformer LM (or your own LM, --model) on text with any parallelism strategy.")
    for title, description, add_flags in GROUPS:
        add_flags(parser.add_argument_group(title, description))
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
    return loaded


def train_config(args: argparse.Namespace):
    """Presets < the resumed run's config.yaml < YAML file < flags, as a ``TrainConfig`` (YAML values
    coerced to the settings' types). What defines a resumed run comes from its checkpoint."""
    from shardax.lm.config import DEFINING_SETTINGS, typed_settings
    from shardax.lm.rundir import saved_settings
    from shardax.lm.settings import PLACES, TrainConfig

    values = {}
    if args.resume and args.run_dir:
        values = {k: v for k, v in saved_settings(args.run_dir).items() if k not in DEFINING_SETTINGS}
    if args.config:
        values.update(typed_settings(_load_yaml(args.config), f"--config {args.config}"))
    values.update({k: v for k, v in vars(args).items() if k in PLACES and v is not None})
    return TrainConfig.of(**values)


def _join_cluster(devices: int) -> None:
    """Simulated CPU devices, then the JAX cluster if this process is one of several."""
    from shardax.cli.errors import end_cluster_wait
    from shardax.distributed import detect_cluster, init_distributed

    if detect_cluster().num_processes > 1:
        devices = int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", devices))
    configure_jax(devices)
    timeout = os.environ.get("SHARDAX_JOIN_TIMEOUT_S", "300")
    try:
        timeout_s = float(timeout)
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        raise UsageError(f"SHARDAX_JOIN_TIMEOUT_S={timeout!r}: give the seconds to wait for the cluster to "
                         "form, a number above 0 (default 300)")
    init_distributed(timeout_s=timeout_s, on_timeout=end_cluster_wait)
    import jax

    jax.devices()  # JAX's backends start (after the cluster formed, as JAX requires)


def train(args: argparse.Namespace) -> int:
    try:
        with signals.deferred():  # JAX, its plugins and the libraries with compiled parts start here
            config = train_config(args)
            _join_cluster(config.parallelism.devices)
            import tokenizers  # noqa: F401  (imported by data preparation later, where a signal raises)

            from shardax.lm.job import run
    except Stopped as stop:
        raise Stopped(stop.signal_name, "before training began: this run wrote nothing") from None
    from shardax.cli.errors import quiet_failed_writers

    quiet_failed_writers()  # this process is the command line's: a failed write is said once
    result = run(config)
    # the data format's own baseline, in its loss's unit (DPO's log 2 nats/pair, a unigram's nats/token)
    baseline = next(iter(result.baselines.items()), None)
    if result.final_val_loss is not None and baseline is not None and not result.final_val_loss < baseline[1]:
        name, value = baseline
        unit = result.loss_unit
        print(f"warning: validation loss {result.final_val_loss:.4f} {unit} is not below the {name} baseline "
              f"{value:.4f} {unit}; train longer or raise --lr", file=sys.stderr)
    return 0
