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
from shardax.data.registry import get_format
from shardax.errors import UsageError
from shardax.lm.models import check_flags
from shardax.lm.settings import PLACES, SECTIONS, TrainConfig, setting_types
from shardax.models.presets import blocks_in_a_loop, get_preset
from shardax.models.transformer import LORA_TARGETS, LoRA, TransformerConfig
from shardax.vocabulary import (
    ATTENTION_KERNELS,
    CONTEXT_ATTENTIONS,
    NONFINITE_MODES,
    PRECISIONS,
    REMAT_POLICIES,
)

# The default run's tokenizer: a byte-level BPE of this many tokens trained on the standard library.
DEFAULT_VOCAB = 1024

# Settings that define the run: a resumed run takes them from its checkpoint.
DEFINING_SETTINGS = ("preset", "model", "init_from", "lora_rank", "lora_alpha", "lora_targets", "seq_len",
                     "scan_layers", "seed", "batch_size", "steps", "lr", "ema", "data", "tokenizer",
                     "vocab_size", "field", "chat_template", "data_format", "packing", "dpo_beta",
                     "dpo_label_smoothing")
AT_LEAST = {"steps": 1, "batch_size": 1, "grad_accum": 1, "microbatches": 1, "pipeline_repeats": 1,
            "seq_len": 1, "eval_every": 0, "eval_batches": 1, "log_every": 1, "checkpoint_every": 0,
            "keep_checkpoints": 1, "extend_to": 1, "devices": 1, "sample_bytes": 0, "seed": 0,
            "vocab_size": 258, "sample_top_k": 0, "sample_temperature": 0, "lora_rank": 0}
CHOICES = {"precision": PRECISIONS, "on_nonfinite": NONFINITE_MODES, "remat": REMAT_POLICIES,
           "attention": ATTENTION_KERNELS, "context_attention": CONTEXT_ATTENTIONS}


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
    """Settings from a YAML file (keys with - or _, flat or under their sections: ``lr: 3e-3`` or
    ``optimizer: {lr: 3e-3}``) coerced to their types, by flag name."""
    hints = setting_types()
    typed = {}
    for key, value in _flattened(values, where).items():
        name = str(key).replace("-", "_")
        if name not in hints:
            near = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(sorted(hints))}"
            raise UsageError(f"{where}: unknown setting {key!r}; {hint}")
        typed[name] = _coerce(name, hints[name], value, where)
    return typed


def _flattened(values: dict[str, Any], where: str) -> dict[str, Any]:
    """A section's settings lifted to the top level (each checked to belong to its section)."""
    flat = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, inner in value.items():
                name = str(name).replace("-", "_")
                name = next((flag for flag, place in PLACES.items() if place == (key, name)), name)
                if name in PLACES and PLACES[name][0] != key:
                    raise UsageError(f"{where}: {name} belongs under {PLACES[name][0]}:, not {key}:")
                flat[name] = inner
        else:
            flat[key] = value
    return flat


