"""Parallelism strategies as data: each is a rules table plus a few switches, nothing more.

A strategy says, for a model and a mesh, where parameters are stored, how they are laid out
while computing, where gradients and optimizer state live, and how the batch is split.
``dp``, ``zero1``, ``zero2``, ``fsdp``, ``tp``, ``fsdp_tp`` and ``hsdp`` are values of one
class; a new one is ``Strategy(name=..., param_rules=...)``, no subclassing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.place import spec_axes
from shardax.sharding.rules import LOGICAL_AXES, Rules, add_axis_to_largest_dim, resolve_spec
from shardax.vocabulary import DATA, EXPERT, LAYERS, MODEL, REPLICA, STAGE


def _rules(**targets: Any) -> Rules:
    """A full rules table: the given logical names mapped, every other known name replicated."""
    return tuple((name, targets.get(name)) for name in LOGICAL_AXES if name != "batch")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How one kind of parallelism lays out a training state.

    Attributes:
      name: what ``--strategy`` calls it.
      param_rules: logical axis name -> mesh axes, for parameters as stored.
      batch_axes: mesh axes the batch dimension is split over (absent axes are skipped).
      fsdp_axis: if set, every parameter is stored sharded over this axis: on the dimension the
        rules give it, else on its largest dimension that divides (FSDP / ZeRO-3).
      gather_axes: mesh axes taken out of the parameter layout for compute (FSDP gathers the
        parameters it needs, layer by layer, and reduce-scatters their gradients).
      optimizer_axes: extra mesh axes the optimizer state is sharded over beyond the parameter's
        own layout (ZeRO-1/2).
      shard_gradients: gradients take the optimizer-state layout, so the compiler
        reduce-scatters them instead of all-reducing (ZeRO-2).
      required_axes: mesh axes that must exist for the strategy to mean anything.
      pipeline_axis: if set, the stacked layers (logical ``layers``) are split over this axis
        into pipeline stages, and a model's stack runs as a pipeline of microbatches over it
        (``shardax.runtime.pipeline``).
      description: one line for tables and ``--help``.
    """

    name: str
    param_rules: Rules
    batch_axes: tuple[str, ...] = (DATA,)
    fsdp_axis: str | None = None
    gather_axes: tuple[str, ...] = ()
    optimizer_axes: tuple[str, ...] = ()
    shard_gradients: bool = False
    required_axes: tuple[str, ...] = (DATA,)
    pipeline_axis: str | None = None
    description: str = ""

    def check_mesh(self, mesh: Mesh) -> None:
        missing = [axis for axis in self.required_axes if axis not in mesh.shape]
        if missing:
            example = ",".join(f"{axis}={'-1' if i == 0 else 2}" for i, axis in enumerate(self.required_axes))
            raise UsageError(
                f"strategy {self.name!r} needs mesh axes {self.required_axes} but the mesh is "
                f"{describe_mesh(mesh)}; use e.g. `mesh='{example}'`"
            )

    def tensor_axis(self, mesh: Mesh) -> str | None:
        """The mesh axis this strategy splits weights' hidden dimensions over (Megatron's ``model``),
        if the mesh has it with more than one device."""
        return self._axis_of("mlp", mesh)

    def expert_axis(self, mesh: Mesh) -> str | None:
        """The mesh axis this strategy splits a mixture's experts over, if the mesh has it with more
        than one device."""
        return self._axis_of("expert", mesh)

    def _axis_of(self, logical: str, mesh: Mesh) -> str | None:
        axes = [a for a in spec_axes(dict(self.param_rules).get(logical)) if mesh.shape.get(a, 1) > 1]
        return axes[0] if axes else None

    def param_spec(
        self, logical: tuple[str | None, ...] | None, shape: tuple[int, ...], mesh: Mesh, where: str
    ) -> tuple[PartitionSpec, list[str]]:
        """Storage layout of one parameter, with notes on anything that fell back."""
        notes: list[str] = []
        spec = PartitionSpec()
        if logical is not None:
            spec, notes = resolve_spec(logical, shape, mesh, self.param_rules, where)
        if self.fsdp_axis is not None:
            with_fsdp = add_axis_to_largest_dim(spec, shape, mesh, self.fsdp_axis, logical)
            if with_fsdp is not None:
                spec = with_fsdp
            elif shape:  # scalars are replicated without comment
                notes.append(_no_room(spec, shape, logical, self.fsdp_axis, mesh.shape[self.fsdp_axis]))
        return spec, notes

    def compute_spec(self, param_spec: PartitionSpec) -> PartitionSpec:
        """The parameter's layout while computing: ``param_spec`` without the gathered axes."""
        def keep(entry: Any) -> Any:
            axes = tuple(a for a in spec_axes(entry) if a not in self.gather_axes)
            return None if not axes else axes[0] if len(axes) == 1 else axes

        return PartitionSpec(*(keep(entry) for entry in param_spec))

    def optimizer_spec(
        self, param_spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh,
        logical: tuple[str | None, ...] | None = None,
    ) -> PartitionSpec:
        """Layout of optimizer state that mirrors a parameter (Adam's mu and nu)."""
        spec = param_spec
        for axis in self.optimizer_axes:
            spec = add_axis_to_largest_dim(spec, shape, mesh, axis, logical) or spec
        return spec

    def batch_spec(self, mesh: Mesh) -> PartitionSpec:
        """Split the leading (batch) dimension over every batch axis the mesh has."""
        axes = tuple(a for a in self.batch_axes if a in mesh.shape)
        return PartitionSpec(axes if len(axes) > 1 else (axes[0] if axes else None))


