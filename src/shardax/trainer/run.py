"""One ``Trainer.fit`` call: where it starts (fresh or from a checkpoint), its loop, what it writes.

The loop takes a step, then, as the settings say, logs a record, evaluates and starts an
asynchronous checkpoint. The last step always gets all three, including when the data runs
out before ``steps``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from shardax.errors import NonFiniteError, Preempted, UsageError
from shardax.sharding.report import format_bytes, report
from shardax.step.state import TrainState
from shardax.trainer.checkpoint import Checkpointer
from shardax.trainer.clock import Clock
from shardax.trainer.display import RunDisplay, show_summary
from shardax.trainer.metrics import MetricsLog, finite_or_none
from shardax.trainer.preemption import StopSignals
from shardax.trainer.samples import SampleFn, grid, image_batches, write_grid
from shardax.trainer.settings import FitSettings
from shardax.trainer.sources import BatchSource
from shardax.trainer.trackers import Tracker, open_tracker


class TrainerLike(Protocol):
    """What a run needs of ``shardax.Trainer`` (which this module does not import: the Trainer
    starts runs, a run does not make Trainers). A run reads the trainer's state and never writes
    it: ``Trainer.fit`` takes the run's final ``FitRun.state``."""

    @property
    def state(self) -> TrainState | None: ...

    name: str
    seed: int
    parallel: Any
    trackers: list[Any]
    learning_rate: Any

    def init(self) -> TrainState: ...

    def train_step(self,
                   on_nonfinite: str = "stop") -> Callable[[TrainState, Any], tuple[TrainState, dict]]: ...

    def place(self, batch: Any) -> Any: ...

    def evaluate(self, data: Any, state: TrainState | None = None, *,
                 ema: bool = False) -> dict[str, float]: ...

    def title(self) -> str: ...

    def for_sampling(self, state: TrainState) -> Any: ...


def host_float(value: jax.Array) -> float:
    """A replicated scalar as a Python float, on every process (no cross-host fetch needed)."""
    return float(np.asarray(value.addressable_data(0)))


def batch_rows(batch: Any) -> int:
    leaves = [leaf for leaf in jax.tree.leaves(batch) if np.ndim(leaf)]
    return int(np.shape(leaves[0])[0]) if leaves else 1


@dataclasses.dataclass
class FitResult:
    """What ``Trainer.fit`` did.

    Attributes:
      state: the final ``TrainState`` (also ``trainer.state``).
      start_step, end_step: the step the run started from (after a resume) and reached.
      history: every logged record (the metrics file's lines of this run).
      last_eval, best_eval_loss: the last evaluation's metrics and the lowest validation loss.
      wall_s: seconds from the first step to the last checkpoint written.
      examples_per_sec: throughput after the first (compiling) step.
      summary: the closing table's rows (printed unless ``fit(summary=False)``).
      plot: the PNG of the curves beside the metrics file (``None`` without one).
    """

    state: TrainState
    start_step: int
    end_step: int
    history: list[dict[str, Any]]
    last_eval: dict[str, float] | None
    best_eval_loss: float | None
    wall_s: float
    examples_per_sec: float
    summary: dict[str, str] = dataclasses.field(default_factory=dict)
    plot: Path | None = None


