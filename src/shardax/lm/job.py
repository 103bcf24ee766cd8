"""The main job: train the transformer LM on real text with any strategy.

``run(TrainConfig(...))`` is what ``shardax train`` calls. It is one client of ``Trainer``: it
checks the settings and the checkpoint directory, opens the data (bytes in memory, or token
shards; see ``lm/data.py``), asks its format what to train (a loss; or, for full DPO, a step
over the model and a frozen copy of its first weights, two parts of the run), hands the Trainer a
batch function of the step (the data position is the step) and the validation batches, and ends
with a seeded sample of text from the model trained.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from rich.markup import escape as rich_escape

from shardax.data.registry import DataFormat
from shardax.errors import Preempted, Stopped, UsageError
from shardax.lm.config import RunDefinition, check_values, resolve
from shardax.lm.data import open_data
from shardax.lm.models import lm_model
from shardax.lm.procedures import parts_record, procedure_of, run_trainer, trained_model
from shardax.lm.rundir import CHECKPOINTS, RunDirectory, run_directory, write_config, write_tokenizer
from shardax.lm.sampling import sample_model
from shardax.lm.settings import TrainConfig
from shardax.mesh import describe_mesh, resolve_mesh_shape
from shardax.models.presets import adapter_count, parameter_count
from shardax.models.transformer import TransformerConfig, attention_implementation
from shardax.parts import ParallelRun
from shardax.step.ema import ema_params
from shardax.trainer.checkpoint import Checkpointer
from shardax.trainer.display import say, show_summary
from shardax.trainer.trackers import parse_tracker
from shardax.trainer.trainer import Trainer


@dataclasses.dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float
    tokens_per_sec: float
    best_val_loss: float | None
    final_val_loss: float | None
    baselines: dict[str, float]  # the data format's, in its loss's unit: the first is the one to beat
    loss_unit: str
    state: Any
    parallel: ParallelRun  # the model laid out (or, for full DPO, the policy and its reference)
    directory: RunDirectory


def optimizer(lr: float, steps: int,
              ema: float | None = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The run's AdamW and schedule; with ``ema``, keeping a moving average of the weights last."""
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1),
                     *([ema_params(ema)] if ema is not None else []))
    return tx, schedule


def _saved_run(config: TrainConfig) -> tuple[dict[str, Any] | None, int | None, dict[str, Any]]:
    """The run record, step and whole record of the checkpoint to resume (``None``, ``None``,
    ``{}`` when starting fresh), after refusing, before anything is written, a resume that
    cannot work or a start that would overwrite."""
    if config.run.checkpoint_dir is None:
        return None, None, {}
    checkpointer = Checkpointer(config.run.checkpoint_dir)
    try:
        checkpointer.lock.check_free()  # another run writing it: say so first
        if not config.run.resume:
            checkpointer.refuse_fresh_start(_checkpoints_flag(config), "--resume")
            return None, None, {}
        step, _ = checkpointer.latest_good_step()  # damaged newer ones: the Trainer warns and sets them aside
        record = checkpointer.record(step)
        saved = record.get("run")
    finally:
        checkpointer.close()
    if not isinstance(saved, dict):
        raise UsageError(f"--resume: the checkpoint at step {step} in {config.run.checkpoint_dir} was not "
                         "written by shardax train (it has no run record); resume it with shardax.Trainer, "
                         "or start a new run")
    return saved, step, record


def _checkpoints_flag(config: TrainConfig) -> str:
    """How the user named where the checkpoints are: ``--run-dir D`` or ``--checkpoint-dir C``."""
    if config.run.run_dir and Path(config.run.checkpoint_dir) == Path(config.run.run_dir) / CHECKPOINTS:
        return f"--run-dir {config.run.run_dir}"
    return f"--checkpoint-dir {config.run.checkpoint_dir}"


def loop_note(config: TrainConfig, saved: dict[str, Any] | None, model: TransformerConfig) -> list[str]:
    """A line saying so when a new run lays its blocks in a loop by default (``blocks_in_a_loop``)."""
    chosen = config.model
    if saved is not None or chosen.scan_layers is not None or model.scan_layers or chosen.factory:
        return []
    return [f"blocks: in a Python loop, the default on GPUs under {config.parallelism.strategy} (steps "
            "1.14-1.27x faster than scanned on an H100, benchmark 24); --scan-layers scans them, compiling "
            "in time flat in depth"]


