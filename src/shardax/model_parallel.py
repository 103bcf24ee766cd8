"""Model parallelism made real: a model, an optimizer and a strategy laid out on a mesh.

    parallel = parallelize(lambda rngs: MyModel(rngs=rngs), optax.adamw(1e-3), mesh, "fsdp")
    state = parallel.init(seed=0)                 # straight into shards
    step = parallel.train_step(loss_fn)           # compiled for this layout and its settings
    state, metrics = step(state, parallel.place_batch(batch))

FSDP (ZeRO-3), ZeRO-1/2, tensor parallelism, their 2-D combinations and HSDP are all the same
code with a different ``Strategy``; ``reshard`` moves a state between strategies and meshes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.blocks import Attention, LayerStack, StackPlan, blocks_of, split_sequences
from shardax.cpu_devices import warn_if_starved
from shardax.errors import UsageError
from shardax.experts import ExpertLayout, ExpertMixture
from shardax.model_state import (
    ModelFactory,
    all_annotated,
    build_state,
    check_pipeline_axis,
    derive_unannotated,
    holding_arrays,
    routing_grouped_convs,
    trainable_filter,
    trained_part,
    warn_if_updates_round_away,
)
from shardax.runtime.context import AXIS as CONTEXT_AXIS, ContextLayout
from shardax.runtime.pipeline import PipelineRun, Schedule
from shardax.sharding.axis_names import AxisNames, named_mesh, named_strategy, parse_axis_names
from shardax.sharding.checks import check_split_axes
from shardax.sharding.compute import layer_specs
from shardax.sharding.layout import Layout
from shardax.sharding.place import place_batch, spec_axes
from shardax.sharding.strategies import Strategy
from shardax.step.ema import averaged, keeps_average
from shardax.step.loss import LossFn
from shardax.step.settings import StepSettings
from shardax.step.state import TrainState
from shardax.step.train import build_eval_step, build_train_step
from shardax.vocabulary import LAYERS

LONE = "model"  # the name of a lone model as a part of its run


@dataclasses.dataclass(frozen=True)
class ParallelModel:
    """A model factory and optimizer laid out on ``mesh`` by ``strategy``.

    Attributes:
      graphdef: the model's structure (static); ``merge`` rebuilds a module from a state.
      layout: per-parameter specs and the shardings of every tree.
      abstract_state: the ``TrainState`` as shapes and dtypes (no memory).
      state_shardings: a ``TrainState`` of ``NamedSharding``: where each leaf lives.
      settings: how each step is computed (``StepSettings``: gradient accumulation, a pipeline's
        schedule, context attention), resolved once; ``with_settings`` gives another.
      trainable: an NNX filter of the parameters the optimizer updates (None: every one);
        the others stay as they are, have no optimizer state and no gradient is computed for them.
    """

    factory: ModelFactory
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    layout: Layout
    abstract_state: TrainState
    state_shardings: TrainState
    settings: StepSettings
    trainable: Any = None

    @classmethod
    def create(cls, factory: ModelFactory, tx: optax.GradientTransformation, settings: StepSettings, *,
               axis_names: AxisNames = None, loss_fn: LossFn | None = None, example_batch: Any = None,
               trainable: Any = None, check_tensor: bool = True) -> ParallelModel:
        """Lay ``factory``'s model and ``tx`` out by ``settings`` (resolved and checked once, see
        ``shardax.step.settings``); the keywords are ``parallelize``'s. ``check_tensor=False``: a tensor axis
        that splits none of its weights is not refused here (a run of parts checks its parts together)."""
        return _lay_out(factory, tx, settings, axis_names=axis_names, loss_fn=loss_fn,
                        example_batch=example_batch, trainable=trainable, check_tensor=check_tensor)

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def strategy(self) -> Strategy:
        return self.layout.strategy

    def init(self, seed: int = 0) -> TrainState:
        """Initialise straight into shards: each device computes only what it holds."""
        build = functools.partial(build_state, self.factory, self.tx, seed, self.mesh, self.trainable)
        return jax.jit(build, out_shardings=self.state_shardings)()

    def place_batch(self, batch: Any) -> Any:
        """Split a batch (or this process's slice of it) over the strategy's batch axes."""
        return place_batch(batch, self.layout.batch())

    def with_settings(self, **changes: Any) -> ParallelModel:
        """This layout with other step settings (``grad_accum``, ``microbatches``,
        ``pipeline_repeats``, ``context_attention``), checked as ``parallelize`` checks them."""
        return dataclasses.replace(self, settings=self.settings.replace(**changes))

    def train_step(self, loss_fn: LossFn, *, donate: bool = True,
                   nonfinite: str = "stop") -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
        """A compiled ``(state, batch) -> (state, metrics)`` for this layout and its settings.

        ``loss_fn(model, batch)`` returns the mean loss of the batch, or ``(loss, {"name": scalar, ...})``;
        the model runs in training mode (``model.train()``) and whatever it updates in ``__call__`` (batch
        statistics, RNG counters) is carried in ``state.rest``. ``metrics`` holds ``loss``, ``grad_norm``
        and the named values, each averaged over the global batch. With ``settings.grad_accum=k`` the batch
        is split into k microbatches whose gradients and metrics are averaged (same result, less activation
        memory). A step with a non-finite loss or gradient norm is not applied and counted in
        ``state.skipped``; with ``nonfinite="stop"`` no later step is applied either (see
        ``build_train_step``). Under a pipeline strategy, ``settings.microbatches`` (default: the number of
        stages) flow through the stages, ``pipeline_repeats`` times round for a circular schedule. On a mesh
        with a ``context`` axis, sequences are split over it and attention gathers the rest by
        ``settings.context_attention``: ``all-gather`` or ``ring`` (``shardax.runtime.context``)."""
        params = self.abstract_state.params
        warn_if_updates_round_away(params, self.trainable)
        graphdef = self.configured(self.schedule(), self.context_attention())
        step = build_train_step(
            graphdef, self.tx, loss_fn,
            param_shardings=self.state_shardings.params,
            compute_shardings=self.layout.compute(params),
            gradient_shardings=self.layout.gradients(params),
            batch_sharding=self.layout.batch(),
            grad_accum=self.settings.grad_accum,
            layer_layout=self._layer_layout,
            nonfinite=nonfinite,
            trainable=self.trainable,
            select_update=self.mesh.devices.flat[0].platform == "tpu"
                          and self.layout.strategy.pipeline_axis is None,
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(
            step,
            in_shardings=(self.state_shardings, self.layout.batch()),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,) if donate else (),
        )

    def eval_step(self, loss_fn: LossFn) -> Callable[[TrainState, Any], dict]:
        """A compiled ``(state, batch) -> metrics`` in eval mode (``model.eval()``: running
        averages, no dropout), with the train step's layouts; the state is left as it was."""
        graphdef = self.configured(self.schedule(), self.context_attention())
        evaluate = build_eval_step(graphdef, loss_fn,
                                   compute_shardings=self.layout.compute(self.abstract_state.params),
                                   layer_layout=self._layer_layout)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(evaluate, in_shardings=(self.state_shardings, self.layout.batch()),
                       out_shardings=replicated)

    def schedule(self) -> Schedule | None:
        """The pipeline schedule of this layout (None unless the strategy pipelines): as many
        microbatches as stages unless the settings say."""
        axis, microbatches = self.strategy.pipeline_axis, self.settings.microbatches
        if axis is None:
            return None
        stages = self.mesh.shape[axis]
        schedule = Schedule(stages, stages if microbatches is None else microbatches,
                            self.settings.pipeline_repeats)
        for leaf in self.layout.leaves.values():  # the stacked layers must split evenly: say so now
            if leaf.logical and leaf.logical[0] == LAYERS:
                schedule.check_layers(leaf.shape[0])
        return schedule

    def context_attention(self) -> str | None:
        """How attention spans a sequence split over the mesh's ``context`` axis (None: no such
        axis of more than one device)."""
        variant = self.settings.context_attention
        if self.mesh.shape.get(CONTEXT_AXIS, 1) == 1:
            if variant != "all-gather":
                raise UsageError(f"`context_attention={variant!r}` is for meshes with a {CONTEXT_AXIS!r} "
                                 f"axis; this mesh has none (e.g. `mesh='data=2,{CONTEXT_AXIS}=4'`)")
            return None
        if self.strategy.pipeline_axis is not None:
            raise UsageError(f"a {CONTEXT_AXIS!r} mesh axis does not combine with pipeline strategies yet; "
                             f"use dp, fsdp, tp or fsdp_tp with it, or drop {CONTEXT_AXIS} from the mesh")
        if not blocks_of(self._abstract_model(), Attention):
            raise UsageError(f"a {CONTEXT_AXIS!r} mesh axis splits sequences for models that attend through "
                             "shardax.blocks.Attention, and this model has none, so every device of "
                             f"{CONTEXT_AXIS} would repeat the same work; drop {CONTEXT_AXIS} from the mesh, "
                             "or attend with shardax.blocks.Attention")
        return variant

    def _abstract_model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.abstract_state.params, self.abstract_state.rest)

    def configured(self, schedule: Schedule | None = None, context: str | None = None) -> nnx.GraphDef:
        """The model's structure with its blocks told how this step runs: each ``LayerStack``
        its pipeline (with every stacked parameter's storage, compute and gradient specs) and
        sequence split, each ``Attention`` its sequence split. Nothing is read from ambient state."""
        model = self._abstract_model()
        sequence = None
        if context is not None:
            heads = dict(self.strategy.param_rules).get("heads")
            sequence = ContextLayout.create(self.mesh, context, self.strategy.batch_axes,
                                            tuple(spec_axes(heads)) if heads else ())
        split_sequences(model, sequence)
        axis = dict(self.strategy.param_rules).get("expert")
        axis = axis if axis and self.mesh.shape.get(axis, 1) > 1 else None
        for _, mixture in blocks_of(model, ExpertMixture):  # shardax.experts: routes its own tokens
            local = mixture.routes_per_device and schedule is None
            mixture.expert_layout = (ExpertLayout(self.mesh, axis, self.strategy.batch_axes,
                                                  sequence and sequence.axis) if local or axis else None)
        for path, stack in blocks_of(model, LayerStack):
            prefix = f"{path}/layers/"
            specs = tuple((leaf.path[len(prefix):],
                           layer_specs(self.strategy, leaf.logical, leaf.shape, self.mesh,
                                         f"parameter {leaf.path!r}"))
                          for leaf in self.layout.leaves.values()
                          if leaf.path.startswith(prefix) and leaf.logical and leaf.logical[0] == LAYERS)
            pipeline = None
            if schedule is not None:
                pipeline = PipelineRun(self.mesh, self.strategy.pipeline_axis, schedule,
                                       self.strategy.batch_axes, specs)
            stack.plan = StackPlan(pipeline=pipeline, sequence=sequence, mesh=self.mesh, specs=specs,
                                   gathers_weights=bool(self.strategy.gather_axes))
        return nnx.split(model, nnx.Param, ...)[0]

    @contextlib.contextmanager
    def _layer_layout(self) -> Iterator[None]:
        # The model runs under the mesh: its own constraints (bare PartitionSpecs) resolve there.
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            yield

    def merge(self, state: TrainState) -> nnx.Module:
        """An ``nnx.Module`` holding ``state``'s arrays (sharded as they are) in Variables of its own:
        what it changes (RNG counters, batch statistics) never reaches ``state``."""
        return nnx.merge(self.graphdef, state.params, state.rest, copy=True)

    def ema_state(self, state: TrainState) -> TrainState:
        """``state`` with the trained parameters replaced by the moving average that
        ``shardax.ema_params`` keeps in the optimizer state, laid out as the parameters are
        (before the first update: the parameters themselves); for ``eval_step`` and ``merge``."""
        average = averaged(state.opt_state, trained_part(state.params, self.trainable))
        params = nnx.merge_state(state.params, average)  # the frozen ones as they are
        return state.replace(params=jax.device_put(params, self.state_shardings.params))

    def ema_model(self, state: TrainState) -> nnx.Module:
        """``merge`` of ``ema_state``: the model with the moving average of its weights."""
        return self.merge(self.ema_state(state))

    # What a run of parts offers too (``shardax.parts.ParallelRun``): a lone model is the one part
    # named ``model``.

    @property
    def names(self) -> tuple[str, ...]:
        return (LONE,)

    def frozen(self) -> tuple[str, ...]:
        return ()

    def classes(self) -> dict[str, str]:
        """The model's class name, by part name."""
        return {LONE: type(self._abstract_model()).__name__}

    def layouts(self) -> dict[str, Layout]:
        """Each part's layout by the prefix its paths are reported under (a lone model's: none)."""
        return {"": self.layout}

    def averaged_parts(self, state: TrainState) -> list[str]:
        """``["model"]`` when the optimizer keeps a moving average of the weights, else none."""
        return [LONE] if keeps_average(state.opt_state) else []

    def view(self, state: TrainState, name: str = LONE, *, ema: bool = False) -> nnx.Module:
        """The model holding ``state``'s arrays (the moving average with ``ema``) in Variables of
        its own, in eval mode."""
        if name != LONE:
            raise UsageError(f"this run trains one model, part {LONE!r}; there is no part {name!r}")
        model = self.ema_model(state) if ema else self.merge(state)
        model.eval()
        return model


