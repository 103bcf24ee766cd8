"""Benchmark 8: the Trainer's step time against a hand-written loop calling the same jitted step.

    python benchmarks/trainer_overhead.py

Both sides run the compiled step ``Trainer.train_step()`` on the same batches, placed the same
way, and read the loss every 10 steps (what any training loop does to report progress). The
Trainer adds its own work per step: the data source, the metrics record, the progress display,
the clock. Rounds alternate between the two (interleaved in one process); a side's step time
in a round is the time between its first and last logged step divided by the steps between,
so set-up and the summary at the end of ``fit`` are left out: they are paid once per run.
The figure is the median over rounds of the paired ratio (each round's two sides run back to
back, the side going first alternating), with its quartiles.
Two models: the main job's ``tiny`` LM (dp; about 0.1 s per step here) and the digits CNN of
``examples/classify_digits.py`` (fsdp; a few milliseconds per step, where a per-step cost
shows most). Writes ``benchmarks/results/trainer_overhead.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import jax

from shardax.cpu_devices import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from classify_digits import DigitsCNN, loss_fn  # noqa: E402
from suite import save  # noqa: E402

from shardax import Trainer  # noqa: E402
from shardax.models.presets import get_preset  # noqa: E402
from shardax.models.transformer import TransformerLM, next_token_loss  # noqa: E402

LOG_EVERY = 10


def lm_case(steps: int) -> tuple[Trainer, list[dict]]:
    model = get_preset("tiny").config(seq_len=64)
    trainer = Trainer(lambda rngs: TransformerLM(model, rngs=rngs), optax.adamw(1e-3), next_token_loss,
                      strategy="dp")
    rng = np.random.default_rng(0)
    return trainer, [{"tokens": rng.integers(0, 256, size=(32, 65)).astype(np.int32)} for _ in range(steps)]


def cnn_case(steps: int) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(DigitsCNN, optax.adamw(1e-3), loss_fn, strategy="fsdp")
    rng = np.random.default_rng(0)
    return trainer, [{"images": rng.random((64, 8, 8, 1), np.float32),
                      "labels": rng.integers(0, 10, 64).astype(np.int32)}
                     for _ in range(steps)]


def per_step(times: list[float]) -> float:
    return (times[-1] - times[0]) / (LOG_EVERY * (len(times) - 1))


def trainer_round(trainer: Trainer, batches: list[dict]) -> float:
    logged: list[float] = []
    start = int(jax.device_get(trainer.state.step))
    trainer.fit(batches, steps=start + len(batches), log_every=LOG_EVERY,
                on_log=lambda record: (logged.append(time.perf_counter()) if record["step"] % LOG_EVERY == 0
                                       else None))
    return per_step(logged)


def hand_round(trainer: Trainer, state, batches: list[dict]):
    step, logged = trainer.train_step(), []
    for index, batch in enumerate(batches, start=1):
        state, metrics = step(state, trainer.place(batch))
        if index % LOG_EVERY == 0:
            float(metrics["loss"])  # waits for the step, as the Trainer's record does
            logged.append(time.perf_counter())
    return per_step(logged), state


def measure(name: str, case, steps: int, rounds: int) -> dict:
    trainer, batches = case(steps)
    trainer.fit(batches[:2], steps=2, log_every=1)  # compile once for both sides
    hand_state = trainer.parallel.init(seed=1)
    times: dict[str, list[float]] = {"trainer": [], "hand-written": []}
    for index in range(rounds):  # alternate which side goes first, so drift favours neither
        for side in (("trainer", "hand-written") if index % 2 == 0 else ("hand-written", "trainer")):
            if side == "trainer":
                times[side].append(trainer_round(trainer, batches))
            else:
                seconds, hand_state = hand_round(trainer, hand_state, batches)
                times[side].append(seconds)
    ratios = [ours / theirs for ours, theirs in zip(times["trainer"], times["hand-written"])]
    medians = {side: statistics.median(values) for side, values in times.items()}
    return {"case": name, "steps_per_round": steps, "rounds": rounds,
            "trainer_step_s": medians["trainer"], "hand_written_step_s": medians["hand-written"],
            "ratio": statistics.median(ratios), "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2],
            "per_round_s": times}


def main() -> dict:
    cases = [measure("tiny LM, dp, batch 32 x 64 tokens", lm_case, steps=40, rounds=8),
             measure("digits CNN, fsdp, batch 64", cnn_case, steps=100, rounds=16)]
    return save("trainer_overhead", {"log_every": LOG_EVERY, "cases": cases, "target": "<= 1.02"})


if __name__ == "__main__":
    print(json.dumps(main(), indent=1)[:3000])
