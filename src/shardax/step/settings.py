"""How a run computes its steps, resolved and checked once: ``StepSettings``.

``StepSettings.resolve`` turns what a user wrote (a strategy's name, a mesh shape such as
``"data=4,model=2"`` or nothing, the microbatch counts) into one typed, checked object: the
``Strategy``, a ``Mesh`` that has the axes it needs, and the numbers of microbatches. The
``Trainer`` resolves its settings here and passes the object down (``ParallelModel.create``
lays the model out from it); ``parallelize`` resolves here too. Nothing below looks a strategy
up or checks it against the mesh again. Each check lives in this module, once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from shardax.errors import UsageError
from shardax.mesh import DeviceMeshManager, describe_mesh
from shardax.sharding.strategies import Strategy, default_mesh, get_strategy
from shardax.vocabulary import CONTEXT_ATTENTIONS, NONFINITE_MODES

NONFINITE = NONFINITE_MODES


def check_nonfinite(value: str, name: str = "on_nonfinite") -> None:
    """What a step with a NaN or infinite loss does: ``stop`` or ``skip``, else one line."""
    if value not in NONFINITE:
        raise UsageError(f"`{name}={value!r}`; use 'stop' (the default) or 'skip'")


def check_grad_accum(grad_accum: int) -> None:
    """Microbatches per step: a whole number of at least 1, else one line."""
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise UsageError(f"`grad_accum={grad_accum!r}` must be a whole number of at least 1 (the number of "
                         "microbatches per step)")


def check_at_least(name: str, value: int, least: int) -> None:
    if value < least:
        raise UsageError(f"`{name}={value}` must be at least {least}")


def resolve_mesh(strategy: Strategy, mesh: Mesh | str | dict | Sequence | None, devices: Any = None) -> Mesh:
    """``mesh`` as a ``Mesh`` that has the axes ``strategy`` needs: a ``Mesh`` as it is, a shape
    built over ``devices`` (default: every device), nothing as the strategy's default shape."""
    if not isinstance(mesh, Mesh):
        mesh = DeviceMeshManager(devices).create_device_mesh(mesh or default_mesh(strategy.name))
    strategy.check_mesh(mesh)
    return mesh


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """How every step of a run is computed, checked against each other.

    Attributes:
      strategy: the ``Strategy`` (looked up from its name once).
      mesh: the ``Mesh``, with the axes the strategy needs.
      grad_accum: microbatches accumulated per step.
      microbatches, pipeline_repeats: a pipeline's schedule (``None``: one microbatch per stage).
      context_attention: on a mesh with a ``context`` axis, ``all-gather`` or ``ring``.
    """

    strategy: Strategy
    mesh: Mesh
    grad_accum: int = 1
    microbatches: int | None = None
    pipeline_repeats: int = 1
    context_attention: str = "all-gather"

    @classmethod
    def resolve(cls, strategy: str | Strategy = "dp", mesh: Mesh | str | dict | Sequence | None = None, *,
                grad_accum: int = 1, microbatches: int | None = None, pipeline_repeats: int = 1,
                context_attention: str = "all-gather", devices: Any = None) -> StepSettings:
        """Every setting checked, in one place (see the module docstring)."""
        if isinstance(strategy, StepSettings):
            raise UsageError("StepSettings.resolve takes a strategy's name or a Strategy, and was given "
                             "StepSettings, which are resolved already: use them as they are, or change "
                             "them with `settings.replace(...)`")
        strategy = get_strategy(strategy)
        settings = cls(strategy, resolve_mesh(strategy, mesh, devices), grad_accum, microbatches,
                       pipeline_repeats, context_attention)
        settings.check()
        return settings

    def replace(self, **changes: Any) -> StepSettings:
        """These settings with ``changes`` (any field but the strategy and mesh), checked again."""
        fixed = {"strategy", "mesh"} & set(changes)
        if fixed:
            raise UsageError(f"{', '.join(sorted(fixed))} cannot be changed on a laid-out model: the layout "
                             "was made for them; call parallelize again with the new ones")
        settings = dataclasses.replace(self, **changes)
        settings.check()
        return settings

    def check(self) -> None:
        """Each number in range; a pipeline's schedule only on a pipeline strategy; a context
        attention shardax has."""
        check_grad_accum(self.grad_accum)
        if self.microbatches is not None:
            check_at_least("microbatches", self.microbatches, 1)
        check_at_least("pipeline_repeats", self.pipeline_repeats, 1)
        scheduled = self.microbatches is not None or self.pipeline_repeats != 1
        if self.strategy.pipeline_axis is None and scheduled:
            raise UsageError(f"`microbatches`/`pipeline_repeats` are for pipeline strategies; "
                             f"{self.strategy.name!r} is not one (use `grad_accum=N` to split a batch into "
                             "microbatches)")
        if self.context_attention not in CONTEXT_ATTENTIONS:
            raise UsageError(f"`context_attention={self.context_attention!r}`; use one of "
                             f"{', '.join(CONTEXT_ATTENTIONS)}")

    def rows_per_split(self) -> int:
        """The rows a global batch must be a multiple of: the devices of the batch axes, times
        ``grad_accum``, times a pipeline's microbatches (one per stage unless given)."""
        axes = self.strategy.batch_axes
        split = math.prod(self.mesh.shape[axis] for axis in axes if axis in self.mesh.shape) * self.grad_accum
        if self.strategy.pipeline_axis:
            split *= self.microbatches or self.mesh.shape[self.strategy.pipeline_axis]
        return split

    def check_batch(self, rows: int) -> None:
        """A global batch of ``rows`` rows splits evenly, or one line says the multiple to use."""
        split = self.rows_per_split()
        if rows % split:
            pipeline = ""
            if self.strategy.pipeline_axis:
                count = self.microbatches or self.mesh.shape[self.strategy.pipeline_axis]
                pipeline = f" x `microbatches={count}`"
            raise UsageError(
                f"a global batch of {rows} rows (`batch_size={rows}`) does not split over the batch axes "
                f"{self.strategy.batch_axes} of mesh {describe_mesh(self.mesh)} times "
                f"`grad_accum={self.grad_accum}`{pipeline} (= {split}); use a multiple of {split}, e.g. "
                f"{split * max(1, rows // split)}"
            )
