"""Experiment trackers: where a run's records go besides its metrics file.

``Trainer(trackers=...)`` takes a list of trackers, each either a ``Tracker`` (anything with
``write(record)`` and ``close()``) or a string ``"kind:directory"``:

- ``"tensorboard:runs/tb"``: TensorBoard event files (``tensorboardX``);
- ``"mlflow:runs/mlflow"``: an MLflow run in a local file store (``mlflow-skinny``); open it
  with ``mlflow ui --backend-store-uri runs/mlflow`` or ``MlflowClient(tracking_uri=...)``;
- ``"wandb:runs/wandb"``: a Weights & Biases run in offline mode (``wandb``), uploaded later
  with ``wandb sync runs/wandb/wandb/offline-run-*`` if you wish.

Only process 0 opens them. A record is ``{"step": n, "loss": ..., "val_loss": ...}``; every
tracker logs its numbers under ``train/<name>`` (``eval/<name>`` for ``val_<name>``) at its step,
and the run's settings (the ``record`` given to ``fit``) as the run's parameters. A tracker that
also has ``write_image(tag, image, step)`` (the three here do) receives ``fit``'s sample grids.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

from shardax.errors import UsageError

KINDS = ("tensorboard", "mlflow", "wandb")
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}  # kind: (module, shardax extra)


class Tracker(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's finite numbers by tracker name (``train/loss``, ``eval/loss``), the step left out."""
    named = {}
    for key, value in record.items():
        if (key == "step" or isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value)):
            continue
        named[f"eval/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"] = float(value)
    return named


def parse_tracker(spec: Any, label: str = "trackers") -> Any:
    """``spec`` checked: a Tracker as it is, or ``"kind:directory"`` as ``(kind, Path)``; bad
    input refused in one line before anything is opened."""
    if not isinstance(spec, str):
        if callable(getattr(spec, "write", None)) and callable(getattr(spec, "close", None)):
            return spec
        raise UsageError(f"{label} got {spec!r}; give 'tensorboard:DIR', 'mlflow:DIR', 'wandb:DIR' or an "
                         "object with write(record) and close()")
    kind, colon, directory = spec.partition(":")
    if not colon or kind not in KINDS or not directory:
        raise UsageError(f"{label} got {spec!r}; write it as KIND:DIRECTORY with KIND one of "
                         f"{', '.join(KINDS)}, e.g. 'mlflow:runs/mlflow'")
    module, extra = PACKAGES[kind]
    try:
        __import__(module)
    except ImportError:
        raise UsageError(f"{label} {spec!r} needs the {module} package; pip install 'shardax[{extra}]' "
                         f"(or {module})") from None
    return kind, Path(directory)


def open_tracker(spec: Any, *, name: str, settings: dict[str, Any]) -> Tracker:
    """The tracker ``spec`` names (see ``parse_tracker``), opened for a run called ``name``."""
    parsed = parse_tracker(spec)
    if not isinstance(parsed, tuple):
        return parsed
    kind, directory = parsed
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{kind} directory {directory} cannot be created ({error.strerror}); "
                         "give a directory you can write to") from None
    return {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}[kind](
        directory, name=name, settings=settings)


def _flat(settings: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as ``{"a.b": "value"}`` strings (what MLflow's parameters hold)."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = str(value)[:500]  # MLflow caps a parameter's value
    return flat


class TensorBoardTracker:
    """Scalars as TensorBoard event files (through ``tensorboardX``)."""

    def __init__(self, directory: Path, *, name: str = "", settings: dict[str, Any] | None = None) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(directory))
        if settings:
            self.writer.add_text("settings", "\n".join(f"{k}: {v}" for k, v in _flat(settings).items()), 0)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def write_image(self, tag: str, image: Any, step: int) -> None:
        """An image (height, width, channels; uint8) at ``step``."""
        self.writer.add_image(tag, image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run in the local file store at ``directory`` (experiment ``shardax``)."""

    def __init__(self, directory: Path, *, name: str = "", settings: dict[str, Any] | None = None) -> None:
        # MLflow 3 keeps its file store in maintenance mode and asks for this to use it
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=directory.resolve().as_uri())
        experiment = self.client.get_experiment_by_name("shardax")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("shardax")
        self.run_id = self.client.create_run(experiment_id, run_name=name or None).info.run_id
        params = [Param(key, value) for key, value in _flat(settings or {}).items()]
        for start in range(0, len(params), 100):  # MLflow logs at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, int(record["step"])) for tag, value in scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def write_image(self, tag: str, image: Any, step: int) -> None:
        self.client.log_image(self.run_id, image[..., 0] if image.shape[-1] == 1 else image, key=tag,
                              step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """One Weights & Biases run in offline mode under ``directory`` (project ``shardax``)."""

    def __init__(self, directory: Path, *, name: str = "", settings: dict[str, Any] | None = None) -> None:
        import wandb

        self.run = wandb.init(dir=str(directory), mode="offline", project="shardax", name=name or None,
                              config=settings or {}, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def write_image(self, tag: str, image: Any, step: int) -> None:
        import wandb

        self.run.log({tag: wandb.Image(image[..., 0] if image.shape[-1] == 1 else image)}, step=step)

    def close(self) -> None:
        self.run.finish()