def _changes(record: dict[str, Any], config: TrainConfig, mesh: Mesh, model: TransformerConfig) -> list[str]:
    """A line naming how a resumed run is computed differently from when its checkpoint was saved
    (what may change on resume: it is allowed, and said)."""
    before = record.get("model") or {}
    pairs = [("strategy", record.get("strategy"), config.parallelism.strategy),
             ("mesh", record.get("mesh"), describe_mesh(mesh)),
             ("precision", before.get("compute_dtype"), model.compute_dtype),
             ("remat", before.get("remat"), model.remat),
             ("attention", before.get("attention"), model.attention),
             ("grad-accum", record.get("grad_accum"), config.parallelism.grad_accum)]
    changed = [f"{name} {old} -> {new}" for name, old, new in pairs if old is not None and old != new]
    return [f"changed since the checkpoint was saved: {'; '.join(changed)}"] if changed else []


# what a resumed run may compute differently; every other field of the model is its shape
COMPUTED = ("remat", "compute_dtype", "attention", "scan_layers")


def _check_same_model(record: dict[str, Any], run: RunDefinition, step: int | None,
                      config: TrainConfig) -> None:
    """A checkpoint whose model this shardax would build otherwise (a preset from before the presets
    became Llama-shaped) is refused in one line, before anything is read."""
    before = record.get("model") or {}
    differ = [name for name, value in dataclasses.asdict(run.model).items()
              if name in before and name not in COMPUTED and _listed(before[name]) != _listed(value)]
    if not differ:
        return
    held = ", ".join(f"{name} {_listed(before[name])}" for name in differ)
    built = ", ".join(f"{name} {_listed(getattr(run.model, name))}" for name in differ)
    raise UsageError(f"the checkpoint at step {step} in {config.run.checkpoint_dir} holds a model with "
                     f"{held}, where this shardax builds {built} (since 0.2 every preset is Llama-shaped, "
                     "and byte-level runs embed the end-of-document token); start a new run (without "
                     "--resume), or resume this one with the shardax that wrote it (0.1)")


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _check_not_finished(run: RunDefinition, step: int | None, config: TrainConfig) -> None:
    if step is not None and step >= run.train_to:
        raise UsageError(f"the run in {config.run.checkpoint_dir} is complete at step {step}; to train it "
                         f"further, pass --extend-to N with N > {step} (the learning rate stays at its final "
                         f"{run.lr / 10:g})")


def _check_tokenizer(data: DataFormat, saved: dict[str, Any] | None, step: int | None,
                     config: TrainConfig) -> None:
    """A resumed run reads data of the tokenizer it was trained with."""
    kept = (saved or {}).get("tokenizer_fingerprint")
    if saved is not None and kept != data.tokenizer_fingerprint:
        raise UsageError(f"the checkpoint at step {step} in {config.run.checkpoint_dir} was trained on "
                         f"{kept or 'bytes held in memory'} tokens (model vocabulary "
                         f"{saved.get('model_vocab')}), but its data now gives "
                         f"{data.tokenizer_fingerprint or 'bytes held in memory'} tokens (vocabulary "
                         f"{data.model_vocab}); resume with the data and tokenizer it was trained on")


def _header(data: DataFormat, model: TransformerConfig, steps: int, batch: int,
            init_from: str | None = None, factory: str | None = None) -> list[str]:
    kernel, why = attention_implementation(model)
    computed = "" if factory else f"; attention: {kernel} ({why})"  # a model of --model: its own
    lines = [data.header(), f"run: {steps} steps x {batch} sequences x {model.seq_len} {data.counted}"
             + computed]
    if init_from is not None:
        lines.insert(0,
                     f"model: fine-tuning the Hugging Face checkpoint {init_from} ({model.n_layers} layers, "
                     f"d_model {model.d_model}, {model.n_heads} heads / {model.kv_heads} key-value heads, "
                     f"vocabulary {model.vocab_size})")
    if model.lora_rank:
        lines.insert(1 if init_from else 0,
                     f"LoRA: rank {model.lora_rank}, alpha {model.lora_alpha or model.lora_rank:g} "
                     f"on {','.join(model.lora_targets)}: {adapter_count(model):,} adapter parameters train, "
                     f"the model's {parameter_count(model):,} stay frozen"
                     + (f" in {model.param_dtype}, as stored" if model.param_dtype != "float32" else ""))
    return lines


