"""``shardax plan --target ... --fit``: the largest batch that fits a chip, for each remat policy.

For each remat policy (least recomputation first) the step is compiled for the target at
growing global batches, doubling and then bisecting on whole rows per data-parallel device,
until the compiled step no longer fits the chip's HBM (XLA:TPU's own count: its buffer
assignment's heap, see :mod:`shardax.analysis.heap`). The largest batch that fits is then
costed (FLOPs and a roofline step time, see :mod:`shardax.analysis.targets`), and the policy
with the most tokens per second at its largest batch is recommended; a wanted global batch
larger than that is reached by gradient accumulation over microbatches of that size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardax.analysis.plan import StrategyPlan, plan_strategy
from shardax.analysis.targets import Target
from shardax.errors import UsageError
from shardax.models.transformer import TransformerConfig
from shardax.step.settings import StepSettings

POLICIES = ("none", "dots_with_no_batch_dims_saveable", "dots_saveable", "full")


@dataclasses.dataclass
class Fit:
    """The largest global batch (without accumulation) one remat policy fits, and its plan."""

    remat: str
    batch_size: int  # 0: not even one row per data-parallel device fits
    plan: StrategyPlan | None
    probes: int  # compiles it took
    seq_len: int

    @property
    def tokens_per_s(self) -> float:
        if self.plan is None or not self.plan.roofline or not self.plan.roofline["step_s"]:
            return 0.0
        return self.batch_size * self.seq_len / self.plan.roofline["step_s"]


def batch_granule(strategy: str, mesh_shape: str | None, target: Target,
                  microbatches: int | None = None) -> int:
    """The rows a global batch must be a multiple of: the devices its rows are split over (times
    a pipeline's microbatches, one per stage unless given)."""
    settings = StepSettings.resolve(strategy, mesh_shape, devices=target.devices())
    if settings.strategy.pipeline_axis:  # the other strategies have no pipeline's microbatches
        settings = settings.replace(microbatches=microbatches)
    return settings.rows_per_split()


def _peak(model: TransformerConfig, strategy: str, mesh_shape: str | None, target: Target, batch: int,
          **options: Any) -> float:
    """The compiled peak per device at this batch; infinity where XLA:TPU refuses, out of HBM."""
    from shardax.analysis.plan import (
        compile_step,
        compiled_memory,
        device_bytes,
        out_of_memory,
        transformer_for,
    )

    parallel = transformer_for(model, strategy, mesh_shape, None, target)
    pipeline = {key: value for key, value in options.items() if parallel.strategy.pipeline_axis}
    try:
        return device_bytes(compiled_memory(compile_step(parallel, batch, model.seq_len, **pipeline)))
    except Exception as error:
        if out_of_memory(error):
            return math.inf
        raise


def largest_batch(model: TransformerConfig, strategy: str, mesh_shape: str | None, target: Target,
                  granule: int, limit: int, **options: Any) -> tuple[int, int]:
    """(largest fitting batch, compiles used). The peak grows linearly with the batch, so two
    small compiles (1 and 2 rows per data-parallel device) predict the largest batch; compiles
    around the prediction then find the exact edge, in whole rows per device."""
    memory = target.per_device()["hbm_bytes"]
    peaks = {rows: _peak(model, strategy, mesh_shape, target, rows * granule, **options) for rows in (1, 2)}
    probes = 2
    if peaks[1] > memory:
        return 0, probes
    per_row = max(peaks[2] - peaks[1], 1.0)
    top = max(limit // granule, 1)
    fits, fails = (2, None) if peaks[2] <= memory else (1, 2)
    rows = min(max(int((memory - peaks[1]) / per_row), fits + 1), top)
    step = max(rows // 32, 1)
    while fails is None and fits < top:  # up from the prediction until one does not fit
        probes += 1
        peaks[rows] = _peak(model, strategy, mesh_shape, target, rows * granule, **options)
        if peaks[rows] > memory:
            fails = rows
        else:
            fits, rows, step = rows, min(rows + step, top), 2 * step
    while fails is not None and fails - fits > 1:  # then close in between the last fit and the first miss
        rows = _between(fits, fails, peaks, memory)
        probes += 1
        peaks[rows] = _peak(model, strategy, mesh_shape, target, rows * granule, **options)
        if peaks[rows] > memory:
            fails = rows
        else:
            fits = rows
    return fits * granule, probes


def _between(fits: int, fails: int, peaks: dict[int, float], memory: float) -> int:
    """The next row count to try: where the line through the two bracketing compiles crosses the
    memory (XLA's peak is close to linear in the batch), or halfway where XLA refused outright."""
    low, high = peaks[fits], peaks[fails]
    if math.isinf(high) or high <= low:
        return (fits + fails) // 2
    guess = fits + int((memory - low) / (high - low) * (fails - fits))
    return min(max(guess, fits + 1), fails - 1)


def fit(model: TransformerConfig, strategy: str, mesh_shape: str | None, target: Target, *,
        policies: tuple[str, ...] = POLICIES, limit: int = 1 << 16, **options: Any) -> list[Fit]:
    """One :class:`Fit` per remat policy (see the module docstring); ``limit`` caps the batch searched."""
    granule = batch_granule(strategy, mesh_shape, target, options.get("microbatches"))
    results = []
    for policy in policies:
        candidate = dataclasses.replace(model, remat=policy)
        batch, probes = largest_batch(candidate, strategy, mesh_shape, target, granule, limit, **options)
        plan = plan_strategy(candidate, strategy, mesh_shape, batch_size=batch, target=target,
                             **options) if batch else None
        results.append(Fit(policy, batch, plan, probes + (1 if plan else 0), model.seq_len))
    return results


def best(fits: list[Fit]) -> Fit:
    usable = [f for f in fits if f.batch_size]
    if not usable:
        raise UsageError("no batch fits the target's memory with any remat policy; use more chips, a "
                         "strategy that shards more (fsdp, fsdp_tp) or a smaller model")
    return max(usable, key=lambda f: f.tokens_per_s)


def accumulation_for(wanted: int, fit: Fit, granule: int) -> tuple[int, int]:
    """(grad_accum, microbatch) that reach the wanted global batch with microbatches that fit."""
    steps = math.ceil(wanted / fit.batch_size)
    while wanted % steps or (wanted // steps) % granule:
        steps += 1
        if steps > wanted:
            raise UsageError(f"`batch_size={wanted}` does not split into microbatches of whole rows for "
                             f"{granule} data-parallel devices; use a multiple of {granule}")
    return steps, wanted // steps