@dataclasses.dataclass
class FitRun:
    """One ``fit``: its settings, its state as it trains, and what it writes to."""

    trainer: TrainerLike
    settings: FitSettings
    source: BatchSource
    state: TrainState
    start_step: int
    display: RunDisplay
    metrics: MetricsLog
    trackers: list[Tracker]
    checkpointer: Checkpointer | None
    notes: list[str]
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    samples: SampleFn | None = None
    last_eval: dict[str, float] | None = None
    best_eval_loss: float | None = None

    @classmethod
    def start(cls, trainer: TrainerLike, source: BatchSource, settings: FitSettings,
              samples: SampleFn | None = None) -> FitRun:
        """Restore or initialise the state (the settings were checked as they were made); nothing
        is written before."""
        checkpointer = (Checkpointer(settings.checkpoint_dir, keep=settings.keep_checkpoints)
                        if settings.checkpoint_dir else None)
        try:
            return dataclasses.replace(cls._start(trainer, source, checkpointer, settings), samples=samples)
        except BaseException:
            if checkpointer is not None:
                checkpointer.close()
            raise

    @classmethod
    def _start(cls, trainer: TrainerLike, source: BatchSource, checkpointer: Checkpointer | None,
               settings: FitSettings) -> FitRun:
        notes = []
        if settings.resume:
            if checkpointer.directory.is_dir():
                checkpointer.hold()  # before anything is read, set aside or written
            state, restored = _restore(trainer, checkpointer, source)
            notes += restored
        else:
            if checkpointer is not None:
                checkpointer.refuse_fresh_start(f"checkpoint directory {checkpointer.directory}",
                                                "`resume=True`")
            state = trainer.state if trainer.state is not None else trainer.init()
        if checkpointer is not None:
            checkpointer.make_writable()
            notes += _took_over(checkpointer)
        start = int(jax.device_get(state.step))
        if settings.steps is not None and start >= settings.steps:
            raise UsageError(f"the state is at step {start} and `steps={settings.steps}`; raise steps to "
                             "train further")
        first = jax.process_index() == 0
        metrics_log = MetricsLog(settings.metrics if first else None,
                                 resume_from=start if settings.resume else None)
        if metrics_log.note:
            notes.append(metrics_log.note)
        return cls(
            trainer=trainer, settings=settings, source=source, state=state, start_step=start,
            display=RunDisplay(settings.steps, start, title=trainer.name), metrics=metrics_log,
            trackers=_open_trackers(trainer, settings.tensorboard, settings.record) if first else [],
            checkpointer=checkpointer, notes=notes,
        )

    def loop(self, evaluations: Callable | None, on_log: Callable | None, stops: StopSignals) -> FitResult:
        """Step until ``steps`` (or the data's end), then what the last step gets, and the summary.
        A stop signal (``stops``) that came before a step ends the run after it, with its checkpoint."""
        settings, step_fn = self.settings, self.trainer.train_step(self.settings.on_nonfinite)
        step, done, step_metrics = self.start_step, set(), {}
        clock = Clock(step, settings.tokens_per_example)
        while settings.steps is None or step < settings.steps:
            batch = self.source.next()
            if batch is None:
                break
            placed = self.trainer.place(batch)
            self.state, step_metrics = step_fn(self.state, placed)
            step += 1
            clock.count(batch_rows(placed))
            due = settings.due(step, step == self.start_step + 1, evaluations is not None,
                               self.checkpointer is not None, self.samples is not None)
            self._after_step(step, step_metrics, clock, due, evaluations, on_log)
            done = {name for name, wanted in due.items() if wanted}
            if stops.reached(step):
                self._stop(step, "save" in done, stops.received)
        if step == self.start_step:
            raise UsageError("the data gave no batches; give at least one batch to train on")
        if settings.steps is not None and step < settings.steps:
            self.display.print(f"the data ran out after step {step} (of {settings.steps})")
        final = {"log": True, "eval": evaluations is not None, "sample": self.samples is not None,
                 "save": self.checkpointer is not None}
        missing = {name: wanted and name not in done for name, wanted in final.items()}
        if any(missing.values()):  # the data ran out: the last step gets what a last step gets
            self._after_step(step, step_metrics, clock, missing, evaluations, on_log)
        self._check_finite(step)
        result = self._finish(step, clock)
        if stops.received is not None and jax.process_count() == 1:
            # while the last step was evaluated or saved
            self._stop(step, True, stops.received)
        return result

    def _finish(self, step: int, clock: Clock) -> FitResult:
        settings = self.settings
        wall = clock.finish(self.checkpointer)
        rows = self._summary(step, clock, wall, settings.loss_unit, settings.baselines or {})
        image = self.metrics.plot(title=self.trainer.title(), loss_unit=settings.loss_unit,
                                  baselines=settings.baselines)
        if image is not None:
            rows["metrics"] = f"{self.metrics.path}, curves {image}"
        self.display.close()
        if settings.summary:
            show_summary(self.trainer.name, rows)
        return FitResult(self.state, self.start_step, step, self.history, self.last_eval, self.best_eval_loss,
                         wall, clock.examples_per_sec(step), rows, image)

    def _check_finite(self, step: int) -> None:
        """Stop, naming the step, once a step's loss or gradient norm was not finite
        (``on_nonfinite="stop"``)."""
        if self.settings.on_nonfinite != "stop":
            return
        skipped = int(host_float(self.state.skipped))
        if not skipped:
            return
        first = step - skipped + 1
        kept = "no checkpoint_dir was given"
        if self.checkpointer is not None:
            self.checkpointer.wait()
            latest = self.checkpointer.latest_step()
            kept = (f"the last good checkpoint is step {latest} in {self.checkpointer.directory}"
                    if latest is not None
                    else f"no checkpoint was written to {self.checkpointer.directory} before it")
        self.display.close()
        raise NonFiniteError(f"step {first}: the loss or gradient norm is NaN or infinite, so its update "
                             f"(and every later one) was not applied; {kept}; lower the learning rate or "
                             "check that step's batch, or skip such steps (on_nonfinite='skip', "
                             "--on-nonfinite skip)")

    def _stop(self, step: int, saved: bool, received: str | None) -> None:
        """SIGTERM/SIGINT: after a checkpoint of this step (unless it holds a bad state), exit 75."""
        self._check_finite(step)
        if self.checkpointer is not None:
            if not saved:
                self._save(step)
            self.checkpointer.wait()
            where = f"checkpoint of step {step} in {self.checkpointer.directory}; resume from it to go on"
        else:
            where = "nothing was saved (no checkpoint directory)"
        message = f"stopped by {received or 'a signal'} after step {step}: {where}"
        self.display.close()
        self.display.print(message)
        raise Preempted(message)

    def _after_step(self, step: int, step_metrics: dict, clock: Clock, due: dict[str, bool],
                    evaluations: Callable | None, on_log: Callable | None) -> None:
        if any(due.values()):
            self._check_finite(step)
        record = None
        if due["log"]:
            values = {name: host_float(value) for name, value in step_metrics.items()}
            # the loss first, where there is one
            first = {"loss": values.pop("loss")} if "loss" in values else {}
            record = {"step": step, **first, **values, **clock.tick(step)}
            if self.trainer.learning_rate is not None:
                rate = self.trainer.learning_rate
                record["lr"] = float(rate(step - 1) if callable(rate) else rate)
            self.display.step(step, record)
        else:
            self.display.advance(step)
        if due["eval"]:
            began = time.perf_counter()
            self.last_eval = self.trainer.evaluate(evaluations, self.state, ema=self.settings.eval_ema)
            clock.pause(time.perf_counter() - began)
            loss = self.last_eval.get("loss")
            if loss is not None:
                self.best_eval_loss = loss if self.best_eval_loss is None else min(self.best_eval_loss, loss)
            evaluated = {f"val_{name}": value for name, value in self.last_eval.items()}
            record = (record or {"step": step}) | evaluated
            self.display.evaluation(step, evaluated)
        if record is not None:
            record = finite_or_none(record)  # JSON has no NaN: a non-finite value is written as null
            self.history.append(record)
            self.metrics.write(record)
            for tracker in self.trackers:
                tracker.write(record)
            if on_log is not None:
                on_log(record)
        if due["sample"]:
            began = time.perf_counter()
            self._sample(step)
            clock.pause(time.perf_counter() - began)
        if due["save"]:
            self._save(step)

    def _sample(self, step: int) -> None:
        """The samples hook on the (averaged) model; process 0 writes each batch as a PNG grid and
        hands it to the trackers that take images."""
        batches = image_batches(self.samples(self.trainer.for_sampling(self.state), step))
        if jax.process_index() != 0:
            return
        written = []
        for name, images in batches.items():
            image = grid(images)
            written.append(str(write_grid(Path(self.settings.samples_path), name, step, image)))
            for tracker in self.trackers:
                if callable(getattr(tracker, "write_image", None)):
                    tracker.write_image(f"samples/{name}", image, step)
        self.display.print(f"[bold]samples[/bold] step {step}: {', '.join(written)}")

    def _save(self, step: int) -> None:
        record = {"step": step, "data": self.source.record(), "seed": self.trainer.seed,
                  "processes": jax.process_count(), **(self.settings.record or {})}
        self.checkpointer.save(step, self.state, record, data=self.source.save_args())

    def _summary(self, step: int, clock: Clock, wall: float, unit: str | None,
                 baselines: dict[str, float]) -> dict[str, str]:
        layout = report(self.trainer.parallel)
        rows = {"steps": f"{step - self.start_step} (to step {step})", "examples": f"{clock.examples:,}"}
        if clock.tokens_per_example:
            rows["tokens"] = f"{clock.examples * clock.tokens_per_example:,}"
        rows["wall time"] = f"{wall:.1f} s"
        rows["throughput"] = clock.throughput(step)
        unit = f" {unit}" if unit else ""
        if self.last_eval is not None and "loss" in self.last_eval:
            rows["validation loss"] = f"{self.last_eval['loss']:.4f}{unit} (best {self.best_eval_loss:.4f})"
        for name, value in baselines.items():
            rows[f"{name} baseline"] = f"{value:.4f}{unit}"
        rows["state per device"] = (f"{format_bytes(layout.bytes_per_device)} "
                                    f"(replicated: {format_bytes(layout.replicated_bytes)})")
        if self.checkpointer is not None:
            rows["checkpoints"] = f"{self.checkpointer.directory} (latest step {step})"
        return rows

    def close(self) -> None:
        self.display.close()
        for tracker in self.trackers:
            tracker.close()
        if self.checkpointer is not None:
            self.checkpointer.close()


