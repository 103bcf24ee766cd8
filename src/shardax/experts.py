"""What a mixture of experts exposes so that ``parallelize`` tells it how the step splits it.

A model's mixture needs nothing of shardax to be split over an ``expert`` axis: its stacked expert
weights (one leading row per expert) carry the logical axis ``expert``, or, left without names,
are read off the model's program (``shardax.sharding.derive``), and XLA's partitioner routes the
tokens. A mixture that routes its tokens itself, in ``shard_map`` (each device sorting its own
tokens, an all-to-all to its experts' devices: shardax's ``MixtureOfExperts`` is one), follows
``ExpertMixture``: ``parallelize`` finds it in the model and sets its ``expert_layout`` on the
copy of the model each step traces, as it sets a ``LayerStack``'s plan. Outside a step it is None.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from jax.sharding import Mesh

from shardax.errors import UsageError


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How the step being traced splits a mixture of experts (set by ``parallelize``): the experts
    over ``axis`` of ``mesh`` (each device a group of them; None: every device holds them all),
    the tokens' rows over ``batch_axes`` (``axis`` among them) and their sequence over
    ``sequence_axis`` (a context axis) or whole. Each device routes its own tokens."""

    mesh: Mesh
    axis: str | None
    batch_axes: tuple[str, ...]
    sequence_axis: str | None = None

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis] if self.axis else 1

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every mesh axis the tokens are split over."""
        return tuple(a for a in (*self.batch_axes, self.sequence_axis) if a and self.mesh.shape.get(a, 1) > 1)

    def check(self, experts: int, capacity_factor: float | None) -> None:
        """Refuse, in one line, ``experts`` that do not split evenly over the axis, or a capacity
        per expert (the whole batch's) with the experts split."""
        if self.shards == 1:
            return
        if experts % self.shards:
            raise UsageError(f"{experts} experts do not split over {self.axis}={self.shards} devices; use an "
                             f"{self.axis} axis that divides {experts}")
        if capacity_factor is not None:
            raise UsageError(f"capacity_factor={capacity_factor} with the experts split over {self.axis!r}: "
                             "routing across devices here is dropless; drop capacity_factor")


@runtime_checkable
class ExpertMixture(Protocol):
    """A mixture of experts that routes its tokens itself under ``parallelize``.

    ``expert_layout``: how the step being traced splits it, set by ``parallelize`` (None at first,
      and where the step splits neither its experts nor its routing).
    ``routes_per_device``: whether it routes each device's tokens on its own even where every device
      holds every expert (dropless routing: nothing depends on the other devices' tokens); if so it
      is given a layout without an expert axis too (not inside a pipeline's stages). A mixture with a
      capacity per expert over the whole batch says False, and is given a layout only with its
      experts split (where it may refuse the capacity, as ``ExpertLayout.check`` does).
    Its expert weights carry the logical axis ``expert`` on their leading dimension, so that the
    strategy's rules place each device's experts where ``expert_layout.axis`` says.
    """

    expert_layout: ExpertLayout | None

    @property
    def routes_per_device(self) -> bool: ...
