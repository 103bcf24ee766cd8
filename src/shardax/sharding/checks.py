"""Refusal of a layout whose tensor axis would only repeat work: it splits no weight."""

from __future__ import annotations

from shardax.errors import UsageError
from shardax.sharding.layout import Layout
from shardax.sharding.place import spec_axes


def check_tensor_axis(layout: Layout, tensor: str | None, read_off_program: bool, hint: str | None = None) -> None:
    """Refuse a tensor axis that would split nothing: its devices would repeat each other's work."""
    if tensor is None or any(tensor in spec_axes(entry) for leaf in layout.leaves.values() for entry in leaf.spec):
        return
    reasons = layout.whole_on_tensor_axis()
    first = next(iter(reasons), "the model has no parameters")
    hint = hint or "give loss_fn and example_batch so shardax reads the split off the model"
    more = "" if read_off_program else f", or {hint}"
    raise UsageError(
        f"strategy {layout.strategy.name!r} splits no weight of this model over {tensor}={layout.mesh.shape[tensor]}, "
        f"so its {tensor} devices would repeat each other's work ({first}); use fsdp or dp on this mesh's devices"
        f"{' or' if read_off_program else ','} annotate the weights{more}"
    )
