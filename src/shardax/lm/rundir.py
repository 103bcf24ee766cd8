"""A run's directory: everything one ``shardax train`` run writes, in one place.

    runs/2026-11-25_14-30-05_fsdp/
      config.yaml      the resolved settings (``--config`` reads it back: the same run afresh)
      metrics.jsonl    one record per logged step, and metrics.png, its curves
      checkpoints/     the run's checkpoints (``--resume`` continues from the latest good one)
      tokenizer.json   the run's tokenizer, as Hugging Face writes one (``shardax export`` copies it)

The directory is named by the time the run started and its strategy, under ``runs/`` in the
working directory (or under ``$SHARDAX_RUNS_DIR``), unless ``--run-dir`` names one. ``--checkpoint-dir`` and
``--metrics`` still put those elsewhere. The name is claimed by creating the directory (``-2``, ``-3``... when
another run has it), so runs started at the same moment (a sweep from a shell loop) each get their own; a run
refused before it writes removes it again. With several processes, process 0 claims it and the others take
the name. ``--resume --run-dir DIR`` continues the run with the settings of its ``config.yaml``
(flags given then win; what defines the run comes from its checkpoint, see ``lm/config.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import time
from pathlib import Path
from typing import Any

from shardax.errors import UsageError

CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# Settings that say where things go or what to do with an existing run: not part of a run's config.yaml.
NOT_SAVED = ("run_dir", "checkpoint_dir", "metrics", "resume", "extend_to")


@dataclasses.dataclass(frozen=True)
class RunDirectory:
    path: Path
    checkpoint_dir: Path
    metrics: Path
    claimed: tuple[Path, ...] = ()  # folders this process made to claim a new run's name, innermost first

    def release(self) -> None:
        """Remove the folders claimed for this run where they are still empty (a run refused before it
        wrote anything leaves nothing)."""
        for folder in self.claimed:
            with contextlib.suppress(OSError):  # not empty: the run, or another one, wrote in it
                folder.rmdir()

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    def resume_command(self, extend_to: int | None = None) -> str:
        """The command that continues this run (``extend_to``: past its end)."""
        words = ["shardax", "train", "--run-dir", str(self.path)]
        if self.checkpoint_dir != self.path / CHECKPOINTS:
            words += ["--checkpoint-dir", str(self.checkpoint_dir)]
        if self.metrics != self.path / METRICS:
            words += ["--metrics", str(self.metrics)]
        words.append("--resume")
        if extend_to is not None:
            words += ["--extend-to", str(extend_to)]
        return shlex.join(words)

    def contents(self) -> str:
        """What the directory holds, for the closing lines."""
        names = [CONFIG] + [p.name for p in (self.metrics, self.metrics.with_suffix(".png"))
                            if p.parent == self.path]
        if self.checkpoint_dir.parent == self.path:
            names.append(f"{CHECKPOINTS}/")
        return ", ".join(names)


def run_directory(run_dir: str | None, strategy: str, checkpoint_dir: str | None, metrics: str | None,
                  resume: bool) -> RunDirectory:
    """Where this run writes: ``run_dir``, or a new directory under ``runs/`` named by the time and
    ``strategy`` (the same name on every process), claimed here by process 0 creating it empty (see
    ``RunDirectory.release``). Nothing else is created here."""
    claimed: tuple[Path, ...] = ()
    if run_dir is None:
        if resume and checkpoint_dir is None:
            latest = latest_run()
            hint = f" (the latest is {latest})" if latest is not None else ""
            raise UsageError(f"--resume continues a saved run: name it with --run-dir DIR{hint}")
        path, claimed = _new_name(strategy)
    else:
        path = Path(run_dir)
        if path.exists() and not path.is_dir():
            raise UsageError(f"--run-dir {run_dir} is a file; give a directory (new or a run's) to write the "
                             "run in")
        if resume and checkpoint_dir is None and not (path / CHECKPOINTS).is_dir():
            raise UsageError(f"--run-dir {run_dir} holds no checkpoints to resume (no {path / CHECKPOINTS}); "
                             "give the directory of a run that saved one, or drop --resume to start it")
    return RunDirectory(path, Path(checkpoint_dir) if checkpoint_dir else path / CHECKPOINTS,
                        Path(metrics) if metrics else path / METRICS, claimed)


def runs_root() -> Path:
    """Where new run directories go: ``$SHARDAX_RUNS_DIR``, else ``runs/`` in the working directory."""
    return Path(os.environ.get("SHARDAX_RUNS_DIR") or "runs")


def latest_run() -> Path | None:
    root = runs_root()
    runs = sorted((p for p in root.glob("*") if (p / CONFIG).is_file()), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def _new_name(strategy: str) -> tuple[Path, tuple[Path, ...]]:
    """``runs/<date>_<time>_<strategy>``, with ``-2``, ``-3``... for runs started in the same second;
    with the folders created to claim it. Process 0 claims it; the others receive its choice."""
    import jax
    import numpy as np

    stamp, suffix, claimed = int(time.time()), 1, ()
    if jax.process_index() == 0:
        suffix, claimed = _claim(stamp, strategy)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stamp, suffix = (int(v)
                         for v in multihost_utils.broadcast_one_to_all(np.array([stamp, suffix], np.int64)))
    return _named(stamp, strategy, suffix), claimed


def _claim(stamp: int, strategy: str) -> tuple[int, tuple[Path, ...]]:
    """The first suffix whose directory this process creates (``mkdir`` is atomic: of runs claiming
    one name at once, one gets it and the others try the next), with the folders it made."""
    root = runs_root().absolute()
    missing = tuple(folder for folder in (root, *root.parents) if not folder.exists())
    suffix, attempts = 1, 0
    while True:
        path = _named(stamp, strategy, suffix)
        try:
            path.mkdir(parents=True)
            return suffix, (path, *missing)
        except FileExistsError:
            if not path.parent.is_dir():  # runs/ is a file, or a link to nowhere
                raise UsageError(f"{path.parent} is not a directory to hold run directories; give --run-dir "
                                 "DIR, or set SHARDAX_RUNS_DIR") from None
            suffix += 1
        except OSError as error:  # (runs/ removed meanwhile by a refused run: tried again)
            attempts += 1
            if not isinstance(error, FileNotFoundError) or attempts > 100:
                raise UsageError(f"the run directory {path} cannot be created ({error.strerror}); give "
                                 "--run-dir DIR, or set SHARDAX_RUNS_DIR") from None


def _named(stamp: int, strategy: str, suffix: int) -> Path:
    name = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(stamp)) + f"_{strategy}"
    return runs_root() / (name if suffix == 1 else f"{name}-{suffix}")


def saved_settings(run_dir: str) -> dict[str, Any]:
    """The settings in ``run_dir``'s ``config.yaml`` ({} when it has none), as ``TrainConfig`` values."""
    import yaml

    from shardax.lm.config import typed_settings

    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(f"{path} cannot be read as the run's settings ({str(error).splitlines()[0]}); "
                         "restore it, or give every setting as flags") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{path} is not a mapping of settings; restore it, or give every setting as flags")
    return typed_settings(loaded, str(path))


