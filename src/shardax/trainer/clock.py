"""Step times and throughput of a run."""

from __future__ import annotations

import time
from typing import Any


class Clock:
    """Step times and throughput: the first record includes compilation; the summary leaves it out."""

    def __init__(self, step: int, tokens_per_example: int | None) -> None:
        self.began = self.mark = time.perf_counter()
        self.mark_step, self.start_step = step, step
        self.compiled_at: float | None = None
        self.examples, self.after_first, self.rows, self.paused = 0, 0, 0, 0.0
        self.tokens_per_example = tokens_per_example

    def pause(self, seconds: float) -> None:
        """Time spent on something else than training (evaluation): not counted in step times."""
        self.mark += seconds
        self.paused += seconds

    def count(self, rows: int) -> None:
        """A step of ``rows`` examples was dispatched."""
        self.rows = rows
        self.examples += rows
        self.after_first += rows if self.mark_step > self.start_step else 0

    def tick(self, step: int) -> dict[str, float]:
        """Times since the last record (the step has finished: its metrics were fetched)."""
        now = time.perf_counter()
        elapsed = (now - self.mark) / (step - self.mark_step)
        rows = self.rows
        self.compiled_at = self.compiled_at or now
        self.mark, self.mark_step = now, step
        timing = {"step_time_s": elapsed, "examples_per_sec": rows / elapsed}
        if self.tokens_per_example:
            timing["tokens_per_sec"] = rows * self.tokens_per_example / elapsed
        return timing

    def finish(self, checkpointer: Any) -> float:
        """The run's wall time, once the checkpoints being written (if any) are."""
        if checkpointer is not None:
            checkpointer.wait()
        self.ended = time.perf_counter()
        return self.ended - self.began

    def examples_per_sec(self, step: int) -> float:
        trained = self.ended - (self.compiled_at or self.began) - self.paused
        return self.after_first / trained if trained > 0 and self.after_first else 0.0

    def throughput(self, step: int) -> str:
        rate = self.examples_per_sec(step)
        if self.tokens_per_example:
            return f"{rate * self.tokens_per_example:,.0f} tokens/s"
        return f"{rate:,.1f} examples/s"