def parallelize(factory: ModelFactory, tx: optax.GradientTransformation, mesh: Mesh | str | None,
                strategy: str | Strategy = "dp", *, axis_names: AxisNames = None,
                loss_fn: LossFn | None = None, example_batch: Any = None, trainable: Any = None,
                grad_accum: int = 1, microbatches: int | None = None, pipeline_repeats: int = 1,
                context_attention: str = "all-gather") -> ParallelModel:
    """Lay out ``factory(rngs)`` and ``tx`` on ``mesh`` by ``strategy``, from abstract shapes only.

    Args:
      mesh: a ``Mesh``, a shape such as ``"data=4,model=2"``, or ``None`` (every device on
        ``data``, plus what the strategy needs); checked against the strategy's axes.
      axis_names: for a model annotated with its own mesh axis names (weights declared with
        ``("fsdp", "tp")``, activations constrained to ``P("fsdp", None, "tp")``), which of
        shardax's mesh axes each plays, e.g. ``{"fsdp": "data", "tp": "model"}`` or
        ``"fsdp=data,tp=model"`` (``shardax.sharding.axis_names``). The layout's mesh is then
        ``mesh`` under those names.
      loss_fn, example_batch: the loss and one batch (arrays, or ``jax.ShapeDtypeStruct``s of the
        global batch). Under ``tp``, ``fsdp_tp`` and ``pp_tp`` the weights that carry no logical
        names are split as Megatron would, read off ``loss_fn``'s program on that batch
        (``shardax.sharding.derive``): attention heads, MLP hidden and conv channels between
        the weights that produce and consume them, vocabularies of embeddings and output heads.

      trainable: an NNX filter (a Variable type such as ``nnx.LoRAParam``, a path predicate, ...)
        of the parameters to train; the rest are frozen: no gradient, no optimizer state. Default:
        a model holding LoRA adapters (``nnx.LoRAParam``, as ``TransformerConfig(lora_rank=...)``
        and Flax's ``nnx.LoRA`` make them) trains those alone, any other model every parameter.
      grad_accum, microbatches, pipeline_repeats, context_attention: how each step is computed
        (``shardax.StepSettings``), checked here once; ``train_step(loss_fn)`` and
        ``eval_step(loss_fn)`` use them.

    A strategy whose tensor axis would split no weight at all is refused here: the devices of
    each group on that axis would only repeat each other's work. ``layout.notes()`` lists every
    weight left whole on it, and why.
    """
    settings = StepSettings.resolve(strategy, mesh, grad_accum=grad_accum, microbatches=microbatches,
                                    pipeline_repeats=pipeline_repeats, context_attention=context_attention)
    return ParallelModel.create(factory, tx, settings, axis_names=axis_names, loss_fn=loss_fn,
                                example_batch=example_batch, trainable=trainable)


