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
from shardax.errors import UsageError
from shardax.lm.config import Run, TrainConfig, check_values, resolve
from shardax.lm.sampling import greedy_sample
from shardax.mesh import DeviceMeshManager, describe_mesh
from shardax.model_parallel import ParallelModel
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss
from shardax.sharding.strategies import default_mesh, get_strategy
from shardax.trainer.checkpoint import Checkpointer
from shardax.trainer.display import say
from shardax.trainer.trainer import Trainer


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


def _check_batch(batch: int, grad_accum: int, mesh: Mesh, axes: tuple[str, ...]) -> None:
    split = math.prod(mesh.shape[a] for a in axes if a in mesh.shape) * grad_accum
    if batch % split:
        raise UsageError(
            f"--batch-size {batch} does not split over the batch axes {axes} of mesh {describe_mesh(mesh)} "
            f"times --grad-accum {grad_accum} (= {split}); use a multiple of {split}, e.g. {split * max(1, batch // split)}"
        )


def optimizer(lr: float, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    return tx, schedule


def _saved_run(config: TrainConfig) -> tuple[dict[str, Any] | None, int | None]:
    """The run record and step of the checkpoint to resume (``None`` when starting fresh), after
    refusing, before anything is written, a resume that cannot work or a start that would overwrite."""
    if config.checkpoint_dir is None:
        return None, None
    checkpointer = Checkpointer(config.checkpoint_dir)
    try:
        step = checkpointer.latest_step()
        if not config.resume:
            if step is not None:
                raise UsageError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints (latest step "
                                 f"{step}); pass --resume to continue it, or choose another directory")
            return None, None
        step, _ = checkpointer.latest_good_step()  # damaged newer ones: the Trainer warns and sets them aside
        saved = checkpointer.record(step).get("run")
    finally:
        checkpointer.close()
    if not isinstance(saved, dict):
        raise UsageError(f"--resume: the checkpoint at step {step} in {config.checkpoint_dir} was not written by "
                         "shardax train (it has no run record); resume it with shardax.Trainer, or start a new run")
    return saved, step


def _check_not_finished(run: Run, step: int | None, config: TrainConfig) -> None:
    if step is not None and step >= run.train_to:
        raise UsageError(f"the run in {config.checkpoint_dir} is complete at step {step}; to train it further, "
                         f"pass --extend-to N with N > {step} (the learning rate stays at its final {run.lr / 10:g})")


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


def prepare(config: TrainConfig) -> tuple[Trainer, Corpus, Run]:
    """Check every setting and lay the model out, before any step or file write."""
    check_values(config)
    saved, step = _saved_run(config)
    run = resolve(config, saved)
    _check_not_finished(run, step, config)
    strategy = get_strategy(config.strategy)
    mesh = DeviceMeshManager().create_device_mesh(config.mesh or default_mesh(strategy.name))
    strategy.check_mesh(mesh)
    _check_batch(run.batch_size, config.grad_accum, mesh, strategy.batch_axes)
    corpus = load_corpus(run.data, min_bytes=run.model.seq_len + 1)
    tx, schedule = optimizer(run.lr, run.steps)
    model = run.model
    trainer = Trainer(lambda rngs: TransformerLM(model, rngs=rngs), tx, next_token_loss, mesh=mesh, strategy=strategy,
                      grad_accum=config.grad_accum, seed=run.seed, eval_loss_fn=loss_with_bits_per_byte,
                      learning_rate=schedule, name="shardax train")
    return trainer, corpus, run


def run(config: TrainConfig) -> TrainResult:
    """Train as ``config`` says; see the module docstring."""
    trainer, corpus, run = prepare(config)
    model, batch = run.model, run.batch_size
    sampler = WindowSampler(corpus.train, model.seq_len, batch, run.seed)
    sharding = trainer.parallel.layout.batch()
    validation = [{"tokens": global_rows(rows, sharding)}
                  for rows in validation_batches(corpus.validation, model.seq_len, batch, config.eval_batches)]
    fit = trainer.fit(
        lambda step: sampler.global_batch(step, sharding), steps=run.train_to, eval_data=validation,
        eval_every=config.eval_every, log_every=config.log_every, checkpoint_dir=config.checkpoint_dir,
        checkpoint_every=config.checkpoint_every, keep_checkpoints=config.keep_checkpoints, resume=config.resume,
        metrics=config.metrics, tokens_per_example=model.seq_len, on_nonfinite=config.on_nonfinite,
        record={"run": run.record(), "strategy": config.strategy, "mesh": config.mesh,
                "model": dataclasses.asdict(model)},
        header=_header(corpus, model, run.train_to, batch),
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
