"""Named parts: several models in one run, each with its own optimizer or frozen, laid out together.

    parts = {"generator": Part(lambda rngs: Generator(rngs=rngs), optax.adam(2e-4)),
             "discriminator": Part(lambda rngs: Discriminator(rngs=rngs), optax.adam(2e-4))}
    trainer = Trainer(parts=parts, step=gan_step, strategy="fsdp")

Each part is laid out by the run's strategy on the run's mesh as a lone model would be
(``parallelize``), initialised straight into its shards, and its parameters, optimizer state and
variables live in one ``TrainState`` whose trees are keyed by part name: a checkpoint holds them
together (``params/generator/...``, ``opt_state/discriminator/...``) and resumes them exactly. A
frozen part (``Part(model)``, no optimizer) has no optimizer state and is never updated: a
distillation's teacher, DPO's reference model. The step over the parts is the user's
(``shardax.step.parts``).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.model_parallel import ParallelModel
from shardax.model_state import ModelFactory, build_state, trained_part, warn_if_updates_round_away
from shardax.part_use import forward_as_loss, step_as_loss
from shardax.runtime.pipeline import Schedule
from shardax.sharding.axis_names import AxisNames
from shardax.sharding.checks import check_split_axes
from shardax.sharding.layout import Layout
from shardax.sharding.strategies import Strategy
from shardax.step.ema import averaged, keeps_average
from shardax.step.parts import PartPlan, StepFn, build_parts_eval_step, build_parts_step
from shardax.step.settings import StepSettings
from shardax.step.state import TrainState


@dataclasses.dataclass(frozen=True)
class Part:
    """One model of a run.

    Args:
      model: ``lambda rngs: MyModel(..., rngs=rngs)``.
      optimizer: its optax transformation; None: frozen (no gradient, no optimizer state).
      forward: ``lambda model, batch: model(batch["x"])``: how the step calls it. Under ``tp``
        and ``fsdp_tp`` the weights without logical names are split as Megatron would, read off
        what the run's step computes with the part on the trainer's ``example_batch``; give
        ``forward`` to read them off this call alone instead.
      trainable: an NNX filter of the parameters its optimizer updates (default: every one, or
        its ``nnx.LoRAParam`` adapters alone when it holds some).
      seed: its initialisation; default one drawn from the trainer's seed and the part's name
        (``part_seed``), so that adding, removing or reordering other parts leaves it as it was.
      init_from: weights to start from instead of ``seed``'s: a trained ``nnx.Module`` of the
        same structure (a teacher, a reference model), or its ``nnx.state``; each device takes
        its own slices of a copy of them (the module given stays usable). Or an object with
        ``initial_state(parallel, seed)`` (``shardax.hf.factory(path)``: a checkpoint's weights,
        each device's slices read straight from the files into the part's layout).
    """

    model: ModelFactory
    optimizer: optax.GradientTransformation | None = None
    forward: Callable[[nnx.Module, Any], Any] | None = None
    trainable: Any = None
    seed: int | None = None
    init_from: Any = None


def part_seed(seed: int, name: str) -> int:
    """The seed of part ``name`` in a run seeded ``seed``: from the name (CRC-32, the same in every
    process and Python), not the part's position, so other parts never change it."""
    return (seed + zlib.crc32(name.encode())) % 2**31


def check_parts(parts: Any) -> dict[str, Part]:
    """``parts`` as a dict of ``Part``, refused in one line unless it is one."""
    if not isinstance(parts, Mapping) or not parts:
        raise UsageError(f"parts={type(parts).__name__}; give a dict of named parts, e.g. "
                         "{'generator': Part(make_generator, optax.adam(2e-4)), 'teacher': "
                         "Part(make_teacher)}")
    for name, part in parts.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"part name {name!r} is not a Python identifier; name parts like 'generator' or "
                             "'teacher'")
        if not isinstance(part, Part):
            given = f"the class {part.__name__}" if isinstance(part, type) else f"a {type(part).__name__}"
            raise UsageError(f"part {name!r} is {given}, not a Part; wrap it: Part(lambda rngs: "
                             "Model(rngs=rngs), optax.adam(1e-3)), or Part(...) with no optimizer to freeze "
                             "it")
        if part.optimizer is not None and not (hasattr(part.optimizer, "init")
                                               and hasattr(part.optimizer, "update")):
            raise UsageError(f"part {name!r} has optimizer {type(part.optimizer).__name__}; give one optax "
                             "transformation per part (e.g. optax.adam(1e-3)), or None to freeze the part")
    if all(part.optimizer is None for part in parts.values()):
        raise UsageError("every part is frozen, so nothing would train; give at least one part an optimizer")
    return dict(parts)


