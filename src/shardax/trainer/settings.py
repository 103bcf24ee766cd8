"""How one ``Trainer.fit`` runs, checked once: ``FitSettings``; how a ``Trainer`` lays its run
out: ``TrainerSettings``.

``Trainer.fit``'s keywords become one frozen ``FitSettings``; its checks run as it is made, so
that a bad value is refused before anything runs or is written, and the run (``trainer/run.py``)
takes the object as it is. How each step is computed is ``shardax.step.settings.StepSettings``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardax.errors import UsageError
from shardax.step.settings import check_at_least, check_nonfinite

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from shardax.adapters import LoRA
    from shardax.sharding.axis_names import AxisNames
    from shardax.sharding.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """``Trainer.fit``'s settings.

    Attributes:
      run_dir: the folder the run writes into; what is not given elsewhere goes there: checkpoints
        in ``run_dir/checkpoints``, metrics in ``run_dir/metrics.jsonl`` (its plot beside it),
        samples in ``run_dir/samples``.
      steps: the step to train to (counted from the very start, resumes included); ``None``:
        until the data runs out.
      eval_every: steps between evaluations of ``eval_data`` (0: only at the end).
      log_every: steps between records (metrics file, progress, ``on_log``).
      checkpoint_dir, checkpoint_every: asynchronous orbax checkpoints every so many steps
        (0: only at the end) and at the end, each sealed (every file's size and SHA-256
        digests, hashed by the process that wrote it) as it is committed; the latest
        ``keep_checkpoints`` are kept.
      resume: continue from the latest good checkpoint in ``checkpoint_dir`` (parameters,
        optimizer, model state, RNG streams and data position, bit for bit). A newer one
        that is damaged (a file missing, truncated or changed) is set aside with a warning.
        Without ``resume``, a directory that already holds checkpoints is refused.
      on_nonfinite: a step with a NaN/Inf loss or gradient norm is never applied. ``"stop"``
        raises ``NonFiniteError`` naming it, at the next log or checkpoint step, and nothing
        after it is applied or saved; ``"skip"`` goes on and counts it (``skipped_steps``).
      metrics: a JSON-lines file of records; a PNG of the curves is written beside it.
      tensorboard: a directory for TensorBoard event files (needs ``tensorboardX``): the
        same as ``Trainer(trackers=["tensorboard:DIR"])``, which also takes MLflow and W&B
        (see ``shardax.trainer.trackers``).
      tokens_per_example: log ``tokens_per_sec`` as well as ``examples_per_sec``.
      record: extra JSON saved in each checkpoint (a run's settings).
      summary: print the closing table (its rows are also ``FitResult.summary``).
      loss_unit: the loss's unit (``"nats/token"``), in the summary and on the plot's axis.
      baselines: reference losses by name (``{"unigram": 3.24}``), in the summary and drawn on
        the plot's loss as dashed lines.
      sample_every, samples_dir: steps between calls of ``fit``'s ``samples`` hook (0: only at
        the end) and where its PNG grids go (``shardax.trainer.samples``).
      eval_ema: evaluate the moving average of the weights (``shardax.ema_params``) instead of
        the weights, as diffusion models are evaluated.
    """

    run_dir: str | None = None
    steps: int | None = None
    eval_every: int = 0
    log_every: int = 10
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    keep_checkpoints: int = 3
    on_nonfinite: str = "stop"
    metrics: str | None = None
    tensorboard: str | None = None
    tokens_per_example: int | None = None
    record: dict[str, Any] | None = None
    summary: bool = True
    loss_unit: str | None = None
    baselines: dict[str, float] | None = None
    sample_every: int = 0
    samples_dir: str | None = None
    eval_ema: bool = False

    def __post_init__(self) -> None:
        if self.run_dir is not None:  # the run's folder: what has no place of its own goes under it
            for name, under in (("checkpoint_dir", "checkpoints"), ("metrics", "metrics.jsonl")):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, str(Path(self.run_dir) / under))
        for name, least in (("log_every", 1), ("eval_every", 0), ("checkpoint_every", 0),
                            ("keep_checkpoints", 1), ("sample_every", 0)):
            check_at_least(name, getattr(self, name), least)
        if self.steps is not None:
            check_at_least("steps", self.steps, 1)
        check_nonfinite(self.on_nonfinite)
        if self.resume and self.checkpoint_dir is None:
            raise UsageError("`resume=True` needs checkpoint_dir (where the run's checkpoints are)")

    @property
    def samples_path(self) -> str | None:
        """Where samples go: ``samples_dir``, else ``run_dir/samples`` (None: nowhere given)."""
        if self.samples_dir is None and self.run_dir is not None:
            return str(Path(self.run_dir) / "samples")
        return self.samples_dir

    def due(self, step: int, first: bool, evaluating: bool, saving: bool,
            sampling: bool = False) -> dict[str, bool]:
        """What step ``step`` writes: a log record, an evaluation, samples, a checkpoint (the last step
        all)."""
        last = step == self.steps
        return {"log": step % self.log_every == 0 or first or last,
                "eval": evaluating and ((self.eval_every and step % self.eval_every == 0) or last),
                "sample": sampling and ((self.sample_every and step % self.sample_every == 0) or last),
                "save": saving and ((self.checkpoint_every and step % self.checkpoint_every == 0) or last)}


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """How a ``Trainer`` lays its run out and starts it: everything beside the procedure (the
    model, optimizer and loss, or the parts and step), given as ``Trainer``'s keywords or as one
    ``settings=TrainerSettings(...)``. ``Trainer``'s docstring says what each one does."""

    mesh: Mesh | str | dict | None = None
    strategy: str | Strategy = "dp"
    grad_accum: int = 1
    microbatches: int | None = None
    pipeline_repeats: int = 1
    context_attention: str = "all-gather"
    seed: int = 0
    learning_rate: float | Callable[[int], Any] | None = None
    name: str = "shardax"
    axis_names: AxisNames = None
    example_batch: Any = None
    init_from: str | Path | Any = None
    lora: LoRA | None = None
    trackers: Sequence[Any] = ()


FIELDS = tuple(field.name for field in dataclasses.fields(FitSettings))


def settings_given(settings: Any, keywords: dict[str, Any], kind: type = FitSettings,
                   call: str = "fit()") -> Any:
    """The settings of ``call``: ``settings`` (a ``kind``, ``FitSettings`` for ``fit``) when
    given, else one made of ``keywords`` (``kind``'s fields); both at once is refused, naming the
    first keyword given, and so is a keyword that is no setting, with the closest one."""
    fields = tuple(field.name for field in dataclasses.fields(kind))
    what = f"shardax.{kind.__name__}"
    for name in keywords:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"the closest is {close[0]}; " if close else ""
            raise UsageError(f"{call} got {name}={keywords[name]!r}, which is no setting of "
                             f"{'a run' if kind is FitSettings else 'a Trainer'}; {hint}the settings are "
                             f"{', '.join(fields)} ({what})")
    if settings is None:
        return kind(**keywords)
    if not isinstance(settings, kind):
        raise UsageError(f"{call.removesuffix('()')}(settings=...) takes a {what}; got "
                         f"{type(settings).__name__}")
    if keywords:
        name, value = next(iter(keywords.items()))
        raise UsageError(f"{call} got settings={kind.__name__}(...) and {name}={value!r}; give {name} inside "
                         f"the {kind.__name__} (dataclasses.replace(settings, {name}=...))")
    return settings
