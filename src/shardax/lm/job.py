"""The main job: train the transformer LM on bytes of real text with any strategy.

``run(TrainConfig(...))`` is what ``shardax train`` calls. It is one client of ``Trainer``: it
reads the corpus, checks the settings and the checkpoint directory, hands the Trainer a batch
function of the step (the data position is the step) and the validation batches, and ends with
a greedy sample.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from shardax.data.batches import WindowSampler, validation_batches
from shardax.data.corpus import Corpus, load_corpus
from shardax.lm.sampling import greedy_sample
from shardax.mesh import DeviceMeshManager, describe_mesh
from shardax.model_parallel import ParallelModel
from shardax.models.presets import get_preset
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss
from shardax.sharding.strategies import default_mesh, get_strategy
from shardax.trainer.checkpoint import Checkpointer
from shardax.trainer.display import say
from shardax.trainer.trainer import Trainer

@dataclasses.dataclass
class TrainConfig:
    """Everything ``shardax train`` takes; ``None`` means "the preset's value"."""

    strategy: str = "dp"  # dp, zero1, zero2, fsdp, tp, fsdp_tp, hsdp
    mesh: str | None = None  # e.g. "data=4,model=2"; default: every device on data (see DEFAULT_MESH)
    preset: str = "tiny"  # model size, see shardax.models.presets
    steps: int | None = None  # optimizer steps
    batch_size: int | None = None  # global batch, in sequences
    grad_accum: int = 1  # microbatches per step (same update, less activation memory)
    seq_len: int | None = None  # bytes per training sequence
    lr: float | None = None  # peak learning rate (warmup then cosine decay)
    seed: int = 0  # model initialisation and data order
    data: list[str] | None = None  # text files or folders; default: the Python standard library
    precision: str = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    remat: str | None = None  # none, full, dots_saveable, ...
    scan_layers: bool | None = None  # False: blocks in a Python loop (default: scanned)
    eval_every: int = 100  # steps between validation evaluations (0: only at the end)
    eval_batches: int = 4  # validation batches per evaluation
    log_every: int = 10  # steps between metric records and progress lines
    checkpoint_dir: str | None = None  # where checkpoints go (none: no checkpoints)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir
    metrics: str | None = None  # JSON-lines metrics file; a PNG of the curves goes beside it
    devices: int = 8  # simulated CPU devices (ignored on GPU/TPU)
    sample_bytes: int = 160  # length of the greedy sample printed at the end (0: none)


@dataclasses.dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float
    tokens_per_sec: float
    best_val_loss: float | None
    final_val_loss: float | None
    unigram_loss: float
    state: Any
    parallel: ParallelModel


def _settings(config: TrainConfig) -> tuple[TransformerConfig, int, int, float]:
    preset = get_preset(config.preset)
    overrides: dict[str, Any] = {"compute_dtype": config.precision}
    if config.seq_len is not None:
        overrides["seq_len"] = config.seq_len
    if config.remat is not None:
        overrides["remat"] = config.remat
    if config.scan_layers is not None:
        overrides["scan_layers"] = config.scan_layers
    model = preset.config(**overrides)
    steps = config.steps if config.steps is not None else preset.steps
    batch = config.batch_size if config.batch_size is not None else preset.batch_size
    lr = config.lr if config.lr is not None else preset.lr
    for name, value in (("--steps", steps), ("--batch-size", batch), ("--grad-accum", config.grad_accum),
                        ("--seq-len", model.seq_len)):
        if value < 1:
            raise ValueError(f"{name} {value} must be at least 1")
    return model, steps, batch, lr


def _check_batch(batch: int, grad_accum: int, mesh: Mesh, axes: tuple[str, ...]) -> None:
    split = math.prod(mesh.shape[a] for a in axes if a in mesh.shape) * grad_accum
    if batch % split:
        raise ValueError(
            f"--batch-size {batch} does not split over the batch axes {axes} of mesh {describe_mesh(mesh)} "
            f"times --grad-accum {grad_accum} (= {split}); use a multiple of {split}, e.g. {split * max(1, batch // split)}"
        )


def optimizer(lr: float, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    return tx, schedule


def _run_record(config: TrainConfig, model: TransformerConfig, batch: int) -> dict[str, Any]:
    """What a checkpoint records of the run besides the Trainer's own (step, data position, seed)."""
    return {"batch_size": batch, "strategy": config.strategy, "mesh": config.mesh, "model": dataclasses.asdict(model)}


def _check_checkpoints(config: TrainConfig, model: TransformerConfig, steps: int) -> None:
    """Refuse, before anything is written, a resume that cannot work or a start that would overwrite."""
    if config.checkpoint_dir is None:
        if config.resume:
            raise ValueError("--resume needs --checkpoint-dir (where the run's checkpoints are)")
        return
    checkpointer = Checkpointer(config.checkpoint_dir)
    try:
        _check_saved_run(config, model, steps, checkpointer)
    finally:
        checkpointer.close()


