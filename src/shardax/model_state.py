"""A model's training state from its factory, and what laying it out checks of the model.

``build_state`` initialises a ``TrainState`` (under ``jax.jit`` with the layout's shardings each
device computes only what it holds); the rest serves ``shardax.parallelize``: the filter of the
parameters that train, the Megatron-style split of unannotated weights read off a loss's
program, and the refusals of a model that a strategy cannot lay out.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from shardax.blocks import LayerStack, blocks_of
from shardax.errors import UsageError
from shardax.sharding.derive import Derived, derive_split
from shardax.sharding.grouped_conv import route_grouped_convs
from shardax.sharding.layout import Layout
from shardax.sharding.paths import leaves_with_paths
from shardax.sharding.rules import logical_axes_of, unannotated
from shardax.step.loss import LossFn, split_loss
from shardax.step.state import TrainState

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


def trained_part(params: Any, trainable: Any) -> Any:
    """The parameters the optimizer updates (all of them when ``trainable`` is None)."""
    return params if trainable is None else nnx.split_state(params, trainable, ...)[0]


def warn_if_updates_round_away(params: Any, trainable: Any, part: str = "") -> None:
    """Warn where trained parameters are held in a 16-bit float: an optimizer's update smaller than
    about 1/256 of a bfloat16 weight (1/2048 of a float16 one) rounds to nothing, so training
    slows or stalls with no error. Frozen ones (LoRA's base) are as good in 16 bits."""
    trained = leaves_with_paths(trained_part(params, trainable))
    narrow = [(path, jnp.dtype(leaf.dtype).name) for path, leaf in trained
              if jnp.dtype(leaf.dtype) in (jnp.bfloat16, jnp.float16)]
    if narrow:
        path, dtype = narrow[0]
        warnings.warn(f"{len(narrow)} trained parameters{f' of {part}' if part else ''} are {dtype} "
                      f"(the first: {path}): updates much smaller than a weight round away and training "
                      "stalls with no error; keep trained weights float32 (param_dtype='float32'; "
                      "compute_dtype='bfloat16' still computes in bfloat16) or freeze them and train "
                      "LoRA adapters", UserWarning, stacklevel=3)


@contextlib.contextmanager
def _building(mesh: Mesh) -> Iterator[None]:
    """Where a model is built: Flax places nothing itself, the mesh's axes are all Auto."""
    auto = mesh.abstract_mesh.update_axis_types({name: jax.sharding.AxisType.Auto
                                                 for name in mesh.axis_names})
    with nnx.use_eager_sharding(False), jax.sharding.use_abstract_mesh(auto):
        yield


def build_state(factory: ModelFactory, tx: optax.GradientTransformation, seed: int, mesh: Mesh,
                trainable: Any = None) -> TrainState:
    # Flax would otherwise place annotated variables itself, eagerly, with its own rules. Under
    # the mesh, so that a model's own sharding constraints resolve while it is built; with every
    # axis Auto, since under Explicit axes JAX types each initialiser's random draw as replicated
    # and every device would draw the whole model (jax.make_mesh's default is Explicit).
    with _building(mesh):
        model = factory(nnx.Rngs(seed))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    zero = jax.numpy.zeros((), jax.numpy.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(trained_part(params, trainable)), rest=rest,
                      skipped=zero)


def _plain_arrays(model: nnx.Module) -> list[tuple[str, nnx.Module, str]]:
    """Each (path, module, attribute) of ``model``'s graph holding a bare ``jax.Array`` (a tracer
    inside a trace), in the graph's order."""
    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            where = "/".join(map(str, path)) or type(model).__name__
            found.extend((where, node, name) for name, value in vars(node).items()
                         if isinstance(value, jax.Array) and not name.startswith("_"))
    return found


def holding_arrays(factory: ModelFactory) -> ModelFactory:
    """``factory`` whose models hold their plain ``jax.Array`` attributes (a window attention's
    relative position index, a sinusoidal table) as plain NNX holds them.

    Built eagerly, as in plain NNX, such an array is data: a leaf of the model's state. shardax
    builds models inside a trace (straight into shards), where Flax takes the tracer for a static
    attribute, which would leak out of the trace at the first step; marked as data here, it is a
    leaf of the state as in plain NNX (laid out as the other variables are, checkpointed, never
    given a gradient), and the model reads the same array."""

    @functools.wraps(factory)
    def build(rngs: nnx.Rngs) -> nnx.Module:
        model = factory(rngs)
        for _, node, name in _plain_arrays(model):
            if not node._pytree__nodes.get(name, False):  # static: only a tracer is taken so
                setattr(node, name, nnx.data(getattr(node, name)))
        return model

    return build


def routing_grouped_convs(factory: ModelFactory) -> ModelFactory:
    """``factory`` whose models' grouped ``nnx.Conv``s use ``grouped_conv``
    (``shardax.sharding.grouped_conv``)."""

    @functools.wraps(factory)
    def build(rngs: nnx.Rngs) -> nnx.Module:
        return route_grouped_convs(factory(rngs))

    return build


def trainable_filter(params: Any, trainable: Any) -> Any:
    """The filter of trained parameters (None: all), refused in one line when it selects none."""
    if trainable is None:
        adapters = nnx.split_state(params, nnx.LoRAParam, ...)[0]
        return nnx.LoRAParam if jax.tree.leaves(adapters) else None
    if not jax.tree.leaves(nnx.split_state(params, trainable, ...)[0]):
        raise UsageError(f"trainable={trainable!r} selects none of the model's parameters, so nothing would "
                         "train; give a filter that matches some (e.g. nnx.LoRAParam, or a path predicate)")
    return trainable


def all_annotated(params: Any) -> bool:
    variables = jax.tree.leaves(params, is_leaf=lambda node: isinstance(node, nnx.Variable))
    return all(isinstance(v, nnx.Variable) and not unannotated(logical_axes_of(v)) for v in variables)


def derive_unannotated(graphdef: nnx.GraphDef, abstract: TrainState, loss_fn: LossFn, example_batch: Any,
                       mesh: Mesh, sizes: tuple[int, int]) -> Derived:
    """The split of the model's unannotated weights over the strategy's tensor and expert axes,
    read off ``loss_fn``'s program on ``example_batch`` (traced on shapes only, in training mode,
    under the mesh); ``sizes``: the tensor and expert axes' devices."""
    def loss(params: Any, rest: Any, batch: Any) -> Any:
        model = nnx.merge(graphdef, params, rest, copy=True)
        model.train()
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return split_loss(loss_fn(model, batch))[0]

    return derive_split(loss, abstract.params, abstract.rest, example_batch, *sizes)


def check_pipeline_axis(layout: Layout, model: nnx.Module) -> None:
    """Refuse a pipeline for a model with no stack of layers to cut into stages."""
    axis = layout.strategy.pipeline_axis
    if axis is None:
        return
    stacks = blocks_of(model, LayerStack)
    if any(stack.scan for _, stack in stacks):
        return
    if stacks:
        raise UsageError(f"strategy {layout.strategy.name!r} cuts the stacked layers into stages over "
                         f"{axis!r}, and this model's LayerStack {stacks[0][0]!r} runs its layers in a "
                         "Python loop (scan=False; shardax train: --no-scan-layers), which has no stack: use "
                         "scan=True (drop --no-scan-layers)")
    raise UsageError(f"strategy {layout.strategy.name!r} cuts a stack of layers into stages over {axis!r}, "
                     "and this model has none (no shardax.blocks.LayerStack), so every stage would repeat "
                     "the same work; build the repeated layers with LayerStack, or use dp, fsdp, tp or "
                     "fsdp_tp")
