"""Model parallelism made real: a model, an optimizer and a strategy laid out on a mesh.

    parallel = parallelize(lambda rngs: MyModel(rngs=rngs), optax.adamw(1e-3), mesh, "fsdp")
    state = parallel.init(seed=0)                 # straight into shards
    step = parallel.train_step(loss_fn)           # compiled for this layout
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

from shardax.errors import UsageError
from shardax.sharding.compute import compute_layout
from shardax.sharding.context import AXIS as CONTEXT_AXIS, VARIANTS as CONTEXT_VARIANTS, context_parallel
from shardax.sharding.pipeline import Schedule, pipelined
from shardax.sharding.layout import Layout
from shardax.sharding.place import place_batch
from shardax.sharding.strategies import Strategy, get_strategy
from shardax.step.train import build_eval_step, build_train_step
from shardax.step.loss import LossFn
from shardax.step.state import TrainState

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


def _build_state(factory: ModelFactory, tx: optax.GradientTransformation, seed: int) -> TrainState:
    # Flax would otherwise place annotated variables itself, eagerly, with its own rules.
    with nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(seed))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    zero = jax.numpy.zeros((), jax.numpy.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(params), rest=rest, skipped=zero)


@dataclasses.dataclass(frozen=True)
class ParallelModel:
    """A model factory and optimizer laid out on ``mesh`` by ``strategy``.

    Attributes:
      graphdef: the model's structure (static); ``merge`` rebuilds a module from a state.
      layout: per-parameter specs and the shardings of every tree.
      abstract_state: the ``TrainState`` as shapes and dtypes (no memory).
      state_shardings: a ``TrainState`` of ``NamedSharding``: where each leaf lives.
    """

    factory: ModelFactory
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    layout: Layout
    abstract_state: TrainState
    state_shardings: TrainState

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def strategy(self) -> Strategy:
        return self.layout.strategy

    def init(self, seed: int = 0) -> TrainState:
        """Initialise straight into shards: each device computes only what it holds."""
        build = functools.partial(_build_state, self.factory, self.tx, seed)
        return jax.jit(build, out_shardings=self.state_shardings)()

    def place_batch(self, batch: Any) -> Any:
        """Split a batch (or this process's slice of it) over the strategy's batch axes."""
        return place_batch(batch, self.layout.batch())

    def train_step(self, loss_fn: LossFn, *, grad_accum: int = 1, donate: bool = True, nonfinite: str = "stop",
                   microbatches: int | None = None, pipeline_repeats: int = 1,
                   context_attention: str = "all-gather") -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
        """A compiled ``(state, batch) -> (state, metrics)`` for this layout.

        ``loss_fn(model, batch)`` returns the mean loss of the batch, or ``(loss, {"name":
        scalar, ...})``; the model runs in training mode (``model.train()``) and whatever it
        updates in ``__call__`` (batch statistics, RNG counters) is carried in ``state.rest``.
        ``metrics`` holds ``loss``, ``grad_norm`` and the named values, each averaged over the
        global batch. With ``grad_accum=k`` the batch is split into k microbatches whose
        gradients and metrics are averaged (same result, less activation memory). A step with a
        non-finite loss or gradient norm is not applied and counted in ``state.skipped``; with
        ``nonfinite="stop"`` no later step is applied either (see ``build_train_step``).
        Under a pipeline strategy, ``microbatches`` (default: the number of stages) flow
        through the stages, ``pipeline_repeats`` times round for a circular schedule.
        On a mesh with a ``context`` axis, sequences are split over it and attention gathers
        the rest by ``context_attention``: ``all-gather`` or ``ring`` (``shardax.sharding.context``).
        """
        params = self.abstract_state.params
        step = build_train_step(
            self.graphdef, self.tx, loss_fn,
            param_shardings=self.state_shardings.params,
            compute_shardings=self.layout.compute(params),
            gradient_shardings=self.layout.gradients(params),
            batch_sharding=self.layout.batch(),
            grad_accum=grad_accum,
            layer_layout=functools.partial(self._layer_layout, self.schedule(microbatches, pipeline_repeats),
                                           self.context_attention(context_attention)),
            nonfinite=nonfinite,
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(
            step,
            in_shardings=(self.state_shardings, self.layout.batch()),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,) if donate else (),
        )

    def eval_step(self, loss_fn: LossFn, *, microbatches: int | None = None, pipeline_repeats: int = 1,
                  context_attention: str = "all-gather") -> Callable[[TrainState, Any], dict]:
        """A compiled ``(state, batch) -> metrics`` in eval mode (``model.eval()``: running
        averages, no dropout), with the train step's layouts; the state is left as it was."""
        evaluate = build_eval_step(self.graphdef, loss_fn, compute_shardings=self.layout.compute(self.abstract_state.params),
                                   layer_layout=functools.partial(self._layer_layout,
                                                                  self.schedule(microbatches, pipeline_repeats),
                                                                  self.context_attention(context_attention)))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(evaluate, in_shardings=(self.state_shardings, self.layout.batch()), out_shardings=replicated)

    def schedule(self, microbatches: int | None = None, pipeline_repeats: int = 1) -> Schedule | None:
        """The pipeline schedule of this layout (None unless the strategy pipelines): as many
        microbatches as stages unless told."""
        axis = self.strategy.pipeline_axis
        if axis is None:
            if microbatches is not None or pipeline_repeats != 1:
                raise UsageError(f"microbatches/pipeline repeats are for pipeline strategies; {self.strategy.name!r} "
                                 "is not one (use --grad-accum to split a batch into microbatches)")
            return None
        stages = self.mesh.shape[axis]
        schedule = Schedule(stages, stages if microbatches is None else microbatches, pipeline_repeats)
        for leaf in self.layout.leaves.values():  # the stacked layers must split evenly: say so now
            if leaf.logical and leaf.logical[0] == "layers":
                schedule.check_layers(leaf.shape[0])
        return schedule

    def context_attention(self, variant: str = "all-gather") -> str | None:
        """How attention spans a sequence split over the mesh's ``context`` axis (None: no such
        axis of more than one device)."""
        if variant not in CONTEXT_VARIANTS:
            raise UsageError(f"--context-attention {variant!r}; use one of {', '.join(CONTEXT_VARIANTS)}")
        if self.mesh.shape.get(CONTEXT_AXIS, 1) == 1:
            if variant != "all-gather":
                raise UsageError(f"--context-attention {variant} is for meshes with a {CONTEXT_AXIS!r} axis; this "
                                 f"mesh has none (e.g. --mesh data=2,{CONTEXT_AXIS}=4)")
            return None
        if self.strategy.pipeline_axis is not None:
            raise UsageError(f"a {CONTEXT_AXIS!r} mesh axis does not combine with pipeline strategies yet; use "
                             f"dp, fsdp, tp or fsdp_tp with it, or drop {CONTEXT_AXIS} from --mesh")
        return variant

    @contextlib.contextmanager
    def _layer_layout(self, schedule: Schedule | None = None, context: str | None = None) -> Iterator[None]:
        with compute_layout(self.mesh, self.strategy), contextlib.ExitStack() as stack:
            if schedule is not None:
                stack.enter_context(pipelined(self.mesh, self.strategy.pipeline_axis, schedule,
                                              self.strategy.batch_axes))
            if context is not None:
                heads = dict(self.strategy.param_rules).get("heads")
                heads = () if heads is None else (heads,) if isinstance(heads, str) else tuple(heads)
                stack.enter_context(context_parallel(self.mesh, context, self.strategy.batch_axes, heads))
            yield

    def merge(self, state: TrainState) -> nnx.Module:
        """An ``nnx.Module`` holding ``state``'s parameters (sharded as they are)."""
        return nnx.merge(self.graphdef, state.params, state.rest)


def parallelize(factory: ModelFactory, tx: optax.GradientTransformation, mesh: Mesh,
                strategy: str | Strategy = "dp") -> ParallelModel:
    """Lay out ``factory(rngs)`` and ``tx`` on ``mesh`` by ``strategy``, from abstract shapes only."""
    strategy = get_strategy(strategy)
    strategy.check_mesh(mesh)
    with nnx.use_eager_sharding(False):
        graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))), nnx.Param, ...)
    abstract = jax.eval_shape(functools.partial(_build_state, factory, tx, 0))
    layout = Layout.create(abstract.params, mesh, strategy)
    shardings = TrainState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=layout.params(abstract.params),
        opt_state=layout.optimizer(abstract.opt_state),
        rest=layout.replicated(abstract.rest),
        skipped=NamedSharding(mesh, PartitionSpec()),
    )
    return ParallelModel(factory, tx, graphdef, layout, abstract, shardings)


def reshard(tree: Any, target: Any) -> Any:
    """Move ``tree`` to ``target`` shardings (a tree of ``Sharding``, or a ``ParallelModel`` for a
    ``TrainState``). Values are preserved exactly; each device receives only its own pieces
    (device-to-device transfers, no gathering onto one host or device)."""
    shardings = target.state_shardings if isinstance(target, ParallelModel) else target
    return jax.device_put(tree, shardings)