def _open_trackers(trainer: TrainerLike, tensorboard: str | None,
                   record: dict[str, Any] | None) -> list[Tracker]:
    """The trainer's trackers (and ``fit(tensorboard=DIR)``'s), opened on process 0; any that
    opened are closed again if one fails."""
    specs = [*trainer.trackers, *([f"tensorboard:{tensorboard}"] if tensorboard else [])]
    opened: list[Tracker] = []
    try:
        for spec in specs:
            opened.append(open_tracker(spec, name=trainer.name, settings=dict(record or {})))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened


def _took_over(checkpointer: Checkpointer) -> list[str]:
    """A note when this run took over the lock a dead run left on the checkpoint directory."""
    dead = checkpointer.lock.took_over
    if not dead:
        return []
    return [f"took over the lock of {checkpointer.directory} that a run which is no longer running left "
            f"(host {dead.get('host', '?')}, pid {dead.get('pid', '?')}, since {dead.get('since', '?')})"]


def _restore(trainer: TrainerLike, checkpointer: Checkpointer,
             source: BatchSource) -> tuple[TrainState, list[str]]:
    """Restore the latest good checkpoint into the trainer's layout and the data source's position;
    newer damaged ones are set aside (renamed ``<step>.damaged``), each with a warning."""
    step, damaged = checkpointer.latest_good_step()
    notes = [f"[bold]warning[/bold]: checkpoint step {bad} in {checkpointer.directory} is damaged "
             f"({problem}); resuming from step {step}, and keeping it as {bad}.damaged"
             for bad, problem in damaged.items()]
    checkpointer.set_aside(list(damaged))
    saved = checkpointer.record(step).get("data", {})
    if saved.get("kind", source.kind) != source.kind:
        raise UsageError(f"the checkpoint in {checkpointer.directory} was saved reading data of kind "
                         f"{saved['kind']!r}, this run reads {source.kind!r}; resume with the same kind of "
                         "data source")
    parallel = trainer.parallel
    try:
        state, record = checkpointer.restore(step, parallel.abstract_state, parallel.state_shardings,
                                             data=source.restore_args())
    except FileNotFoundError as error:
        raise UsageError(f"the checkpoint in {checkpointer.directory} at step {step} lacks the data position "
                         f"this run needs ({error}); resume with the processes and data it was saved "
                         "with") from None
    source.resume(record.get("data", {}), step)
    return state, notes + [f"resumed from step {step} of {checkpointer.directory}"]