def _check_saved_run(config: TrainConfig, model: TransformerConfig, steps: int, checkpointer: Checkpointer) -> None:
    step = checkpointer.latest_step()
    if not config.resume:
        if step is not None:
            raise ValueError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints (latest step "
                             f"{step}); pass --resume to continue it, or choose another directory")
        return
    if step is None:
        raise ValueError(f"--resume: no checkpoint in {checkpointer.directory}; run without --resume to start one")
    saved = checkpointer.record(step).get("model", {})
    wanted = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("remat", "compute_dtype")}
    if {k: saved.get(k) for k in wanted} != wanted:
        raise ValueError(f"--resume: the checkpoint in {checkpointer.directory} holds a different model "
                         f"({ {k: saved.get(k) for k in wanted if saved.get(k) != wanted[k]} }); use its --preset")
    if step >= steps:
        raise ValueError(f"the checkpoint is at step {step} and --steps is {steps}; raise --steps to train further")


def global_rows(rows: np.ndarray, sharding: Any) -> jax.Array:
    """Rows every process knows in full, as a global array (each process fills its own devices)."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def loss_with_bits_per_byte(model: TransformerLM, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """The next-byte loss in nats, and the same in bits per byte (what evaluation reports)."""
    loss = next_token_loss(model, batch)
    return loss, {"bits_per_byte": loss / math.log(2)}


def _header(corpus: Corpus, model: TransformerConfig, steps: int, batch: int) -> list[str]:
    return [
        f"data: {corpus.source}: {corpus.files} files, {corpus.train.size:,} train / "
        f"{corpus.validation.size:,} validation bytes" + (f", {len(corpus.skipped)} skipped" if corpus.skipped else "")
        + f"; unigram baseline {corpus.unigram_entropy():.4f} nats/byte",
        f"run: {steps} steps x {batch} sequences x {model.seq_len} bytes",
    ]


def prepare(config: TrainConfig) -> tuple[Trainer, Corpus, TransformerConfig, int, int]:
    """Check every setting and lay the model out, before any step or file write."""
    model, steps, batch, lr = _settings(config)
    strategy = get_strategy(config.strategy)
    mesh = DeviceMeshManager().create_device_mesh(config.mesh or default_mesh(strategy.name))
    strategy.check_mesh(mesh)
    _check_batch(batch, config.grad_accum, mesh, strategy.batch_axes)
    corpus = load_corpus(config.data, min_bytes=model.seq_len + 1)
    tx, schedule = optimizer(lr, steps)
    trainer = Trainer(lambda rngs: TransformerLM(model, rngs=rngs), tx, next_token_loss, mesh=mesh, strategy=strategy,
                      grad_accum=config.grad_accum, seed=config.seed, eval_loss_fn=loss_with_bits_per_byte,
                      learning_rate=schedule, name="shardax train")
    _check_checkpoints(config, model, steps)
    return trainer, corpus, model, steps, batch


def run(config: TrainConfig) -> TrainResult:
    """Train as ``config`` says; see the module docstring."""
    trainer, corpus, model, steps, batch = prepare(config)
    sampler = WindowSampler(corpus.train, model.seq_len, batch, config.seed)
    sharding = trainer.parallel.layout.batch()
    validation = [{"tokens": global_rows(rows, sharding)}
                  for rows in validation_batches(corpus.validation, model.seq_len, batch, config.eval_batches)]
    fit = trainer.fit(
        lambda step: sampler.global_batch(step, sharding), steps=steps, eval_data=validation,
        eval_every=config.eval_every, log_every=config.log_every, checkpoint_dir=config.checkpoint_dir,
        checkpoint_every=config.checkpoint_every, resume=config.resume, metrics=config.metrics,
        tokens_per_example=model.seq_len, record=_run_record(config, model, batch),
        header=_header(corpus, model, steps, batch),
    )
    if config.sample_bytes:  # every process takes part in the computation; process 0 prints
        prompt = bytes(corpus.validation[: min(48, model.seq_len // 2)])
        text = greedy_sample(trainer.parallel, fit.state, prompt, config.sample_bytes, model.seq_len)
        say("[bold]sample[/bold] (greedy, prompt from validation text):",
            (prompt + b"|" + text).decode("utf-8", errors="replace"))
    trained = fit.end_step - fit.start_step
    return TrainResult(trained, trained * batch * model.seq_len, fit.wall_s, fit.examples_per_sec * model.seq_len,
                       fit.best_eval_loss, fit.last_eval["loss"] if fit.last_eval else None, corpus.unigram_entropy(),
                       fit.state, trainer.parallel)
