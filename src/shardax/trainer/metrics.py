"""Metrics on disk: one JSON object per logged step, a PNG of the curves, optional TensorBoard events."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from shardax.errors import UsageError

# Keys of a record that are bookkeeping, not curves.
NOT_PLOTTED = {"step", "lr", "step_time_s", "examples_per_sec", "tokens_per_sec", "grad_norm",
               "skipped_steps"}


def plotted(name: str) -> bool:
    """Whether a metric is one of the run's own curves (not a timing, nor a part's gradient norm)."""
    return name not in NOT_PLOTTED and not name.startswith("grad_norm/")


def finite_or_none(record: dict[str, Any]) -> dict[str, Any]:
    return {key: (None if isinstance(v, float) and not math.isfinite(v) else v) for key, v in record.items()}


class MetricsLog:
    """Appends records to a JSON-lines file; on resume, drops records past the resumed step."""

    def __init__(self, path: str | Path | None, *, resume_from: int | None = None) -> None:
        self.path = Path(path) if path else None
        self.records: list[dict[str, Any]] = []
        self.note: str | None = None  # what was repaired on resume, said in the run's header
        if self.path is None:
            return
        if self.path.is_dir():
            raise UsageError(f"metrics file {self.path} is a directory; "
                             f"give a file name such as {self.path / 'metrics.jsonl'}")
        if resume_from is not None and self.path.exists():
            self.records = [record for record in self._read() if record.get("step", 0) <= resume_from]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(record) + "\n" for record in self.records))
        except OSError as error:
            raise UsageError(f"metrics file {self.path} cannot be written ({error.strerror}); "
                             "give a path you can write to") from None

    def _read(self) -> list[dict[str, Any]]:
        """The records so far. A last line cut off mid-write (a crash while appending) is dropped,
        with a note; a damaged line before it is refused in one line."""
        assert self.path is not None
        lines = [line for line in self.path.read_text(errors="replace").splitlines() if line.strip()]
        records = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a record")
            except ValueError:
                if number == len(lines):
                    self.note = (f"metrics file {self.path}: its last line was cut off mid-write "
                                 f"({len(line)} bytes, from a run that stopped while appending); dropped it")
                    break
                raise UsageError(f"metrics file {self.path} line {number} is not a JSON record; move the "
                                 "file aside or give another metrics file") from None
            records.append(record)
        return records

    def write(self, record: dict[str, Any]) -> None:
        clean = finite_or_none(record)
        self.records.append(clean)
        if self.path is not None:
            with self.path.open("a") as file:
                file.write(json.dumps(clean) + "\n")

    def plot(self, *, title: str | None = None, loss_unit: str | None = None,
             baselines: dict[str, float] | None = None) -> Path | None:
        """``<metrics>.png``: each metric (training and validation) against step, loss first, on a
        log scale (the first steps' loss would squash the rest), with ``baselines`` as dashed lines
        and validation points marked."""
        if self.path is None or not self.records:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        has_loss = any("loss" in record or "val_loss" in record for record in self.records)
        names = ["loss"] * has_loss + sorted({key.removeprefix("val_")
                                             for record in self.records for key in record
                                             if plotted(key.removeprefix("val_")) and key != "loss"
                                             and key != "val_loss"})
        names = names[:4]
        figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.4), squeeze=False)
        for axis, name in zip(axes[0], names):
            for key, style, label in ((name, "-", "training"), (f"val_{name}", "o-", "validation")):
                points = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
                if points:
                    axis.plot(*zip(*points), style, label=f"{label} {name.replace('_', ' ')}", markersize=5)
            if name == "loss":
                for label, value in (baselines or {}).items():
                    axis.axhline(value, linestyle="--", color="grey", label=f"{label} baseline {value:.3g}")
                if all(r[k] > 0 for r in self.records for k in ("loss", "val_loss") if r.get(k) is not None):
                    axis.set_yscale("log")  # ticks as plain numbers, not powers of ten
                    axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
                    axis.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
            axis.set_xlabel("step")
            axis.set_ylabel(f"{name} ({loss_unit})" if name == "loss" and loss_unit
                            else name.replace("_", " "))
            axis.set_title(name.replace("_", " "))
            axis.grid(alpha=0.3, which="both")
            axis.legend()
        if title:
            figure.suptitle(title)
        figure.tight_layout()
        image = self.path.with_suffix(".png")
        figure.savefig(image, dpi=100, metadata={"Title": title or "", "Description": "loss on a log scale" if
                                                 axes[0][0].get_yscale() == "log" else "loss"})
        plt.close(figure)
        return image
