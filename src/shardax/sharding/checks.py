"""Refusal of a layout whose tensor or expert axis would only repeat work: it splits no weight."""

from __future__ import annotations

from shardax.errors import UsageError
from shardax.sharding.layout import Layout
from shardax.sharding.place import spec_axes


def check_split_axes(layouts: list[Layout], read_off_program: bool, hint: str | None = None) -> None:
    """Refuse a tensor axis (``model``) or an expert axis that splits no weight of any of
    ``layouts`` (one model, or a run's parts on one mesh): its devices would repeat each other's
    work, or the strategy would be data parallelism under another name."""
    first = layouts[0]
    hint = hint or "give loss_fn and example_batch so shardax reads the split off the model"
    for axis, splits in ((first.strategy.tensor_axis(first.mesh), "weight"),
                         (first.strategy.expert_axis(first.mesh), "expert")):
        if axis is None or any(axis in spec_axes(entry) for layout in layouts
                               for leaf in layout.leaves.values() for entry in leaf.spec):
            continue
        if splits == "expert" and any("expert" in (leaf.logical or ()) for layout in layouts
                                      for leaf in layout.leaves.values()):
            continue  # experts named but not dividing: the mixture's own check says how (shardax.models.moe)
        where = (f"strategy {first.strategy.name!r} splits no weight of this model over "
                 f"{axis}={first.mesh.shape[axis]}")
        more = "" if read_off_program else f", or {hint}"
        if splits == "weight":
            reason = next(iter(first.whole_on_tensor_axis()), "the model has no parameters")
            raise UsageError(
                f"{where}, so its {axis} devices would repeat each other's work ({reason}); use fsdp or dp "
                f"on this mesh's devices{' or' if read_off_program else ','} annotate the weights{more}")
        raise UsageError(
            f"{where}: no stack of experts' weights was found (a weight dimension along which each expert "
            "multiplies its own tokens, as einsum('ebcd,edf->ebcf', tokens, w)), so the expert axis would be "
            f"data parallelism under another name; use dp or fsdp{' or' if read_off_program else ','} "
            f"annotate the experts' dimension 'expert'{more}")
