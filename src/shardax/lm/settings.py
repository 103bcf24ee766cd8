"""``shardax train``'s settings, by concern: the model, the data, the optimizer, the parallelism
and the run. ``TrainConfig`` holds one of each.

Every setting has one name across the sections, its flag's (``--grad-accum`` is
``parallelism.grad_accum``; ``--data`` is ``data.paths``), so a flat mapping of flag names, as
the command line, a YAML file or a run's ``config.yaml`` give them, builds a ``TrainConfig``
(``TrainConfig.of``) and ``flat()`` gives it back. ``None`` means "the preset's value" (or, on
resume, the checkpoint's).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


@dataclasses.dataclass
class ModelSettings:
    """What model is trained."""

    preset: str | None = None
    """The model's size (``shardax.models.presets``; default ``tiny``); with ``model``, the run's
    defaults alone (sequence length, batch size, steps, learning rate)."""
    factory: str | None = dataclasses.field(default=None, metadata={"flag": "model"})
    """Your own model instead of shardax's transformer: ``pkg.module:factory``, called
    ``factory(vocab_size=, seq_len=, rngs=)`` (``--model``; ``shardax.lm.models``)."""
    init_from: str | None = None
    """A Hugging Face checkpoint (Llama, Qwen, Mistral, Gemma or MoE families) to fine-tune: its
    model and tokenizer."""
    lora_rank: int | None = None
    """LoRA adapters of this rank, the base weights frozen (0 or None: full training)."""
    lora_alpha: float | None = None
    """The adapters' scale is alpha / rank (default: the rank)."""
    lora_targets: str | None = None
    """The projections that get adapters, e.g. ``"q,v"`` (default: every one the model has)."""
    seq_len: int | None = None
    """Tokens per training sequence (bytes with the byte tokenizer)."""
    precision: str = "float32"
    """The compute dtype: float32 or bfloat16 (the trained parameters stay float32)."""
    remat: str | None = None
    """What the backward pass recomputes: none, full, dots_saveable, ..."""
    attention: str = "auto"
    """The attention kernel: auto (cuDNN on GPU where it applies), xla or cudnn."""
    scan_layers: bool | None = None
    """False: blocks in a Python loop (default: see ``shardax.models.presets.blocks_in_a_loop``)."""


@dataclasses.dataclass
class DataSettings:
    """What the model reads."""

    paths: list[str] | None = dataclasses.field(default=None, metadata={"flag": "data"})
    """Text, .jsonl or .parquet files or folders, a prepared directory, or a built-in set
    (``--data``; default: text of Python's standard library)."""
    tokenizer: str | None = None
    """bytes, bpe or a tokenizer.json: the text is tokenized into shards first (``shardax prepare``)."""
    vocab_size: int | None = None
    """With ``tokenizer="bpe"``: the vocabulary to train (default 4096)."""
    field: str | None = None
    """The text field of .jsonl and .parquet inputs (default ``"text"``)."""
    chat_template: str | None = None
    """Conversations: a checkpoint folder or a .jinja file (default: the tokenizer's)."""
    data_format: str | None = None
    """A data format: documents, conversations, preferences (DPO), or ``module:Class``, one of
    your own (``shardax.data.registry``); default: read off the files."""
    packing: bool | None = None
    """Conversations: whole examples share rows (default), or False: one a row."""


@dataclasses.dataclass
class OptimizerSettings:
    """How the weights are updated: the schedule and the loss."""

    steps: int | None = None
    """Optimizer steps: the schedule's length and where the run ends."""
    batch_size: int | None = None
    """The global batch, in sequences."""
    lr: float | None = None
    """The peak learning rate (warmup, then cosine decay to a tenth of it)."""
    ema: float | None = None
    """Keep a moving average of the weights with this decay (``export``/``generate --ema``)."""
    dpo_beta: float | None = None
    """Preference pairs: DPO's beta (default 0.1)."""
    dpo_label_smoothing: float | None = None
    """Preference pairs: conservative DPO's label smoothing (default 0)."""
    on_nonfinite: str = "stop"
    """A NaN or infinite loss or gradient norm: stop, or skip that update."""