def _lay_out(factory: ModelFactory, tx: optax.GradientTransformation, settings: StepSettings, *,
             axis_names: AxisNames = None, loss_fn: LossFn | None = None, example_batch: Any = None,
             trainable: Any = None, check_tensor: bool = True) -> ParallelModel:
    """``parallelize`` on settings already resolved (``ParallelModel.create``)."""
    mapping = parse_axis_names(axis_names)
    mesh, strategy = named_mesh(settings.mesh, mapping), named_strategy(settings.strategy, mapping)
    warn_if_starved(mesh)
    tensor, expert = strategy.tensor_axis(mesh), strategy.expert_axis(mesh)
    factory = holding_arrays(factory)  # built inside a trace: a plain array attribute stays one
    if tensor is not None:
        # the batch repeats over the tensor axis: XLA's grouped-conv gradient needs routing
        factory = routing_grouped_convs(factory)
    with nnx.use_eager_sharding(False):
        graphdef, params, _ = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))), nnx.Param, ...)
    trainable = trainable_filter(params, trainable)
    abstract = jax.eval_shape(functools.partial(build_state, factory, tx, 0, mesh, trainable))
    derived = None
    if ((tensor or expert) and loss_fn is not None and example_batch is not None
            and not all_annotated(abstract.params)):
        sizes = (mesh.shape[tensor] if tensor else 1, mesh.shape[expert] if expert else 1)
        derived = derive_unannotated(graphdef, abstract, loss_fn, example_batch, mesh, sizes)
    layout = Layout.create(abstract.params, mesh, strategy, derived)
    if check_tensor:
        check_split_axes([layout], derived is not None)
    check_pipeline_axis(layout, nnx.merge(graphdef, abstract.params, abstract.rest))
    shardings = TrainState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=layout.params(abstract.params),
        opt_state=layout.optimizer(abstract.opt_state),
        rest=layout.replicated(abstract.rest),
        skipped=NamedSharding(mesh, PartitionSpec()),
    )
    return ParallelModel(factory, tx, graphdef, layout, abstract, shardings, settings, trainable)


def reshard(tree: Any, target: Any) -> Any:
    """Move ``tree`` to ``target`` shardings (a tree of ``Sharding``, or a ``ParallelModel`` for a
    ``TrainState``). Values are preserved exactly; each device receives only its own pieces
    (device-to-device transfers, no gathering onto one host or device)."""
    shardings = target.state_shardings if isinstance(target, ParallelModel) else target
    return jax.device_put(tree, shardings)
