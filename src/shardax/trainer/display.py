"""What a person sees during a run: the set-up, progress, evaluations, a summary.

Only process 0 prints. On a terminal a rich progress bar shows the step, the loss and the
other metrics, throughput and step time; elsewhere (CI, a log file) the same figures come as
one line per logged step.
"""

from __future__ import annotations

from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardax.trainer.metrics import plotted


def count_parameters(count: int) -> str:
    """``0.92M`` for a model of 920,000 parameters; below ten thousand, the count itself."""
    return f"{count:,}" if count < 10_000 else f"{count / 1e6:.2f}M"


def _metrics_text(record: dict[str, Any], prefix: str = "") -> str:
    names = [key for key in record if key.startswith(prefix) and plotted(key.removeprefix(prefix))]
    return "  ".join(f"{key.removeprefix(prefix)} {record[key]:.4f}" for key in names
                     if isinstance(record[key], (int, float)))


def _throughput(record: dict[str, Any]) -> str:
    if "tokens_per_sec" in record:
        return f"{record['tokens_per_sec']:,.0f} tok/s"
    return f"{record['examples_per_sec']:,.1f} examples/s"


def say(*lines: Any) -> None:
    """Print on process 0 only."""
    if jax.process_index() == 0:
        console = Console(highlight=False, soft_wrap=True)
        for line in lines:
            console.print(line)


def show_summary(title: str, rows: dict[str, str]) -> None:
    """The closing table of a run (process 0 prints)."""
    table = Table(title=f"{title}: summary", show_header=False)
    for key, value in rows.items():
        table.add_row(key, value)
    say(table)


class RunDisplay:
    def __init__(self, total_steps: int | None, start_step: int = 0, *, title: str = "shardax") -> None:
        self.title = title
        self.enabled = jax.process_index() == 0
        self.console = Console(highlight=False, soft_wrap=True)
        self.progress: Progress | None = None
        if self.enabled and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               stats="compiling")
            self.progress.start()

    def print(self, *lines: Any) -> None:
        if self.enabled:
            for line in lines:
                self.console.print(line)

    def step(self, step: int, record: dict[str, Any]) -> None:
        stats = f"{_metrics_text(record)}  {_throughput(record)}  {1000 * record['step_time_s']:.0f} ms/step"
        if record.get("skipped_steps"):
            stats += f"  skipped {record['skipped_steps']:.0f} (not finite)"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=stats)
        else:
            extra = f"  lr {record['lr']:.2e}" if "lr" in record else ""
            norm = f"  grad norm {record['grad_norm']:.3f}" if "grad_norm" in record else ""
            self.print(f"step {step:>6}  {stats}{extra}{norm}")

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def evaluation(self, step: int, record: dict[str, Any]) -> None:
        others = _metrics_text({k: v for k, v in record.items() if k != "val_loss"}, "val_")
        if "val_loss" not in record:
            self.print(f"[bold]eval[/bold] step {step}: {others}")
            return
        self.print(f"[bold]eval[/bold] step {step}: validation loss {record['val_loss']:.4f}"
                   + (f"  ({others})" if others else ""))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
