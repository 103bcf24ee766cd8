"""``shardax train``'s settings: their types and ranges, and what a resumed run takes from its checkpoint.

A run is defined by its model (preset, sequence length, scanned or looped blocks), its seed,
its batch size, its data and its schedule (steps, peak learning rate). A checkpoint records
them; ``--resume`` takes them from there, and a flag that contradicts one is refused, naming
both values. How the run is computed and observed may change on resume: strategy, mesh,
number of processes, remat, precision, microbatches, logging, evaluation, checkpoint interval
(they take this run's flags or defaults; the header names those that differ from the checkpoint's).
A finished run goes on only through ``--extend-to N``: the schedule keeps its length, so the
learning rate stays at its final value (a tenth of the peak) for the added steps.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

from shardax.data.python_chats import BUILT_IN_SETS
from shardax.errors import UsageError
from shardax.models.presets import blocks_in_a_loop, get_preset
from shardax.models.transformer import LORA_TARGETS, LoRA, TransformerConfig
from shardax.vocabulary import (
    ATTENTION_KERNELS,
    CONTEXT_ATTENTIONS,
    DATA_FORMATS,
    NONFINITE_MODES,
    PRECISIONS,
    REMAT_POLICIES,
)


@dataclasses.dataclass
class TrainConfig:
    """Everything ``shardax train`` takes; ``None`` means "the preset's value" (or, on resume, the
    checkpoint's)."""

    strategy: str = "dp"  # dp, zero1, zero2, fsdp, tp, fsdp_tp, hsdp, pp, pp_fsdp, pp_tp
    mesh: str | None = None  # e.g. "data=4,model=2"; default: every device on data
    preset: str | None = None  # model size, see shardax.models.presets (default tiny)
    # a Hugging Face checkpoint (Llama or Gemma family) to fine-tune: its model and tokenizer
    init_from: str | None = None
    # LoRA adapters of this rank, the base weights frozen (0 or None: full training)
    lora_rank: int | None = None
    lora_alpha: float | None = None  # the adapters' scale is alpha / rank (default: the rank)
    lora_targets: str | None = None  # e.g. "q,v" (default: every projection the model has)
    steps: int | None = None  # optimizer steps: the schedule's length and where the run ends
    batch_size: int | None = None  # global batch, in sequences
    grad_accum: int = 1  # microbatches per step (same update, less activation memory)
    microbatches: int | None = None  # pipeline strategies: microbatches through the stages (default: stages)
    pipeline_repeats: int = 1  # pipeline strategies: times round the stages (circular schedule)
    context_attention: str = "all-gather"  # a mesh with a context axis: all-gather or ring attention
    seq_len: int | None = None  # tokens per training sequence (bytes with the byte tokenizer)
    lr: float | None = None  # peak learning rate (warmup then cosine decay to a tenth of it)
    ema: float | None = None  # keep a moving average of the weights with this decay (export/generate --ema)
    seed: int | None = None  # model initialisation and data order (default 0)
    # text/.jsonl/.parquet files or folders, or a prepared directory; default: stdlib
    data: list[str] | None = None
    # bytes, bpe or a tokenizer.json: tokenize into shards first (see shardax prepare)
    tokenizer: str | None = None
    vocab_size: int | None = None  # with --tokenizer bpe: the vocabulary to train (default 4096)
    field: str | None = None  # the text field of .jsonl / .parquet inputs (default "text")
    # conversations: a checkpoint folder or .jinja (default: the tokenizer's)
    chat_template: str | None = None
    data_format: str | None = None  # documents, conversations or preferences (default: read off the files)
    packing: bool | None = None  # conversations: whole examples share rows (default), or False: one a row
    dpo_beta: float | None = None  # preference pairs: DPO's beta (default 0.1)
    # preference pairs: conservative DPO's label smoothing (default 0)
    dpo_label_smoothing: float | None = None
    precision: str = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    remat: str | None = None  # none, full, dots_saveable, ...
    attention: str = "auto"  # auto (cuDNN on GPU where it applies), xla or cudnn
    scan_layers: bool | None = None  # False: blocks in a Python loop (default: see blocks_in_a_loop)
    eval_every: int = 100  # steps between validation evaluations (0: only at the end)
    eval_batches: int = 4  # validation batches per evaluation
    log_every: int = 10  # steps between metric records and progress lines
    run_dir: str | None = None  # the run's directory (default: a new one under runs/); see lm/rundir.py
    checkpoint_dir: str | None = None  # where checkpoints go (default: the run directory's checkpoints/)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # how many of the latest checkpoints to keep
    resume: bool = False  # continue from the latest good checkpoint in checkpoint_dir
    extend_to: int | None = None  # with --resume: train to this step instead of the saved run's end
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient norm: stop, or skip that update
    # JSON-lines metrics file, a PNG of the curves beside it (default: in the run dir)
    metrics: str | None = None
    tracker: list[str] | None = None  # also log to tensorboard:DIR, mlflow:DIR or wandb:DIR (offline)
    devices: int = 8  # simulated CPU devices (ignored on GPU/TPU)
    sample_bytes: int = 160  # tokens of text sampled at the end (bytes with the byte tokenizer; 0: none)
    sample_temperature: float = 0.7  # 0: greedy
    sample_top_k: int = 10  # draw from the k most likely tokens (0: all)


# The default run's tokenizer: a byte-level BPE of this many tokens trained on the standard library.
DEFAULT_VOCAB = 1024

# Settings that define the run: a resumed run takes them from its checkpoint.
RUN_SETTINGS = ("preset", "init_from", "lora_rank", "lora_alpha", "lora_targets", "seq_len", "scan_layers",
                "seed", "batch_size", "steps", "lr", "ema", "data", "tokenizer", "vocab_size", "field",
                "chat_template", "data_format", "packing", "dpo_beta", "dpo_label_smoothing")
AT_LEAST = {"steps": 1, "batch_size": 1, "grad_accum": 1, "microbatches": 1, "pipeline_repeats": 1,
            "seq_len": 1, "eval_every": 0, "eval_batches": 1, "log_every": 1, "checkpoint_every": 0,
            "keep_checkpoints": 1, "extend_to": 1, "devices": 1, "sample_bytes": 0, "seed": 0,
            "vocab_size": 258, "sample_top_k": 0, "sample_temperature": 0, "lora_rank": 0}
CHOICES = {"precision": PRECISIONS, "on_nonfinite": NONFINITE_MODES, "remat": REMAT_POLICIES,
           "attention": ATTENTION_KERNELS, "context_attention": CONTEXT_ATTENTIONS,
           "data_format": DATA_FORMATS}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _coerce(name: str, kind: Any, value: Any, where: str) -> Any:
    """``value`` as the field's type (YAML reads ``1e-3`` as a string), or a one-line error."""
    options = [k for k in typing.get_args(kind) if k is not type(None)] or [kind]
    if value is None and type(None) in typing.get_args(kind):
        return None
    for option in options:
        origin = typing.get_origin(option) or option
        try:
            if origin is bool and isinstance(value, (bool, str)):
                text = str(value).lower()
                if text in ("true", "yes", "1", "false", "no", "0"):
                    return text in ("true", "yes", "1")
            elif origin is int and not isinstance(value, bool) and float(value) == int(float(value)):
                return int(float(value))
            elif origin is float and not isinstance(value, bool):
                return float(value)
            elif origin is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
            elif origin is list and isinstance(value, (str, list, tuple)):
                return [str(item) for item in ([value] if isinstance(value, str) else value)]
        except (TypeError, ValueError, OverflowError):
            continue
    expected = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise UsageError(f"{where}: {name} is {value!r}, expected {expected}; e.g. {name}: {_example(name)}")


def _example(name: str) -> str:
    return {"lr": "3e-3", "steps": "200", "data": "[path/to/text]", "mesh": "data=4,model=2"}.get(name, "...")


def typed_settings(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Settings from a YAML file (keys with - or _) coerced to ``TrainConfig``'s field types."""
    hints = typing.get_type_hints(TrainConfig)
    typed = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            near = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(sorted(hints))}"
            raise UsageError(f"{where}: unknown setting {key!r}; {hint}")
        typed[name] = _coerce(name, hints[name], value, where)
    return typed


def check_values(config: TrainConfig) -> None:
    """Ranges and choices of every setting, before anything starts."""
    for name, least in AT_LEAST.items():
        value = getattr(config, name)
        if value is not None and value < least:
            raise UsageError(f"{flag(name)} {value} must be at least {least}")
    for name, choices in CHOICES.items():
        value = getattr(config, name)
        if value is not None and value not in choices:
            raise UsageError(f"{flag(name)} {value!r} is not one of {', '.join(choices)}")
    if config.lr is not None and not config.lr > 0:
        raise UsageError(f"--lr {config.lr} must be a positive learning rate, e.g. 3e-3")
    if config.extend_to is not None and not config.resume:
        raise UsageError(f"--extend-to {config.extend_to} continues a saved run; add --resume (and its "
                         "--checkpoint-dir)")
    if config.resume and not (config.checkpoint_dir or config.run_dir):
        raise UsageError("--resume continues a saved run: name it with --run-dir DIR (or its "
                         "--checkpoint-dir)")
    check_model_choice(config.preset, config.init_from, config.lora_rank, config.lora_alpha,
                       config.lora_targets)
    if config.ema is not None and not 0 < config.ema < 1:
        raise UsageError(f"--ema {config.ema} is not between 0 and 1 (exclusive); use e.g. 0.999, an average "
                         "over about the last 1,000 steps")


def check_model_choice(preset: str | None, init_from: str | None, lora_rank: int | None,
                       lora_alpha: float | None, lora_targets: str | None) -> None:
    """What ``--preset``, ``--init-from`` and the ``--lora-*`` flags refuse together (train and plan)."""
    if init_from is not None and preset is not None:
        raise UsageError(f"--preset {preset} and --init-from {init_from} both say what the model is; drop "
                         "--preset to use the checkpoint's model, or --init-from to train a preset from "
                         "scratch")
    if not lora_rank and (lora_alpha is not None or lora_targets is not None):
        given = "--lora-alpha" if lora_alpha is not None else "--lora-targets"
        raise UsageError(f"{given} shapes LoRA adapters, and there are none without --lora-rank; add "
                         "--lora-rank R (e.g. 16)")
    if lora_alpha is not None and not lora_alpha > 0:
        raise UsageError(f"--lora-alpha {lora_alpha} must be positive (the adapters' scale is alpha / rank)")
    if lora_targets is not None:
        targets = [t.strip() for t in lora_targets.split(",")]
        wrong = [t for t in targets if t not in LORA_TARGETS]
        if wrong or len(set(targets)) != len(targets):
            raise UsageError(f"--lora-targets {lora_targets}: name each projection once, from "
                             f"{','.join(LORA_TARGETS)}")


def model_config(preset: str, init_from: str | None, overrides: dict[str, Any], lora_rank: int | None = None,
                 lora_alpha: float | None = None, lora_targets: str | None = None) -> TransformerConfig:
    """The model ``shardax train`` builds, and ``shardax plan`` plans: ``preset``'s, or the Hugging
    Face checkpoint's in ``init_from`` (its ``config.json`` only; sequences as long as the preset's
    unless ``overrides`` say ``seq_len``), with LoRA adapters of ``lora_rank`` on ``lora_targets``
    (default: the model's own) where a rank is given."""
    if init_from is not None:
        from shardax.hf import read_config

        model = read_config(init_from, **{"seq_len": get_preset(preset).model["seq_len"], **overrides})
    else:
        model = get_preset(preset).config(**overrides)
    if lora_rank:
        model = LoRA(lora_rank, lora_alpha, lora_targets or ",".join(model.adaptable)).applied(model)
    return model


@dataclasses.dataclass(frozen=True)
class RunDefinition:
    """The settings that define a run, resolved (preset defaults filled in)."""

    preset: str | None  # None: the model of init_from
    model: TransformerConfig
    seed: int
    batch_size: int
    steps: int  # the schedule's length
    lr: float
    data: list[str] | None
    train_to: int  # the step the run ends at (steps, or --extend-to)
    tokenizer: str | None = None
    vocab_size: int | None = None
    field: str | None = None
    init_from: str | None = None
    ema: float | None = None  # the moving average's decay (None: none kept)
    chat_template: str | None = None  # conversations' template, when not the tokenizer's
    dpo_beta: float | None = None  # preference pairs: DPO's beta and label smoothing
    dpo_label_smoothing: float | None = None
    data_format: str | None = None  # as prepare's --format (None: read off the files)
    packing: bool | None = None  # conversations: False lays one a row

    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run (JSON)."""
        model = self.model
        return {"preset": self.preset, "init_from": self.init_from, "lora_rank": model.lora_rank,
                "lora_alpha": model.lora_alpha if model.lora_rank else None,
                "lora_targets": ",".join(model.lora_targets) if model.lora_rank else None,
                "seq_len": self.model.seq_len, "scan_layers": self.model.scan_layers,
                "seed": self.seed, "batch_size": self.batch_size, "steps": self.steps, "lr": self.lr,
                "data": self.data, "train_to": self.train_to, "tokenizer": self.tokenizer,
                "vocab_size": self.vocab_size, "field": self.field, "ema": self.ema,
                "chat_template": self.chat_template, "dpo_beta": self.dpo_beta,
                "dpo_label_smoothing": self.dpo_label_smoothing, "data_format": self.data_format,
                "packing": self.packing}


def resolve(config: TrainConfig, saved: dict[str, Any] | None = None, platform: str = "cpu") -> RunDefinition:
    """The run ``config`` asks for on ``platform`` (JAX's backend: cpu, gpu or tpu); with
    ``saved`` (a checkpoint's run record), the saved run, refusing flags that contradict it."""
    # --data and --init-from are kept as absolute paths: a resume from another working directory
    # reads the same data and model
    config = dataclasses.replace(config, data=_absolute(config.data),
                                 init_from=None if config.init_from is None
                                           else str(Path(config.init_from).absolute()))
    if config.init_from is not None and config.tokenizer is None:  # the checkpoint's own tokenizer
        own = Path(config.init_from) / "tokenizer.json"
        if not own.is_file():
            raise UsageError(f"--init-from {config.init_from} has no tokenizer.json; give the one the model "
                             "was trained with: --tokenizer path/to/tokenizer.json")
        config = dataclasses.replace(config, tokenizer=str(own))
    if saved is not None:
        config = _from_record(config, saved)
    elif config.data is None and config.tokenizer is None and config.init_from is None:
        # the built-in corpus: a BPE trained on it (once, cached) gives the default run text made of words
        config = dataclasses.replace(config, tokenizer="bpe", vocab_size=config.vocab_size or DEFAULT_VOCAB)
    preset = get_preset(config.preset or "tiny")
    overrides: dict[str, Any] = {"compute_dtype": config.precision, "attention": config.attention}
    for name in ("seq_len", "remat", "scan_layers"):
        if getattr(config, name) is not None:
            overrides[name] = getattr(config, name)
    overrides.setdefault("scan_layers", not blocks_in_a_loop(platform, config.strategy))
    model = model_config(config.preset or "tiny", config.init_from, overrides, config.lora_rank,
                         config.lora_alpha, config.lora_targets)
    steps = config.steps if config.steps is not None else preset.steps
    train_to = config.extend_to or (saved or {}).get("train_to") or steps
    return RunDefinition(preset=None if config.init_from else config.preset or "tiny", model=model,
               seed=config.seed or 0,
               batch_size=config.batch_size if config.batch_size is not None else preset.batch_size,
               steps=steps, lr=config.lr if config.lr is not None else preset.lr, data=config.data,
               train_to=max(train_to, steps) if config.extend_to else train_to, tokenizer=config.tokenizer,
               vocab_size=config.vocab_size, field=config.field, init_from=config.init_from, ema=config.ema,
               chat_template=None if config.chat_template is None
                             else str(Path(config.chat_template).absolute()), dpo_beta=config.dpo_beta,
               dpo_label_smoothing=config.dpo_label_smoothing, data_format=config.data_format,
               packing=config.packing)


def _from_record(config: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    updates = {}
    for name in RUN_SETTINGS:
        given, kept = getattr(config, name), saved.get(name)
        if name == "data":
            kept = _absolute(kept)
        if given is None:
            updates[name] = kept
        elif name == "steps" and given != kept:
            raise UsageError(f"--steps {given} contradicts the checkpoint's --steps {kept} (its schedule's "
                             f"length); to train on past step {saved.get('train_to', kept)}, use --extend-to "
                             f"{given}")
        elif given != kept:
            raise UsageError(f"{flag(name)} {_show(given)} contradicts the checkpoint's {flag(name)} "
                             f"{_show(kept)}; drop {flag(name)} to resume that run, or start a new run in "
                             "another --checkpoint-dir")
    return dataclasses.replace(config, **updates)


def _absolute(data: list[str] | None) -> list[str] | None:
    """``--data`` as absolute paths (the built-in ``python-chats`` and ``python-pairs`` kept by name)."""
    if data is None:
        return None
    return [entry if entry in BUILT_IN_SETS and not Path(entry).exists() else str(Path(entry).absolute())
            for entry in data]


def _show(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)
