"""Metrics on disk: one JSON object per logged step, and a PNG of the loss curves beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends records to a JSON-lines file; on resume, drops records past the resumed step."""

    def __init__(self, path: str | Path | None, *, resume_from: int | None = None) -> None:
        self.path = Path(path) if path else None
        self.records: list[dict[str, Any]] = []
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is not None and self.path.exists():
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.records = [record for record in kept if record["step"] <= resume_from]
        self.path.write_text("".join(json.dumps(record) + "\n" for record in self.records))

    def write(self, record: dict[str, Any]) -> None:
        clean = {key: (None if isinstance(v, float) and not math.isfinite(v) else v) for key, v in record.items()}
        self.records.append(clean)
        if self.path is not None:
            with self.path.open("a") as file:
                file.write(json.dumps(clean) + "\n")

    def plot(self) -> Path | None:
        """``<metrics>.png``: training and validation loss against step."""
        if self.path is None or not self.records:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        train = [(r["step"], r["loss"]) for r in self.records if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in self.records if r.get("val_loss") is not None]
        if train:
            axis.plot(*zip(*train), label="train loss")
        if val:
            axis.plot(*zip(*val), "o-", label="validation loss")
        axis.set_xlabel("step")
        axis.set_ylabel("loss (nats per byte)")
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        image = self.path.with_suffix(".png")
        figure.savefig(image, dpi=100)
        plt.close(figure)
        return image