def _no_room(spec: PartitionSpec, shape: tuple[int, ...], logical: tuple[str | None, ...] | None,
             axis: str, size: int) -> str:
    """Why no dimension of a parameter of ``shape`` could take ``axis``, dimension by dimension."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    names = logical if logical is not None and len(logical) == len(shape) else (None,) * len(shape)
    reasons = []
    for length, name, entry in zip(shape, names, entries):
        label = f"{name}={length}" if name else f"{length}"
        if name == LAYERS:
            reasons.append(f"{label} is the stacked layers, never split")
        elif entry is not None:
            reasons.append(f"{label} is split over {entry} already")
        else:
            reasons.append(f"{label} is not a multiple of {size}")
    return f"replicated over {axis}={size}, no dimension of {tuple(shape)} can take it: " + ", ".join(reasons)


STRATEGIES: dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        Strategy("dp", _rules(), description="replicated state, gradients all-reduced"),
        Strategy("zero1", _rules(), optimizer_axes=(DATA,),
                 description="optimizer state sharded over data"),
        Strategy("zero2", _rules(), optimizer_axes=(DATA,), shard_gradients=True,
                 description="optimizer state and gradients sharded over data (reduce-scatter)"),
        Strategy("fsdp", _rules(embed=DATA), fsdp_axis=DATA, gather_axes=(DATA,),
                 description="parameters, gradients and optimizer state sharded over data (ZeRO-3)"),
        Strategy("tp", _rules(mlp=MODEL, heads=MODEL, vocab=MODEL), required_axes=(MODEL,),
                 description="Megatron tensor parallelism: heads and MLP hidden over model"),
        Strategy("fsdp_tp", _rules(embed=DATA, mlp=MODEL, heads=MODEL, vocab=MODEL),
                 fsdp_axis=DATA, gather_axes=(DATA,), required_axes=(DATA, MODEL),
                 description="FSDP over data x tensor parallelism over model (2-D mesh)"),
        Strategy("hsdp", _rules(embed=DATA), batch_axes=(REPLICA, DATA), fsdp_axis=DATA,
                 gather_axes=(DATA,), required_axes=(REPLICA, DATA),
                 description="FSDP within groups over data, replicated across groups over replica"),
        Strategy("ep", _rules(expert=EXPERT), batch_axes=(DATA, EXPERT), required_axes=(EXPERT,),
                 description="expert parallelism: each group of experts on its devices over expert, tokens "
                             "exchanged by all-to-all, the rest data-parallel over data and expert"),
        Strategy("fsdp_ep", _rules(embed=DATA, expert=EXPERT), batch_axes=(DATA, EXPERT),
                 fsdp_axis=DATA, gather_axes=(DATA,), required_axes=(DATA, EXPERT),
                 description="expert parallelism over expert x FSDP over data"),
        Strategy("ep_tp", _rules(expert=EXPERT, mlp=MODEL, heads=MODEL, vocab=MODEL),
                 batch_axes=(DATA, EXPERT), required_axes=(EXPERT, MODEL),
                 description="expert parallelism over expert x tensor parallelism over model"),
        Strategy("pp", _rules(layers=STAGE), required_axes=(STAGE,), pipeline_axis=STAGE,
                 description="pipeline: layers split into stages over stage, microbatches flow through"),
        Strategy("pp_fsdp", _rules(layers=STAGE, embed=DATA), fsdp_axis=DATA, gather_axes=(DATA,),
                 required_axes=(STAGE, DATA), pipeline_axis=STAGE,
                 description="pipeline over stage x FSDP over data within each stage"),
        Strategy("pp_tp", _rules(layers=STAGE, mlp=MODEL, heads=MODEL, vocab=MODEL),
                 required_axes=(STAGE, MODEL), pipeline_axis=STAGE,
                 description="pipeline over stage x tensor parallelism over model (x data parallelism over "
                             "data)"),
    )
}


_DEFAULT_MESH = {"ep": "data=-1,expert=2", "fsdp_ep": "data=-1,expert=2", "ep_tp": "data=-1,expert=2,model=2",
                 "tp": "data=-1,model=2", "fsdp_tp": "data=-1,model=2", "hsdp": "replica=2,data=-1",
                 "pp": "stage=2,data=-1", "pp_fsdp": "stage=2,data=-1", "pp_tp": "stage=2,data=-1,model=2"}


def default_mesh(strategy: str) -> str:
    """The mesh a strategy gets when none is given: every device on ``data``, plus what it needs."""
    return _DEFAULT_MESH.get(strategy, "data=-1")


def get_strategy(strategy: str | Strategy) -> Strategy:
    """A built-in strategy by name, or the given ``Strategy`` itself."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy]
