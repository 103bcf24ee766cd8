"""The main job: train the transformer LM on bytes of real text with any strategy.

``run(TrainConfig(...))`` is what ``shardax train`` calls: it lays the model out on the mesh,
restores or initialises the state, runs the steps with progress, evaluation, metrics and
checkpoints, and ends with a greedy sample and a summary.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from shardax.data.batches import WindowSampler, validation_batches
from shardax.data.corpus import Corpus, load_corpus
from shardax.mesh import DeviceMeshManager, describe_mesh
from shardax.model_parallel import ParallelModel, parallelize
from shardax.models.presets import get_preset, parameter_count
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss
from shardax.sharding.report import report
from shardax.sharding.strategies import default_mesh, get_strategy
from shardax.train.checkpoint import Checkpointer
from shardax.train.display import RunDisplay, summary_rows
from shardax.train.metrics import MetricsLog
from shardax.train.sampling import greedy_sample

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


def _record(config: TrainConfig, model: TransformerConfig, step: int, batch: int) -> dict[str, Any]:
    return {"step": step, "data_position": step, "seed": config.seed,
            "rng": np.asarray(jax.random.key_data(jax.random.key(config.seed))).tolist(),
            "batch_size": batch, "strategy": config.strategy, "mesh": config.mesh,
            "model": dataclasses.asdict(model)}


def _restore(checkpointer: Checkpointer, parallel: ParallelModel, model: TransformerConfig,
             display: RunDisplay) -> tuple[Any, int]:
    step = checkpointer.latest_step()
    if step is None:
        raise ValueError(f"--resume: no checkpoint in {checkpointer.directory}; run without --resume to start one")
    saved = checkpointer.record(step)["model"]
    wanted = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("remat", "compute_dtype")}
    if {k: saved.get(k) for k in wanted} != wanted:
        raise ValueError(f"--resume: the checkpoint in {checkpointer.directory} holds a different model "
                         f"({ {k: saved[k] for k in wanted if saved.get(k) != wanted[k]} }); use its --preset")
    state, _ = checkpointer.restore(step, parallel.abstract_state, parallel.state_shardings)
    display.print(f"resumed from step {step} of {checkpointer.directory}")
    return state, step


def host_float(value: jax.Array) -> float:
    """A replicated scalar as a Python float, on every process (no cross-host fetch needed)."""
    return float(np.asarray(value.addressable_data(0)))


def global_rows(rows: np.ndarray, sharding: Any) -> jax.Array:
    """Rows every process knows in full, as a global array (each process fills its own devices)."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def _evaluate(eval_step, state, batches, parallel: ParallelModel) -> float:
    sharding = parallel.layout.batch()
    losses = [host_float(eval_step(state, {"tokens": global_rows(rows, sharding)})) for rows in batches]
    return float(np.mean(losses))


def _describe(display: RunDisplay, parallel: ParallelModel, model: TransformerConfig, corpus: Corpus,
              steps: int, batch: int) -> None:
    summary = report(parallel).summary()
    display.print(
        f"[bold]shardax train[/bold]: {parameter_count(model) / 1e6:.2f}M parameters, strategy "
        f"[bold]{parallel.strategy.name}[/bold] ({parallel.strategy.description}) on mesh "
        f"{describe_mesh(parallel.mesh)} ({parallel.mesh.devices.size} {jax.devices()[0].platform} devices)",
        f"state: {summary}",
        f"data: {corpus.source}: {corpus.files} files, {corpus.train.size:,} train / "
        f"{corpus.validation.size:,} validation bytes"
        + (f", {len(corpus.skipped)} skipped" if corpus.skipped else ""),
        f"run: {steps} steps x {batch} sequences x {model.seq_len} bytes",
    )
    for note in parallel.layout.notes()[:5]:
        display.print(f"  replicated or moved: {note}")


def prepare(config: TrainConfig) -> tuple[ParallelModel, Corpus, TransformerConfig, int, int, Any]:
    """Check every setting and build the laid-out model, before any step or file write."""
    model, steps, batch, lr = _settings(config)
    strategy = get_strategy(config.strategy)
    mesh = DeviceMeshManager().create_device_mesh(config.mesh or default_mesh(strategy.name))
    strategy.check_mesh(mesh)
    _check_batch(batch, config.grad_accum, mesh, strategy.batch_axes)
    corpus = load_corpus(config.data, min_bytes=model.seq_len + 1)
    tx, schedule = optimizer(lr, steps)
    parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), tx, mesh, strategy)
    return parallel, corpus, model, steps, batch, schedule