def prepare(config: TrainConfig) -> tuple[Trainer, DataFormat, RunDefinition, list[str]]:
    """Check every setting and lay the model out, before any step or file write; with the lines
    that say what a resumed run changes."""
    check_values(config)
    _check_mesh_uses_every_device(config.parallelism.mesh)
    saved, step, record = _saved_run(config)
    run = resolve(config, saved, platform=jax.default_backend())
    _check_not_finished(run, step, config)
    attention_implementation(run.model)  # --attention cudnn where it cannot run: refused here
    data = open_data(run.data, run.tokenizer, run.vocab_size, run.field, run.model.seq_len, run.chat_template,
                     run.data_format)
    if run.packing is not None:
        data.use_packing(run.packing)
    _check_tokenizer(data, saved, step, config)
    if run.init_from is None:
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=data.model_vocab))
    elif data.vocab > run.model.vocab_size:
        raise UsageError(f"--tokenizer {run.tokenizer} has {data.vocab} tokens but the model of --init-from "
                         f"{run.init_from} embeds {run.model.vocab_size}; give the tokenizer the model was "
                         "trained with")
    _check_same_model(record, run, step, config)
    model = run.model
    build, adapted, about = lm_model(run, data)  # shardax's transformer, or --model's
    example = {key: jax.ShapeDtypeStruct((run.batch_size, model.seq_len + 1), jnp.int32)
               for key in data.batch_keys}
    tx, schedule = optimizer(run.lr, run.steps, run.ema)
    # the Trainer resolves the strategy, mesh and microbatches once, and checks the batch against them
    common = {**config.parallelism.step_options(), "seed": run.seed, "learning_rate": schedule,
              "name": "shardax train", "example_batch": example, "trackers": _trackers(config.run.tracker)}
    trainer = run_trainer(procedure_of(data, run), build, adapted, tx, run, common)
    changes = _changes(record, config, trainer.mesh, model)
    return trainer, data, run, about + loop_note(config, saved, model) + changes


def _check_mesh_uses_every_device(mesh: str | None) -> None:
    """``--mesh`` over fewer devices than the run has would leave the others idle: refused, naming both."""
    if mesh is None:
        return
    devices = jax.device_count()
    used = math.prod(size for _, size in resolve_mesh_shape(mesh, devices))
    if used != devices:
        raise UsageError(f"--mesh {mesh} uses {used} of the {devices} devices, and the others would sit "
                         f"idle; give sizes that multiply to {devices} (e.g. data={devices}, or data=-1 with "
                         f"the other axes), or --devices {used} to simulate {used}")


def _trackers(specs: list[str] | None) -> list[str]:
    """``--tracker`` values checked, named as the flag (the Trainer checks them again as ``trackers``)."""
    for spec in specs or ():
        parse_tracker(spec, label="--tracker")
    return list(specs or ())


def run(config: TrainConfig) -> TrainResult:
    """Train as ``config`` says; see the module docstring."""
    settings = config.run
    where = run_directory(settings.run_dir, config.parallelism.strategy, settings.checkpoint_dir,
                          settings.metrics, settings.resume)
    config = config.replace(checkpoint_dir=str(where.checkpoint_dir), metrics=str(where.metrics))
    try:
        trainer, data, run, changes = prepare(config)  # every setting checked: from here on, the run writes
        fit = _fit(trainer, data, run, config, where, changes)
    except Preempted:  # stopped by a signal after a checkpoint: say how to go on
        say(f"to resume: {where.resume_command()}")
        raise
    except Stopped as stop:  # before fit took over the signals
        raise Stopped(stop.signal_name, "before training began: this run wrote nothing") from None
    finally:
        where.release()  # a new run directory the run was refused (or stopped) before writing in goes
    try:
        return _close(fit, trainer, data, run, config, where)
    except Stopped as stop:  # the run is complete: what is left is its sample and summary
        raise Stopped(stop.signal_name, f"after the run's last step ({fit.end_step}); its checkpoint and "
                                        f"metrics are in {where.path}") from None


