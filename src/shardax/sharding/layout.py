"""A strategy applied to one model on one mesh: the shardings of every tree a train step touches.

Everything here works on abstract trees (``nnx.eval_shape``): the same layout feeds jit's
``out_shardings`` for initialisation straight into shards, the train step, checkpoint restore
and the compile-only ``plan``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.derive import Derived
from shardax.sharding.paths import path_to_str
from shardax.sharding.place import spec_axes
from shardax.sharding.rules import LOGICAL_AXES, logical_axes_of, unannotated
from shardax.sharding.strategies import Strategy
from shardax.vocabulary import LAYERS


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter lives: its logical names, storage/compute/optimizer specs, notes."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    logical: tuple[str | None, ...] | None
    spec: PartitionSpec
    compute_spec: PartitionSpec
    optimizer_spec: PartitionSpec
    notes: tuple[str, ...] = ()
    # why it stays whole on the strategy's tensor axis (None: split there, or no such axis)
    whole: str | None = None


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def check_names(params: Any, mesh: Mesh, strategy: Strategy) -> None:
    """Every axis name the parameters are annotated with has a rule or is a mesh axis; else one
    line listing the names the model uses and how to map them."""
    used = sorted({name for node in jax.tree.leaves(params, is_leaf=_is_variable) if _is_variable(node)
                   for name in (logical_axes_of(node) or ()) if name is not None})
    known = {name for name, _ in strategy.param_rules} | set(mesh.axis_names)
    unknown = [name for name in used if name not in known]
    if unknown:
        example = ", ".join(f"{name!r}: {axis!r}"
                            for name, axis in zip(unknown, ("data", "model", "replica")))
        raise UsageError(
            f"the model's parameters are annotated with axis names {used}; {unknown} are neither shardax's "
            f"logical axes {list(LOGICAL_AXES[1:])} nor axes of the mesh {describe_mesh(mesh)}: say which "
            f"mesh axis (data, model, replica) each plays with axis_names={{{example}}}"
        )


def leaf_layouts(params: Any, mesh: Mesh, strategy: Strategy,
                 derived: Derived | None = None) -> dict[str, LeafLayout]:
    """``{path: LeafLayout}`` for every parameter of an (abstract or concrete) state.

    ``derived``: tensor parallelism read off the model's program, for parameters that carry no
    logical names (``shardax.sharding.derive``). Under a strategy that splits weights over a
    tensor axis, each parameter left whole on it says why in ``LeafLayout.whole``. The mesh has
    the strategy's axes (``shardax.step.settings`` checked them)."""
    check_names(params, mesh, strategy)
    tensor = strategy.tensor_axis(mesh)
    layouts = {}
    for keypath, node in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable):
        path = path_to_str(keypath)
        value = node.get_value() if _is_variable(node) else node
        shape = tuple(np.shape(value))
        annotated = logical_axes_of(node) if _is_variable(node) else None
        logical = annotated
        if unannotated(annotated):
            # nothing (or only a stack's leading layers): read the rest off the program
            found = derived.logical.get(path) if derived else None
            if found is not None:
                logical = found if annotated is None else (LAYERS, *found[1:])
            annotated = None
        spec, notes = strategy.param_spec(logical, shape, mesh, f"parameter {path!r}")
        whole = None
        if tensor is not None and shape and not any(tensor in spec_axes(entry) for entry in spec):
            whole = _why_whole(path, annotated, logical, derived, tensor)
        layouts[path] = LeafLayout(
            path=path, shape=shape, dtype=getattr(value, "dtype", None), logical=logical, spec=spec,
            compute_spec=strategy.compute_spec(spec),
            optimizer_spec=strategy.optimizer_spec(spec, shape, mesh, logical), notes=tuple(notes),
            whole=whole,
        )
    return layouts


def _why_whole(path: str, annotated: Any, logical: Any, derived: Derived | None, tensor: str) -> str:
    if annotated is not None:
        return f"annotated {tuple(annotated)}: none of these names is split over {tensor} here"
    if derived is None:
        return ("no logical names, and no example batch to read its split from (parallelize(..., loss_fn, "
                "example_batch))")
    if path in derived.whole:
        return derived.whole[path]
    return "its split did not divide" if derived.logical.get(path) is not None else "not used by the loss"