def _check_split_axes(models: dict[str, ParallelModel], read_off: bool) -> None:
    """Refuse a tensor or expert axis that splits no weight of any part (one part left whole is
    listed in ``describe`` with its reason, as a lone model's whole weights are)."""
    check_split_axes([model.layout for model in models.values()], read_off,
                     hint="give the Trainer example_batch, so shardax reads the split off the step")


def _described(tree: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Each array's path and shape: what must match for weights to be a part's (the Variables'
    own metadata, such as how they were first placed, may differ)."""
    return [(jax.tree_util.keystr(path), tuple(jnp.shape(leaf)))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _like(tree: Any, template: Any) -> Any:
    """``tree``'s arrays in ``template``'s structure (the same paths and shapes)."""
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(tree))


class ParallelRun(Protocol):
    """What the Trainer runs on: a lone model laid out (``ParallelModel``, the one part named
    ``model``) or several parts (``ParallelParts``), through one interface."""

    mesh: Mesh
    strategy: Strategy
    layout: Layout  # the (first) part's: the batch's sharding is every part's
    abstract_state: TrainState
    state_shardings: TrainState

    @property
    def names(self) -> tuple[str, ...]: ...

    def frozen(self) -> tuple[str, ...]: ...

    def classes(self) -> dict[str, str]: ...

    def init(self, seed: int = 0) -> TrainState: ...

    def train_step(self, fn: Any, *, nonfinite: str = "stop") -> Callable[[TrainState, Any], Any]: ...

    def eval_step(self, fn: Any) -> Callable[[TrainState, Any], dict]: ...

    def schedule(self) -> Schedule | None: ...

    def context_attention(self) -> str | None: ...

    def layouts(self) -> dict[str, Layout]: ...

    def averaged_parts(self, state: TrainState) -> list[str]: ...

    def ema_state(self, state: TrainState) -> TrainState: ...

    def view(self, state: TrainState, name: str, *, ema: bool = False) -> nnx.Module: ...


@dataclasses.dataclass(frozen=True)
class ParallelParts:
    """Named parts laid out on one mesh by one strategy; ``models`` holds each part's layout."""

    parts: dict[str, Part]
    models: dict[str, ParallelModel]
    abstract_state: TrainState
    state_shardings: TrainState

    @classmethod
    def create(cls, parts: Mapping[str, Part], settings: StepSettings, *, axis_names: AxisNames = None,
               example_batch: Any = None, step: StepFn | None = None) -> ParallelParts:
        """Lay each part out by ``settings``; under ``tp``, ``fsdp_tp`` and ``pp_tp`` the weights
        without logical names are split as Megatron would, read off each part's ``forward``, or
        else off the user's ``step`` (traced on ``example_batch``'s shapes, no FLOP spent)."""
        parts = check_parts(parts)
        models = {}
        for name, part in parts.items():
            read_off = (forward_as_loss(part.forward) if part.forward is not None else
                        step_as_loss(step, name, parts) if step is not None else None)
            derive = read_off is not None and example_batch is not None
            try:
                models[name] = ParallelModel.create(
                    part.model, part.optimizer or optax.identity(), settings, axis_names=axis_names,
                    loss_fn=read_off if derive else None, example_batch=example_batch if derive else None,
                    trainable=part.trainable, check_tensor=False)
            except UsageError as error:
                raise UsageError(f"part {name!r}: {error}") from None
        _check_split_axes(models, example_batch is not None and (step is not None or all(
            part.forward is not None for part in parts.values())))
        trained = [name for name, part in parts.items() if part.optimizer is not None]
        mesh = next(iter(models.values())).mesh
        scalar = NamedSharding(mesh, PartitionSpec())

        def combined(pick: Callable[[ParallelModel], TrainState], step: Any) -> TrainState:
            return TrainState(step=step, skipped=step,
                              params={name: pick(model).params for name, model in models.items()},
                              opt_state={name: pick(models[name]).opt_state for name in trained},
                              rest={name: pick(model).rest for name, model in models.items()})

        return cls(parts, models, combined(lambda m: m.abstract_state, jax.ShapeDtypeStruct((), jnp.int32)),
                   combined(lambda m: m.state_shardings, scalar))

    @property
    def first(self) -> ParallelModel:
        return next(iter(self.models.values()))

    @property
    def mesh(self) -> Mesh:
        return self.first.mesh

    @property
    def strategy(self) -> Strategy:
        return self.first.strategy

    @property
    def layout(self) -> Layout:
        """The first part's layout (the batch's sharding is every part's)."""
        return self.first.layout

    def seeds(self, seed: int) -> dict[str, int]:
        return {name: part_seed(seed, name) if part.seed is None else part.seed
                for name, part in self.parts.items()}

    def init(self, seed: int = 0) -> TrainState:
        """Every part initialised straight into its shards (in one program)."""
        seeds = self.seeds(seed)

        def build() -> TrainState:
            states = {name: build_state(model.factory, model.tx, seeds[name], self.mesh, model.trainable)
                      for name, model in self.models.items()}
            zero = jnp.zeros((), jnp.int32)
            return TrainState(step=zero, skipped=zero, params={name: s.params for name, s in states.items()},
                              opt_state={name: states[name].opt_state
                                         for name in self.abstract_state.opt_state},
                              rest={name: s.rest for name, s in states.items()})

        state = jax.jit(build, out_shardings=self.state_shardings)()
        for name, part in self.parts.items():
            if callable(getattr(part.init_from, "initial_state", None)):  # read into the part's own layout
                loaded = part.init_from.initial_state(self.models[name], seeds[name])
                state = state.replace(params={**state.params, name: loaded.params},
                                      rest={**state.rest, name: loaded.rest})
            elif part.init_from is not None:
                state = self._start_from(state, name, part.init_from)
        return state

    def _start_from(self, state: TrainState, name: str, source: Any) -> TrainState:
        """``state`` with part ``name``'s parameters (and its other variables, when ``source`` has
        them) taken from ``source``, each device given its slices."""
        given = nnx.state(source) if isinstance(source, nnx.Module) else source
        params, rest = (nnx.split_state(given, nnx.Param, ...) if isinstance(given, nnx.State)
                        else (given, None))
        model = self.models[name]
        for what, tree, template in (("parameters", params, state.params[name]),
                                     ("variables", rest, state.rest[name])):
            if what == "variables" and not jax.tree.leaves(tree):
                continue  # parameters alone: the part's own variables stay
            if _described(tree) != _described(template):
                shapes = jax.tree.leaves(tree)
                raise UsageError(f"Part(init_from=...) of part {name!r} holds {what} of another structure "
                                 f"than {type(model._abstract_model()).__name__}'s ({len(shapes)} arrays, "
                                 f"{len(jax.tree.leaves(template))} expected); give a module built by the "
                                 "part's own model factory, or its nnx.state")
        # copies (may_alias=False): the run's state is donated to each step, and the caller's module
        # must outlive it
        params = jax.device_put(_like(params, state.params[name]), model.state_shardings.params,
                                may_alias=False)
        state = state.replace(params={**state.params, name: params})
        if rest is not None and jax.tree.leaves(rest):
            rest = jax.device_put(_like(rest, state.rest[name]), model.state_shardings.rest, may_alias=False)
            state = state.replace(rest={**state.rest, name: rest})
        return state

    def schedule(self) -> Schedule | None:
        """The pipeline schedule every part runs on (None unless the strategy pipelines), checked
        against each part's stack of layers."""
        schedules = [model.schedule() for model in self.models.values()]
        return schedules[0]

    def context_attention(self) -> str | None:
        """How each part's attention spans a sequence split over ``context`` (None: no such axis);
        a part that attends through no ``shardax.blocks.Attention`` is refused, naming it."""
        variants = {}
        for name, model in self.models.items():
            try:
                variants[name] = model.context_attention()
            except UsageError as error:
                raise UsageError(f"part {name!r}: {error}") from None
        return next(iter(variants.values()))

    def plans(self) -> dict[str, PartPlan]:
        """Each part's structure, told how this step runs (its stack's pipeline and sequence split,
        as a lone model's), its optimizer and layouts."""
        plans = {}
        schedule, context = self.schedule(), self.context_attention()
        for name, model in self.models.items():
            params = model.abstract_state.params
            plans[name] = PartPlan(model.configured(schedule, context), self.parts[name].optimizer,
                                   model.trainable,
                                   model.state_shardings.params, model.layout.compute(params),
                                   model.layout.gradients(params))
        return plans

    def _under_mesh(self) -> Any:
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    def train_step(self, step_fn: StepFn, *, nonfinite: str = "stop",
                   donate: bool = True) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
        """The compiled ``(state, batch) -> (state, metrics)`` of the user's ``step_fn(parts, batch)``."""
        for name, model in self.models.items():
            if self.parts[name].optimizer is not None:  # a frozen part is as good in 16 bits
                warn_if_updates_round_away(model.abstract_state.params, model.trainable, f"part {name!r}")
        # on TPUs a dropped update is a select, except under a pipeline (see keep_where)
        select = self.mesh.devices.flat[0].platform == "tpu" and self.strategy.pipeline_axis is None
        step = build_parts_step(self.plans(), step_fn, nonfinite=nonfinite, layer_layout=self._under_mesh,
                                select_update=select)
        return jax.jit(step, in_shardings=(self.state_shardings, self.layout.batch()),
                       out_shardings=(self.state_shardings, NamedSharding(self.mesh, PartitionSpec())),
                       donate_argnums=(0,) if donate else ())

    def eval_step(self, eval_fn: StepFn) -> Callable[[TrainState, Any], dict]:
        evaluate = build_parts_eval_step(self.plans(), eval_fn, layer_layout=self._under_mesh)
        return jax.jit(evaluate, in_shardings=(self.state_shardings, self.layout.batch()),
                       out_shardings=NamedSharding(self.mesh, PartitionSpec()))

    def averaged_parts(self, state: TrainState) -> list[str]:
        """The parts whose optimizer keeps a moving average of their weights (``shardax.ema_params``)."""
        return [name for name, opt_state in state.opt_state.items() if keeps_average(opt_state)]

    def ema_state(self, state: TrainState) -> TrainState:
        """``state`` with each averaged part's trained parameters replaced by their moving average."""
        names = self.averaged_parts(state)
        if not names:
            raise UsageError("no part keeps a moving average of its weights; chain shardax.ema_params(decay) "
                             "last in a part's optimizer: Part(model, optax.chain(optax.adam(1e-3), "
                             "ema_params(0.999)))")
        params = dict(state.params)
        for name in names:
            model = self.models[name]
            average = averaged(state.opt_state[name], trained_part(params[name], model.trainable))
            params[name] = jax.device_put(nnx.merge_state(params[name], average),
                                          model.state_shardings.params)
        return state.replace(params=params)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.parts)

    def frozen(self) -> tuple[str, ...]:
        return tuple(name for name, part in self.parts.items() if part.optimizer is None)

    def classes(self) -> dict[str, str]:
        """Each part's class name, by part name."""
        return {name: type(model._abstract_model()).__name__ for name, model in self.models.items()}

    def layouts(self) -> dict[str, Layout]:
        """Each part's layout by the prefix its paths are reported under (``generator/``)."""
        return {f"{name}/": model.layout for name, model in self.models.items()}

    def view(self, state: TrainState, name: str, *, ema: bool = False) -> nnx.Module:
        """Part ``name`` holding ``state``'s arrays (its moving average with ``ema``) in Variables
        of its own, in eval mode."""
        if ema and name not in self.averaged_parts(state):
            raise UsageError(f"part {name!r} keeps no moving average of its weights; chain "
                             "shardax.ema_params(decay) last in its optimizer, or take it with ema=False")
        model = self.part(self.ema_state(state) if ema else state, name)
        model.eval()
        return model

    def part(self, state: TrainState, name: str) -> nnx.Module:
        """Part ``name`` as an ``nnx.Module`` holding ``state``'s arrays (sharded as they are) in
        Variables of its own: what it changes (RNG counters, statistics) never reaches ``state``."""
        if name not in self.models:
            raise UsageError(f"no part named {name!r}; the parts are {', '.join(map(repr, self.models))}")
        return nnx.merge(self.models[name].graphdef, state.params[name], state.rest[name], copy=True)

