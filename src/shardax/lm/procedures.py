"""What a ``shardax train`` run trains, as its data's format says (``DataFormat.procedure``): one
model and its loss, or the model trained beside a frozen copy of its first weights (full DPO's
reference), two parts of one run, checkpointed together; and which model of the run is the one
trained (sampled at the end, exported, generated from)."""

from __future__ import annotations

from typing import Any

import optax

from shardax.data.registry import DataFormat, Procedure, registered
from shardax.errors import UsageError
from shardax.lm.config import RunDefinition
from shardax.parts import Part
from shardax.trainer.models import first_weights
from shardax.trainer.trainer import Trainer


def procedure_of(data: DataFormat, run: RunDefinition) -> Procedure:
    """What the run trains, as its data's format says; the settings of another format (DPO's,
    beside documents) are refused in one line."""
    options = {"dpo_beta": run.dpo_beta, "dpo_label_smoothing": run.dpo_label_smoothing}
    given = [name for name, value in options.items() if value is not None and name not in data.options]
    if given:
        owner = next(kind for kind in registered() if given[0] in kind.options)
        flags = [f"--{name.replace('_', '-')}" for name in given]
        raise UsageError(f"{' and '.join(flags)} tune{'s' * (len(flags) == 1)} {owner.purpose}, and --data "
                         f"holds no {owner.what}; give {owner.give}, or leave them out")
    taken = {name: options.get(name) for name in data.options}
    return data.procedure(taken, adapters=bool(run.model.lora_rank))


def run_trainer(procedure: Procedure, build: Any, adapted: Any, tx: optax.GradientTransformation,
                run: RunDefinition, options: dict[str, Any]) -> Trainer:
    """The run's Trainer (``options``: its other keywords): one model and its loss (``adapted``
    to how the model takes its inputs), or the model trained beside a frozen copy of its first
    weights, the same seed's or the same checkpoint's (read into each part)."""
    if procedure.step is None:
        return Trainer(build, tx, adapted(procedure.loss), eval_loss_fn=adapted(procedure.eval_loss),
                       init_from=run.init_from, **options)
    if options.get("grad_accum", 1) != 1:
        raise UsageError(f"--grad-accum {options['grad_accum']}: the step over the model and its frozen "
                         f"{procedure.frozen} takes no microbatches; use --grad-accum 1 (or, for DPO, "
                         "--lora-rank R: the base weights are the reference, and that step accumulates)")
    weights = first_weights(run.init_from)  # (a checkpoint's: read into each part's own layout)
    parts = {procedure.trained: Part(build, tx, seed=run.seed, init_from=weights),
             procedure.frozen: Part(build, seed=run.seed, init_from=weights)}
    return Trainer(parts=parts, step=procedure.step, eval_fn=procedure.eval_step, **options)


def trained_model(trainer: Trainer, state: Any) -> Any:
    """The model the run trained (in a run of parts, the part with an optimizer), as it samples."""
    if trainer.parts is None:
        return trainer.parallel.merge(state)
    frozen = trainer.parallel.frozen()
    return trainer.part(next(name for name in trainer.parallel.names if name not in frozen), state)


def parts_record(trainer: Trainer) -> dict[str, Any] | None:
    """What a checkpoint says of a run of parts: the part trained and the frozen ones (None: one
    model), so that ``shardax export`` and ``generate`` take the trained one."""
    if trainer.parts is None:
        return None
    frozen = list(trainer.parallel.frozen())
    return {"trained": [name for name in trainer.parallel.names if name not in frozen], "frozen": frozen}
