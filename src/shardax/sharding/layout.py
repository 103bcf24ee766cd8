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

from shardax.sharding.paths import path_to_str
from shardax.sharding.rules import logical_axes_of
from shardax.sharding.strategies import Strategy, get_strategy


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


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def leaf_layouts(params: Any, mesh: Mesh, strategy: Strategy | str) -> dict[str, LeafLayout]:
    """``{path: LeafLayout}`` for every parameter of an (abstract or concrete) state."""
    strategy = get_strategy(strategy)
    strategy.check_mesh(mesh)
    layouts = {}
    for keypath, node in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable):
        path = path_to_str(keypath)
        value = node.get_value() if _is_variable(node) else node
        shape = tuple(np.shape(value))
        logical = logical_axes_of(node) if _is_variable(node) else None
        spec, notes = strategy.param_spec(logical, shape, mesh, f"parameter {path!r}")
        layouts[path] = LeafLayout(
            path=path, shape=shape, dtype=getattr(value, "dtype", None), logical=logical, spec=spec,
            compute_spec=strategy.compute_spec(spec),
            optimizer_spec=strategy.optimizer_spec(spec, shape, mesh, logical), notes=tuple(notes),
        )
    return layouts


def _shardings(tree: Any, mesh: Mesh, spec_of: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda keypath, leaf: NamedSharding(mesh, spec_of(path_to_str(keypath), leaf)), tree
    )


def _owning_param(path: str, shape: tuple[int, ...], layouts: dict[str, LeafLayout]) -> LeafLayout | None:
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
    def create(cls, params: Any, mesh: Mesh, strategy: Strategy | str) -> "Layout":
        strategy = get_strategy(strategy)
        return cls(mesh=mesh, strategy=strategy, leaves=leaf_layouts(params, mesh, strategy))

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
        whole stack up front would hold every layer at once; ``for_compute`` gathers them one
        layer at a time inside the scan instead.
        """
        def spec_of(path: str, leaf: Any) -> PartitionSpec:
            layout = self.leaves.get(path)
            if layout is None:
                return PartitionSpec()
            return layout.spec if "layers" in (layout.logical or ()) else layout.compute_spec

        return _shardings(tree, self.mesh, spec_of)

    def gradients(self, tree: Any) -> Any:
        """Where gradients are reduced to: optimizer layout for ZeRO-2, else the parameter's."""
        return _shardings(tree, self.mesh, self._param_spec("optimizer_spec" if self.strategy.shard_gradients else "spec"))

    def optimizer(self, opt_state: Any) -> Any:
        """Optimizer-state shardings: leaves mirroring a parameter follow its optimizer spec."""
        def spec_of(path: str, leaf: Any) -> PartitionSpec:
            owner = _owning_param(path, tuple(np.shape(leaf)), self.leaves)
            return owner.optimizer_spec if owner else PartitionSpec()

        return _shardings(opt_state, self.mesh, spec_of)

    def replicated(self, tree: Any) -> Any:
        return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec()), tree)

    def batch(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.strategy.batch_spec(self.mesh))

    def notes(self) -> list[str]:
        """One line per parameter that fell back (a dimension that did not divide)."""
        return [f"{leaf.path}: {'; '.join(leaf.notes)}" for leaf in self.leaves.values() if leaf.notes]