def write_config(path: Path, settings: dict[str, Any], train_to: int | None = None) -> None:
    """``config.yaml``: the settings (``None`` left out) under their sections (model, data,
    optimizer, parallelism, run), written whole or not at all. A run extended past its schedule
    (``--extend-to``) says so in a comment: ``steps`` stays the schedule's length, which is what
    defines the run."""
    import yaml

    from shardax.lm.settings import by_section

    kept = {name: value for name, value in settings.items() if value is not None and name not in NOT_SAVED}
    text = "# shardax train's settings for this run; `shardax train --config <this file>` starts it afresh\n"
    if train_to is not None and train_to != kept.get("steps"):
        text += (f"# trained to step {train_to} (--resume --extend-to {train_to}): steps past "
                 f"{kept.get('steps')} at the schedule's final learning rate\n")
    _write_whole(path, text + yaml.safe_dump(by_section(kept), sort_keys=False))


def write_tokenizer(run_dir: Path, text: str, chat_template: str | None = None) -> None:
    """The run's ``tokenizer.json`` (a Hugging Face tokenizer), written whole or not at all; with
    the chat template its conversations were rendered with beside it (``chat_template.jinja``)."""
    _write_whole(run_dir / TOKENIZER, text)
    if chat_template is not None:
        _write_whole(run_dir / CHAT_TEMPLATE, chat_template)


CHAT_TEMPLATE = "chat_template.jinja"


def _write_whole(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