@dataclasses.dataclass
class ParallelismSettings:
    """How the work is split over devices."""

    strategy: str = "dp"
    """dp, zero1, zero2, fsdp, tp, fsdp_tp, hsdp, pp, pp_fsdp, pp_tp, ep, fsdp_ep or ep_tp."""
    mesh: str | None = None
    """The mesh's shape, e.g. ``"data=4,model=2"`` (default: every device on data)."""
    grad_accum: int = 1
    """Microbatches per step (the same update, less activation memory)."""
    microbatches: int | None = None
    """Pipeline strategies: microbatches through the stages (default: one per stage)."""
    pipeline_repeats: int = 1
    """Pipeline strategies: times round the stages (a circular schedule)."""
    context_attention: str = "all-gather"
    """A mesh with a context axis: all-gather or ring attention."""
    devices: int = 8
    """Simulated CPU devices (ignored on GPUs and TPUs)."""

    def step_options(self) -> dict[str, Any]:
        """The ``shardax.Trainer`` keywords of how each step is split and scheduled."""
        return {"mesh": self.mesh, "strategy": self.strategy, "grad_accum": self.grad_accum,
                "microbatches": self.microbatches, "pipeline_repeats": self.pipeline_repeats,
                "context_attention": self.context_attention}


@dataclasses.dataclass
class RunSettings:
    """Where the run writes, how it is watched, and how it ends."""

    seed: int | None = None
    """Model initialisation and data order (default 0)."""
    run_dir: str | None = None
    """The run's directory (default: a new one under runs/; ``shardax.lm.rundir``)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (default: the run directory's checkpoints/)."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = 3
    """How many of the latest checkpoints to keep."""
    resume: bool = False
    """Continue from the latest good checkpoint in ``checkpoint_dir``."""
    extend_to: int | None = None
    """With ``resume``: train to this step instead of the saved run's end."""
    eval_every: int = 100
    """Steps between validation evaluations (0: only at the end)."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    log_every: int = 10
    """Steps between metric records and progress lines."""
    metrics: str | None = None
    """The JSON-lines metrics file, a PNG of the curves beside it (default: in the run directory)."""
    tracker: list[str] | None = None
    """Also log to tensorboard:DIR, mlflow:DIR or wandb:DIR (offline)."""
    sample_bytes: int = 160
    """Tokens of text sampled at the end (bytes with the byte tokenizer; 0: none)."""
    sample_temperature: float = 0.7
    """The closing sample's temperature (0: greedy)."""
    sample_top_k: int = 10
    """Draw the closing sample from the k most likely tokens (0: all)."""


SECTIONS = {"model": ModelSettings, "data": DataSettings, "optimizer": OptimizerSettings,
            "parallelism": ParallelismSettings, "run": RunSettings}


def _flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", field.name)


# each setting's flag name: (its section, its field in that section)
PLACES: dict[str, tuple[str, str]] = {
    _flag_name(field): (section, field.name) for section, kind in SECTIONS.items()
    for field in dataclasses.fields(kind)}


def setting_types() -> dict[str, Any]:
    """Each setting's type, by flag name (for coercing YAML's values)."""
    hints = {section: typing.get_type_hints(kind) for section, kind in SECTIONS.items()}
    return {name: hints[section][field] for name, (section, field) in PLACES.items()}


@dataclasses.dataclass
class TrainConfig:
    """Everything ``shardax train`` takes, by concern (see the module docstring)."""

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    optimizer: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    parallelism: ParallelismSettings = dataclasses.field(default_factory=ParallelismSettings)
    run: RunSettings = dataclasses.field(default_factory=RunSettings)

    @classmethod
    def of(cls, **settings: Any) -> TrainConfig:
        """A config from settings by flag name (``TrainConfig.of(strategy="fsdp", lr=3e-3)``)."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> TrainConfig:
        """This config with the settings named by flag name changed."""
        unknown = sorted(set(settings) - set(PLACES))
        if unknown:
            raise TypeError(f"unknown shardax train setting(s) {', '.join(unknown)}")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            section, field = PLACES[name]
            changes.setdefault(section, {})[field] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **fields)
                                            for section, fields in changes.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by flag name."""
        return {name: getattr(getattr(self, section), field) for name, (section, field) in PLACES.items()}


def by_section(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Settings by flag name grouped under their sections (for a run's ``config.yaml``), in the
    sections' order."""
    grouped: dict[str, dict[str, Any]] = {}
    for name, (section, _) in PLACES.items():
        if name in settings:
            grouped.setdefault(section, {})[name] = settings[name]
    return grouped
