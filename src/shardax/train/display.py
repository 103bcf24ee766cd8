"""What a person sees during ``shardax train``: the set-up, progress, evaluations, a summary.

Only process 0 prints. On a terminal a rich progress bar shows step, loss, tokens/s and step
time; elsewhere (CI, a log file) the same figures come as one line per logged step.
"""

from __future__ import annotations

from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardax.sharding.report import format_bytes


class RunDisplay:
    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.enabled = jax.process_index() == 0
        self.console = Console(highlight=False, soft_wrap=True)
        self.progress: Progress | None = None
        if self.enabled and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="compiling")
            self.progress.start()

    def print(self, *lines: Any) -> None:
        if self.enabled:
            for line in lines:
                self.console.print(line)

    def step(self, step: int, record: dict[str, Any]) -> None:
        stats = (f"loss {record['loss']:.4f}  {record['tokens_per_sec']:,.0f} tok/s  "
                 f"{1000 * record['step_time_s']:.0f} ms/step")
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=stats)
        else:
            self.print(f"step {step:>6}  {stats}  lr {record['lr']:.2e}  grad norm {record['grad_norm']:.3f}")

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def evaluation(self, step: int, val_loss: float, bits_per_byte: float, baseline: float) -> None:
        self.print(f"[bold]eval[/bold] step {step}: validation loss {val_loss:.4f} nats/byte "
                   f"({bits_per_byte:.3f} bits/byte) vs unigram baseline {baseline:.4f}")

    def summary(self, rows: dict[str, str]) -> None:
        if self.progress is not None:
            self.progress.stop()
        table = Table(title="shardax train: summary", show_header=False)
        for key, value in rows.items():
            table.add_row(key, value)
        self.print(table)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def summary_rows(*, steps: int, tokens: int, wall_s: float, tokens_per_sec: float, best_val: float | None,
                 baseline: float, bytes_per_device: int, replicated_bytes: int) -> dict[str, str]:
    return {
        "steps": f"{steps}",
        "tokens": f"{tokens:,}",
        "wall time": f"{wall_s:.1f} s",
        "tokens/s": f"{tokens_per_sec:,.0f}",
        "best validation loss": "-" if best_val is None else f"{best_val:.4f} nats/byte (unigram {baseline:.4f})",
        "state per device": f"{format_bytes(bytes_per_device)} (replicated: {format_bytes(replicated_bytes)})",
    }
