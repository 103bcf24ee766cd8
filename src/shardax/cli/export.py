"""``shardax export CHECKPOINT_DIR --hf OUT``: a ``shardax train`` checkpoint as a Hugging Face one.

The run's model (every preset is Llama-shaped, and a run fine-tuned with ``--init-from`` keeps
its checkpoint's family) is laid out FSDP over the local devices, the checkpoint's step
restored into it, and written by ``shardax.hf.save`` a tensor at a time. A run started from a
Hugging Face checkpoint keeps its ``config.json``'s other fields, and its tokenizer files are
copied; a run of a preset gets the ``tokenizer.json`` its run directory holds, with a
``tokenizer_config.json`` naming its end-of-document token, so that transformers loads both and
``shardax train --init-from`` fine-tunes the export. A LoRA
run (``--lora-rank``) exports its adapters alone in PEFT's layout, or with ``--merge`` the
weights with the adapters merged in. A run of a model of the user's own (``shardax train
--model``) is refused in one line: there is no Hugging Face layout to write it in.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path
from typing import Any

from shardax.cli.devices import configure_jax
from shardax.cli.errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export", help="write a shardax train checkpoint as a Hugging Face checkpoint",
        description="Write a checkpoint of shardax train (a Llama-family model) as config.json and "
                    "safetensors, as Hugging Face transformers reads them.")
    add = parser.add_argument
    add("checkpoint_dir", help="the run's directory (its checkpoints/), or its --checkpoint-dir")
    add("--hf", required=True, metavar="OUT", help="directory to write (new, or empty)")
    add("--step", type=int, help="which checkpoint (default: the latest good one)")
    add("--merge", action="store_true",
        help="a LoRA run (--lora-rank): write the weights with its adapters merged in; without it, the "
             "adapters alone in PEFT's layout (adapter_config.json, adapter_model.safetensors)")
    add("--ema", action="store_true",
        help="write the moving average of the weights that a run trained with --ema DECAY kept, not the "
             "weights")
    add("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the tensors' dtype")
    add("--max-shard-size", type=int, default=2 << 30, metavar="BYTES", help="bytes per safetensors file")
    add("--devices", type=int, default=8, help="simulated CPU devices when running on CPU (default 8)")
    return parser


def checkpoints_of(directory: str) -> Path:
    """A run directory's ``checkpoints/``; any other directory as given (a ``--checkpoint-dir``)."""
    from shardax.lm.rundir import CHECKPOINTS, CONFIG

    path = Path(directory)
    return path / CHECKPOINTS if (path / CONFIG).is_file() and (path / CHECKPOINTS).is_dir() else path


def restore_run(checkpoint_dir: str, step: int | None, check: Any = None,
                ema: bool = False) -> tuple[int, dict, Any, Any, Any]:
    """A ``shardax train`` checkpoint restored FSDP over the local devices: (its step, the run's
    record, the model's config (None: a model of ``--model``, built by its factory), the
    ``ParallelModel``, the state). ``check(config, step)`` runs before anything is read. With
    ``ema``, the state's parameters are the moving average the run kept (``--ema``), refused in
    one line if it kept none."""
    from shardax.lm.job import optimizer
    from shardax.lm.models import load_factory
    from shardax.model_parallel import parallelize
    from shardax.models.transformer import TransformerConfig, TransformerLM
    from shardax.trainer.checkpoint import Checkpointer

    checkpoint_dir = str(checkpoints_of(checkpoint_dir))
    with Checkpointer(checkpoint_dir) as checkpointer:
        checkpointer.lock.check_free()
        if step is None:
            step = checkpointer.latest_good_step()[0]
        elif step not in checkpointer.all_steps():
            raise UsageError(f"--step {step}: {checkpoint_dir} holds steps {checkpointer.all_steps()}; "
                             "give one of them")
        record = checkpointer.record(step)
        run, model = record.get("run"), record.get("model")
        if not isinstance(run, dict) or not isinstance(model, dict):
            raise UsageError(f"{checkpoint_dir} step {step} was not written by shardax train (no run "
                             "record); use the Trainer's model in Python")
        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        spec = run.get("model")  # shardax train --model: the user's factory builds it
        config = None if spec else TransformerConfig(**{k: tuple(v) if isinstance(v, list) else v
                                                        for k, v in model.items() if k in fields})
        if check is not None:
            check(config, step)
        if ema and run.get("ema") is None:
            raise UsageError(f"--ema: step {step} of {checkpoint_dir} keeps no moving average of the weights "
                             "(it was trained without shardax train --ema DECAY); drop --ema")
        tx, _ = optimizer(run["lr"], run["steps"], run.get("ema"))
        if spec:
            factory, sizes = load_factory(spec), {k: model[k] for k in ("vocab_size", "seq_len")}
            parallel = parallelize(lambda rngs: factory(**sizes, rngs=rngs), tx, None, "fsdp")
        else:
            parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), tx, None, "fsdp")
        state = _restored(checkpointer, step, parallel, record.get("parts"))
    return step, run, config, parallel, parallel.ema_state(state) if ema else state