def check_values(config: TrainConfig) -> None:
    """Ranges and choices of every setting, before anything starts."""
    flat = config.flat()
    for name, least in AT_LEAST.items():
        value = flat[name]
        if value is not None and value < least:
            raise UsageError(f"{flag(name)} {value} must be at least {least}")
    for name, choices in CHOICES.items():
        value = flat[name]
        if value is not None and value not in choices:
            raise UsageError(f"{flag(name)} {value!r} is not one of {', '.join(choices)}")
    model, optimizer, run = config.model, config.optimizer, config.run
    if optimizer.lr is not None and not optimizer.lr > 0:
        raise UsageError(f"--lr {optimizer.lr} must be a positive learning rate, e.g. 3e-3")
    if run.extend_to is not None and not run.resume:
        raise UsageError(f"--extend-to {run.extend_to} continues a saved run; add --resume (and its "
                         "--checkpoint-dir)")
    if run.resume and not (run.checkpoint_dir or run.run_dir):
        raise UsageError("--resume continues a saved run: name it with --run-dir DIR (or its "
                         "--checkpoint-dir)")
    if config.data.data_format is not None:
        get_format(config.data.data_format)  # a name, or module:Class: imported (and registered) here
    check_flags(flat)  # --model beside the transformer's flags: said before what they would say together
    check_model_choice(model.preset, model.init_from, model.lora_rank, model.lora_alpha, model.lora_targets)
    if optimizer.ema is not None and not 0 < optimizer.ema < 1:
        raise UsageError(f"--ema {optimizer.ema} is not between 0 and 1 (exclusive); use e.g. 0.999, an "
                         "average over about the last 1,000 steps")


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
    (default: the model's own) where a rank is given; the frozen weights of a LoRA run then stay
    in the checkpoint's dtype (bfloat16 halves them and changes no result)."""
    if init_from is not None:
        from shardax.hf import read_config, stored_dtype

        if lora_rank:
            overrides = {"param_dtype": stored_dtype(Path(init_from)), **overrides}
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
    data_format: str | None = None  # a data format's name or module:Class (None: read off the files)
    packing: bool | None = None  # conversations: False lays one a row
    factory: str | None = None  # --model: the user's model (``model`` then carries its seq_len alone)

    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run (JSON)."""
        model = self.model
        return {"preset": self.preset, "model": self.factory, "init_from": self.init_from,
                "lora_rank": model.lora_rank,
                "lora_alpha": model.lora_alpha if model.lora_rank else None,
                "lora_targets": ",".join(model.lora_targets) if model.lora_rank else None,
                "seq_len": self.model.seq_len,
                "scan_layers": None if self.factory else self.model.scan_layers,
                "seed": self.seed, "batch_size": self.batch_size, "steps": self.steps, "lr": self.lr,
                "data": self.data, "train_to": self.train_to, "tokenizer": self.tokenizer,
                "vocab_size": self.vocab_size, "field": self.field, "ema": self.ema,
                "chat_template": self.chat_template, "dpo_beta": self.dpo_beta,
                "dpo_label_smoothing": self.dpo_label_smoothing, "data_format": self.data_format,
                "packing": self.packing}

    def model_record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the model: shardax's transformer's config, or of a model of
        ``--model``, its vocabulary and sequence length (``vocab_size`` is set once the data is open)."""
        if self.factory is not None:
            return {"vocab_size": self.model.vocab_size, "seq_len": self.model.seq_len}
        return dataclasses.asdict(self.model)


def resolve(config: TrainConfig, saved: dict[str, Any] | None = None, platform: str = "cpu") -> RunDefinition:
    """The run ``config`` asks for on ``platform`` (JAX's backend: cpu, gpu or tpu); with
    ``saved`` (a checkpoint's run record), the saved run, refusing flags that contradict it."""
    config = _with_sources(config)
    if saved is not None:
        config = _from_record(config, saved)
    elif config.data.paths is None and config.data.tokenizer is None and config.model.init_from is None:
        # the built-in corpus: a BPE trained on it (once, cached) gives the default run text made of words
        config = config.replace(tokenizer="bpe", vocab_size=config.data.vocab_size or DEFAULT_VOCAB)
    check_flags(config.flat())  # --model (given, or the checkpoint's) beside the transformer's flags
    chosen, data, optimizer = config.model, config.data, config.optimizer
    preset = get_preset(chosen.preset or "tiny")
    overrides: dict[str, Any] = {"compute_dtype": chosen.precision, "attention": chosen.attention}
    overrides |= {name: getattr(chosen, name) for name in ("seq_len", "remat", "scan_layers")
                  if getattr(chosen, name) is not None}
    overrides.setdefault("scan_layers", not blocks_in_a_loop(platform, config.parallelism.strategy))
    model = model_config(chosen.preset or "tiny", chosen.init_from, overrides, chosen.lora_rank,
                         chosen.lora_alpha, chosen.lora_targets)
    steps = optimizer.steps if optimizer.steps is not None else preset.steps
    extend_to = config.run.extend_to
    train_to = extend_to or (saved or {}).get("train_to") or steps
    return RunDefinition(
        preset=None if chosen.init_from else chosen.preset or "tiny", model=model, seed=config.run.seed or 0,
        batch_size=optimizer.batch_size if optimizer.batch_size is not None else preset.batch_size,
        steps=steps, lr=optimizer.lr if optimizer.lr is not None else preset.lr, data=data.paths,
        train_to=max(train_to, steps) if extend_to else train_to, tokenizer=data.tokenizer,
        vocab_size=data.vocab_size, field=data.field, init_from=chosen.init_from, ema=optimizer.ema,
        chat_template=None if data.chat_template is None else str(Path(data.chat_template).absolute()),
        dpo_beta=optimizer.dpo_beta, dpo_label_smoothing=optimizer.dpo_label_smoothing,
        data_format=data.data_format, packing=data.packing, factory=chosen.factory)


def _with_sources(config: TrainConfig) -> TrainConfig:
    """``--data`` and ``--init-from`` as absolute paths (a resume from another working directory
    reads the same data and model), and a checkpoint's own tokenizer where none is given."""
    init_from = config.model.init_from
    init_from = None if init_from is None else str(Path(init_from).absolute())
    config = config.replace(data=_absolute(config.data.paths), init_from=init_from)
    if init_from is not None and config.data.tokenizer is None:
        own = Path(init_from) / "tokenizer.json"
        if not own.is_file():
            raise UsageError(f"--init-from {init_from} has no tokenizer.json; give the one the model was "
                             "trained with: --tokenizer path/to/tokenizer.json")
        config = config.replace(tokenizer=str(own))
    return config


def _from_record(config: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    updates, flat = {}, config.flat()
    for name in DEFINING_SETTINGS:
        given, kept = flat[name], saved.get(name)
        if name == "data":
            kept = _absolute(kept)
        if given is None:
            updates[name] = kept
        elif name == "steps" and given != kept:
            raise UsageError(f"--steps {given} contradicts the checkpoint's --steps {kept} (its schedule's "
                             f"length); to train on past step {saved.get('train_to', kept)}, use --extend-to "
                             f"{given}")
        elif given != kept:
            kept_shown = "none (shardax's transformer)" if name == "model" and kept is None else _show(kept)
            raise UsageError(f"{flag(name)} {_show(given)} contradicts the checkpoint's {flag(name)} "
                             f"{kept_shown}; drop {flag(name)} to resume that run, or start a new run in "
                             "another --checkpoint-dir")
    return config.replace(**updates)


def _absolute(data: list[str] | None) -> list[str] | None:
    """``--data`` as absolute paths (the built-in ``python-chats`` and ``python-pairs`` kept by name)."""
    if data is None:
        return None
    return [entry if entry in BUILT_IN_SETS and not Path(entry).exists() else str(Path(entry).absolute())
            for entry in data]


def _show(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)