def _start(config: TrainConfig, parallel: ParallelModel, model: TransformerConfig,
           display: RunDisplay) -> tuple[Any, int, Checkpointer | None]:
    checkpointer = Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None
    if config.resume:
        if checkpointer is None:
            raise ValueError("--resume needs --checkpoint-dir (where the run's checkpoints are)")
        state, step = _restore(checkpointer, parallel, model, display)
        return state, step, checkpointer
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ValueError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints (latest step "
                         f"{checkpointer.latest_step()}); pass --resume to continue it, or choose another directory")
    return parallel.init(seed=config.seed), 0, checkpointer


def run(config: TrainConfig) -> TrainResult:
    """Train as ``config`` says; see the module docstring."""
    parallel, corpus, model, steps, batch, schedule = prepare(config)
    display = RunDisplay(steps)
    _describe(display, parallel, model, corpus, steps, batch)
    state, start, checkpointer = _start(config, parallel, model, display)
    if start >= steps:
        raise ValueError(f"the checkpoint is at step {start} and --steps is {steps}; raise --steps to train further")
    metrics = MetricsLog(config.metrics if jax.process_index() == 0 else None,
                         resume_from=start if config.resume else None)
    sampler = WindowSampler(corpus.train, model.seq_len, batch, config.seed)
    val_batches = validation_batches(corpus.validation, model.seq_len, batch, config.eval_batches)
    train_step = parallel.train_step(next_token_loss, grad_accum=config.grad_accum)
    eval_step = parallel.eval_step(next_token_loss)
    baseline = corpus.unigram_entropy()
    best_val, val_loss = None, None
    tokens_per_step = batch * model.seq_len
    began = time.perf_counter()
    mark, mark_step, compiled_at = began, start, None
    for step in range(start + 1, steps + 1):
        state, step_metrics = train_step(state, sampler.global_batch(step - 1, parallel.layout.batch()))
        record = None
        if step % config.log_every == 0 or step == steps or step == start + 1:
            loss = host_float(step_metrics["loss"])  # waits for the step
            now = time.perf_counter()
            elapsed = (now - mark) / (step - mark_step)  # the first record includes compilation
            compiled_at = compiled_at or now
            record = {"step": step, "loss": loss, "tokens_per_sec": tokens_per_step / elapsed,
                      "step_time_s": elapsed, "lr": float(schedule(step - 1)),
                      "grad_norm": host_float(step_metrics["grad_norm"])}
            mark, mark_step = now, step
            display.step(step, record)
        else:
            display.advance(step)
        if (config.eval_every and step % config.eval_every == 0) or step == steps:
            val_loss = _evaluate(eval_step, state, val_batches, parallel)
            best_val = val_loss if best_val is None else min(best_val, val_loss)
            display.evaluation(step, val_loss, val_loss / math.log(2), baseline)
            record = (record or {"step": step}) | {"val_loss": val_loss, "val_bits_per_byte": val_loss / math.log(2)}
        if record is not None:
            metrics.write(record)
        if checkpointer is not None and ((config.checkpoint_every and step % config.checkpoint_every == 0)
                                         or step == steps):
            checkpointer.save(step, state, _record(config, model, step, batch))
    wall = time.perf_counter() - began
    trained = time.perf_counter() - (compiled_at or began)
    if checkpointer is not None:
        checkpointer.close()
    image = metrics.plot()
    if config.sample_bytes:  # every process takes part in the computation; process 0 prints
        prompt = bytes(corpus.validation[: min(48, model.seq_len // 2)])
        text = greedy_sample(parallel, state, prompt, config.sample_bytes, model.seq_len)
        display.print("[bold]sample[/bold] (greedy, prompt from validation text):",
                      (prompt + b"|" + text).decode("utf-8", errors="replace"))
    measured_steps = steps - start - 1  # after the first (compiling) step
    tokens_per_sec = tokens_per_step * measured_steps / trained if trained > 0 and measured_steps else 0.0
    layout = report(parallel)
    display.summary(summary_rows(steps=steps - start, tokens=(steps - start) * tokens_per_step, wall_s=wall,
                                 tokens_per_sec=tokens_per_sec, best_val=best_val, baseline=baseline,
                                 bytes_per_device=layout.bytes_per_device, replicated_bytes=layout.replicated_bytes))
    if image is not None:
        display.print(f"metrics: {config.metrics}, curves: {image}")
    return TrainResult(steps - start, (steps - start) * tokens_per_step, wall, tokens_per_sec, best_val, val_loss,
                       baseline, state, parallel)