def _restored(checkpointer: Any, step: int, parallel: Any, parts: dict[str, Any] | None) -> Any:
    """The state of ``step`` for ``parallel``'s model; of a run of parts (full DPO: the model
    trained beside a frozen copy of it), the trained part's alone."""
    if not parts:
        return checkpointer.restore(step, parallel.abstract_state, parallel.state_shardings)[0]
    [trained], frozen = parts["trained"], parts["frozen"]

    def of_parts(state: Any) -> Any:  # every part is the model: the trained one with its optimizer
        names = [trained, *frozen]
        return state.replace(params={name: state.params for name in names},
                             rest={name: state.rest for name in names}, opt_state={trained: state.opt_state})

    abstract, shardings = of_parts(parallel.abstract_state), of_parts(parallel.state_shardings)
    saved, _ = checkpointer.restore(step, abstract, shardings)
    return saved.replace(params=saved.params[trained], rest=saved.rest[trained],
                         opt_state=saved.opt_state[trained])


def export_command(args: argparse.Namespace) -> int:
    configure_jax(args.devices, start=True)
    import json

    from shardax import hf

    out = Path(args.hf)

    def check(config: Any, step: int) -> None:
        if config is None:
            raise UsageError(f"step {step} of {args.checkpoint_dir} trained a model of your own (shardax "
                             "train --model), and shardax export writes shardax's transformer in Hugging "
                             "Face's layout; save your model's parameters from Python (shardax.Trainer, "
                             "resumed from its checkpoints)")
        hf.config_json(config)  # a model without a Hugging Face layout: said before anything is read
        if args.merge and not config.lora_rank:
            raise UsageError(f"--merge merges LoRA adapters, and step {step} of {args.checkpoint_dir} "
                             "trained every weight (no --lora-rank); drop --merge")

    step, run, config, _, state = restore_run(args.checkpoint_dir, args.step, check, ema=args.ema)
    source = Path(run["init_from"]) if run.get("init_from") else None
    base = (json.loads((source / "config.json").read_text()) if source and (source / "config.json").is_file()
            else None)
    tokenizer = tokenizer_of(args.checkpoint_dir, run)
    if base is None and tokenizer is not None:  # a run of a preset: its documents end with <|endoftext|>
        base = _token_ids(tokenizer)
    if config.lora_rank and not args.merge:
        hf.save_adapters(out, state.params, config, base_model=run.get("init_from"), dtype=args.dtype)
        what = f"as LoRA adapters in PEFT's layout (rank {config.lora_rank})"
    else:
        hf.save(out, state.params, config, hf_config=base, dtype=args.dtype,
                max_shard_bytes=args.max_shard_size, merge=args.merge)
        what = "as a Hugging Face checkpoint" + (" (LoRA adapters merged)" if args.merge else "")
    copied = []
    for name in TOKENIZER_FILES:
        found = (source / name) if source and (source / name).is_file() else None
        if name == "tokenizer.json" and tokenizer is not None:
            found = tokenizer
        if name == "chat_template.jinja" and tokenizer is not None and (tokenizer.parent / name).is_file():
            found = tokenizer.parent / name  # the template a run's conversations were rendered with
        if found is not None:
            shutil.copy(found, out / name)
            copied.append(name)
    if tokenizer is not None and "tokenizer_config.json" not in copied:
        (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(config), indent=1) + "\n")
        copied.append("tokenizer_config.json")
    what += " from the moving average of its weights" if args.ema else ""
    print(f"wrote step {step} of {args.checkpoint_dir} to {out} {what} "
          f"({config.n_layers} layers, {args.dtype})" + (f"; with {', '.join(copied)}" if copied else ""))
    return 0


def tokenizer_of(checkpoint_dir: str, run: dict[str, Any]) -> Path | None:
    """The run's ``tokenizer.json``: the one its run directory holds, else the file it was given."""
    from shardax.lm.rundir import TOKENIZER

    kept = checkpoints_of(checkpoint_dir).parent / TOKENIZER
    if kept.is_file():
        return kept
    given = Path(run["tokenizer"]) if run.get("tokenizer") else None
    return given if given is not None and given.is_file() else None


def _token_ids(tokenizer: Path) -> dict[str, Any]:
    """config.json's token ids for a tokenizer of shardax's: documents begin after and end with
    ``<|endoftext|>``."""
    from shardax.data.tokenizer import END_OF_DOCUMENT, load_tokenizer

    end = load_tokenizer(tokenizer)
    return ({"bos_token_id": end.eod_id, "eos_token_id": end.eod_id} if end.end_of_document == END_OF_DOCUMENT
            else {})


def _tokenizer_config(config: Any) -> dict[str, Any]:
    """``tokenizer_config.json`` for a tokenizer of shardax's, as transformers' AutoTokenizer reads it."""
    from shardax.data.tokenizer import END_OF_DOCUMENT

    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_DOCUMENT, "bos_token": None,
            "model_max_length": config.seq_len, "clean_up_tokenization_spaces": False}