def _shardings(tree: Any, mesh: Mesh, spec_of: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda keypath, leaf: NamedSharding(mesh, spec_of(path_to_str(keypath), leaf)), tree
    )


def owning_param(path: str, shape: tuple[int, ...], layouts: dict[str, LeafLayout]) -> LeafLayout | None:
    """The parameter an optimizer-state leaf mirrors: the longest parameter path it ends with."""
    best = None
    for param_path, layout in layouts.items():
        if (path == param_path or path.endswith("/" + param_path)) and layout.shape == shape:
            if best is None or len(param_path) > len(best.path):
                best = layout
    return best


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shardings for parameters (stored and for compute), gradients, optimizer state and batch."""

    mesh: Mesh
    strategy: Strategy
    leaves: dict[str, LeafLayout]

    @classmethod
    def create(cls, params: Any, mesh: Mesh, strategy: Strategy, derived: Derived | None = None) -> "Layout":
        return cls(mesh=mesh, strategy=strategy, leaves=leaf_layouts(params, mesh, strategy, derived))

    def _param_spec(self, attribute: str) -> Any:
        def spec_of(path: str, leaf: Any) -> PartitionSpec:
            layout = self.leaves.get(path)
            return getattr(layout, attribute) if layout else PartitionSpec()

        return spec_of

    def params(self, tree: Any) -> Any:
        """Storage shardings for a parameter tree."""
        return _shardings(tree, self.mesh, self._param_spec("spec"))

    def compute(self, tree: Any) -> Any:
        """Shardings of the parameters while computing (FSDP axes gathered).

        Stacked layers (a ``layers`` logical axis) keep their storage layout here: gathering a
        whole stack up front would hold every layer at once; ``LayerStack`` gathers them one
        layer at a time inside the scan instead.
        """
        def spec_of(path: str, leaf: Any) -> PartitionSpec:
            layout = self.leaves.get(path)
            if layout is None:
                return PartitionSpec()
            return layout.spec if LAYERS in (layout.logical or ()) else layout.compute_spec

        return _shardings(tree, self.mesh, spec_of)

    def gradients(self, tree: Any) -> Any:
        """Where gradients are reduced to: optimizer layout for ZeRO-2, else the parameter's."""
        return _shardings(tree, self.mesh,
                          self._param_spec("optimizer_spec" if self.strategy.shard_gradients else "spec"))

    def optimizer(self, opt_state: Any) -> Any:
        """Optimizer-state shardings: leaves mirroring a parameter follow its optimizer spec."""
        def spec_of(path: str, leaf: Any) -> PartitionSpec:
            owner = owning_param(path, tuple(np.shape(leaf)), self.leaves)
            return owner.optimizer_spec if owner else PartitionSpec()

        return _shardings(opt_state, self.mesh, spec_of)

    def replicated(self, tree: Any) -> Any:
        return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec()), tree)

    def batch(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.strategy.batch_spec(self.mesh))

    def notes(self) -> list[str]:
        """One line per parameter that fell back (a dimension that did not divide), and one per
        parameter that stays whole on the strategy's tensor axis, with why."""
        tensor = self.strategy.tensor_axis(self.mesh)
        return ([f"{leaf.path}: {'; '.join(leaf.notes)}" for leaf in self.leaves.values() if leaf.notes]
                + [f"{leaf.path}: whole on {tensor}: {leaf.whole}"
                   for leaf in self.leaves.values() if leaf.whole])

    def whole_on_tensor_axis(self) -> dict[str, list[str]]:
        """``{reason: [path patterns]}`` of the parameters left whole on the tensor axis, layer
        numbers folded into ``*`` (``layers/*/input_layernorm/weight``)."""
        grouped: dict[str, list[str]] = {}
        for leaf in self.leaves.values():
            if leaf.whole:
                pattern = "/".join("*" if part.isdigit() else part for part in leaf.path.split("/"))
                patterns = grouped.setdefault(leaf.whole, [])
                if pattern not in patterns:
                    patterns.append(pattern)
        return grouped