def _close(fit: Any, trainer: Trainer, data: DataFormat, run: RunDefinition, config: TrainConfig,
           where: RunDirectory) -> TrainResult:
    """A finished run's closing sample and summary, and what ``run`` returns."""
    model, batch = run.model, run.batch_size
    settings = config.run
    if settings.sample_bytes:  # every process takes part in the computation; process 0 prints
        prompt = _whole_lines(data, data.prompt(min(48, model.seq_len // 2)))
        ids = sample_model(trained_model(trainer, fit.state), prompt, settings.sample_bytes, model.seq_len,
                           vocab=data.vocab, temperature=settings.sample_temperature,
                           top_k=settings.sample_top_k, seed=run.seed)
        how = ("greedy" if settings.sample_temperature == 0 else
               f"temperature {settings.sample_temperature:g}, top-k {settings.sample_top_k or 'all'}, seed "
               f"{run.seed}")
        text = data.decode(ids)
        # conversations: the reply ends where the template ends a turn
        stop = data.end_of_turn
        text = text[: text.index(stop) + len(stop)] if stop and stop in text else text
        say(f"[bold]sample[/bold] ({how}; the prompt, from validation text, ends at |):",
            rich_escape(data.decode(prompt) + "|" + text), "")
    rows = {name: value for name, value in fit.summary.items() if name not in ("checkpoints", "metrics")}
    rows["run directory"] = f"{where.path}: {where.contents()}"
    if fit.last_eval is not None and "bits_per_byte" in fit.last_eval and "validation loss" in rows:
        rows["validation loss"] += f"; {fit.last_eval['bits_per_byte']:.3f} bits/byte"
    show_summary(trainer.name, rows)
    say(f"to train further: {where.resume_command(extend_to=fit.end_step + run.steps)}")
    trained = fit.end_step - fit.start_step
    return TrainResult(trained, trained * batch * model.seq_len, fit.wall_s,
                       fit.examples_per_sec * model.seq_len, fit.best_eval_loss,
                       fit.last_eval["loss"] if fit.last_eval else None, data.baselines(), data.unit,
                       fit.state, trainer.parallel, where)


def _whole_lines(data: DataFormat, prompt: list[int]) -> list[int]:
    """``prompt`` cut after its last line break (the sample then starts a line), if it has one."""
    for end in range(len(prompt), 0, -1):
        if data.decode(prompt[:end]).endswith("\n"):
            return prompt[:end]
    return prompt


def _fit(trainer: Trainer, data: DataFormat, run: RunDefinition, config: TrainConfig,
         where: RunDirectory, changes: list[str]):
    """The Trainer's loop over the run's data, writing into ``where``; the summary is left to ``run``."""
    model, batch = run.model, run.batch_size
    sharding = trainer.parallel.layout.batch()
    done = config.run
    validation = data.validation(model.seq_len, batch, done.eval_batches, sharding)
    settings = {**config.flat(), **_run_settings(run)}
    return trainer.fit(
        data.batches(model.seq_len, batch, run.seed, sharding), steps=run.train_to, eval_data=validation,
        eval_every=done.eval_every, log_every=done.log_every, checkpoint_dir=done.checkpoint_dir,
        checkpoint_every=done.checkpoint_every, keep_checkpoints=done.keep_checkpoints,
        resume=done.resume, metrics=done.metrics, tokens_per_example=model.seq_len,
        on_nonfinite=config.optimizer.on_nonfinite,
        on_log=_config_writer(where, settings, data, run.train_to),
        record={"run": {**run.record(), "tokenizer_fingerprint": data.tokenizer_fingerprint,
                        "model_vocab": data.model_vocab},
                "strategy": config.parallelism.strategy, "mesh": describe_mesh(trainer.parallel.mesh),
                "grad_accum": config.parallelism.grad_accum, "model": run.model_record(),
                "parts": parts_record(trainer)},
        header=_header(data, model, run.train_to, batch, run.init_from, run.factory) + changes
        + [f"run directory: {where.path} (resume it with: {where.resume_command()})"],
        summary=False, loss_unit=data.unit, baselines=data.baselines(),
    )


def _config_writer(where: RunDirectory, settings: dict[str, Any], data: DataFormat,
                   train_to: int):
    """An ``on_log`` that writes the run directory's config.yaml and tokenizer.json (process 0) once
    the first step is done: a run refused before it trains (a resume whose checkpoint will not
    restore, a metrics path that cannot be written) leaves the directory as it was. The tokenizer
    is what ``shardax export`` gives the exported checkpoint."""
    if jax.process_index() != 0:
        return None
    written = []

    def on_log(record: dict[str, Any]) -> None:
        if not written:
            write_config(where.config, settings, train_to)
            template = data.template  # conversations: what generate --chat renders with
            write_tokenizer(where.path, data.tokenizer.to_hf_json(), template and template.source)
            written.append(True)

    return on_log


def _run_settings(run: RunDefinition) -> dict[str, Any]:
    """The resolved settings that define the run, as ``TrainConfig`` fields (for its config.yaml)."""
    return {name: value for name, value in run.record().items() if name != "train_to"}
