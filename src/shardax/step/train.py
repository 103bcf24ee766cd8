"""The train and eval steps of every strategy and every model: one SPMD function each.

The strategy never appears as a branch here. Parameters are constrained to their compute
layout before the forward pass (for FSDP that is the all-gather), gradients to the strategy's
gradient layout (the compiler then all-reduces or reduce-scatters them), and jit's
in/out shardings keep parameters and optimizer state where the layout says.

The model is rebuilt from its state inside the step, so anything a module changes in
``__call__`` (BatchNorm statistics, the counters of ``nnx.Rngs`` streams behind Dropout, a
user's own ``nnx.Variable``) comes out of the step as the new ``TrainState.rest``. Because the
step is one program over the global batch, batch statistics are those of the whole batch and
random draws are the bits one device would draw (JAX's partitionable threefry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax.sharding.compute import gather_for_compute
from shardax.step.loss import WEIGHT, LossFn, split_loss, weighted_mean
from shardax.step.microbatches import split_microbatches
from shardax.step.settings import check_grad_accum, check_nonfinite
from shardax.step.state import TrainState

Metrics = dict[str, jax.Array]


def _model(graphdef: nnx.GraphDef | None, params: Any, rest: Any, *, training: bool) -> Any:
    """A fresh module of this trace (``copy``: its Variables may be updated here), in train or eval
    mode; with no ``graphdef`` the parameters themselves (a loss of a plain parameter tree)."""
    if graphdef is None:
        return params
    model = nnx.merge(graphdef, params, rest, copy=True)
    if isinstance(model, nnx.Module):
        model.train() if training else model.eval()
    return model


def keep_where(apply: jax.Array, update: Callable[[], Any], kept: Any, *, select: bool) -> Any:
    """``update()`` where ``apply`` holds, else ``kept`` (a tree of the same structure).

    With ``select`` the update is computed either way and one result kept; without, a
    ``lax.cond`` computes it only when it applies. Which is better depends on the compiler
    (benchmark 22 in docs/benchmarks.md): XLA:TPU fuses the select into the update and mostly
    needs less memory with it, while XLA:CPU computes the new state beside the old one before
    selecting and needs more than with the cond. ``ParallelModel`` selects on TPUs, except under a
    pipeline (there the select made XLA:TPU all-reduce a stage's gradients instead of
    reduce-scattering them, sending more), and uses the cond elsewhere."""
    if select:
        return jax.tree.map(lambda new, old: jnp.where(apply, new, old), update(), kept)
    return jax.lax.cond(apply, update, lambda: kept)


def build_train_step(
    graphdef: nnx.GraphDef | None,
    tx: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    param_shardings: Any,
    compute_shardings: Any,
    gradient_shardings: Any,
    batch_sharding: Any,
    grad_accum: int = 1,
    layer_layout: Callable[[], Any] = contextlib.nullcontext,
    nonfinite: str = "stop",
    trainable: Any = None,
    select_update: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, Metrics]]:
    """The un-jitted step ``(state, batch) -> (state, metrics)``; see ``ParallelModel.train_step``.

    Parameters stored by ``param_shardings`` are constrained to ``compute_shardings`` for the
    forward pass, their gradients to ``gradient_shardings`` (a stack of layers keeps its storage
    layout here and lays out one layer at a time itself). ``layer_layout()`` is entered while
    the loss is traced (the mesh the model's own constraints resolve on). The metrics
    are ``loss``, ``grad_norm`` and whatever ``loss_fn`` returned beside the loss, each the
    mean over the global batch, and ``skipped_steps``. With ``grad_accum`` microbatches, each
    counts by the ``"weight"`` its loss reports (equally when none): sums divided once by the
    total weight, which is the whole batch's mean however its tokens fall.

    A step whose loss or gradient norm is NaN or infinite changes nothing but ``step`` and
    ``skipped`` (its update, optimizer state and model state are dropped in the program, so
    no host check is needed to keep a bad state out). With ``nonfinite="stop"`` every later
    step is dropped too: the state stays the last good one until the host notices ``skipped``
    and stops. With ``"skip"`` training goes on with the next batch.

    ``trainable`` (an NNX filter; None: every parameter) picks the parameters differentiated
    and updated; ``tx``'s state covers those alone, and the others enter the loss as constants.
    ``select_update``: how a step is dropped (see ``keep_where``). ``graphdef=None``: the state's
    parameters are a plain tree that ``loss_fn(params, batch)`` takes as it is (no model state).
    """
    check_nonfinite(nonfinite, "nonfinite")
    check_grad_accum(grad_accum)
    return _TrainStep(graphdef, tx, loss_fn, param_shardings, compute_shardings, gradient_shardings,
                      batch_sharding, grad_accum, layer_layout, nonfinite, trainable, select_update).step


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: jit keys on it
class _TrainStep:
    """The pieces of one train step (see ``build_train_step``); ``step`` is the step itself."""

    graphdef: nnx.GraphDef | None
    tx: optax.GradientTransformation
    loss_fn: LossFn
    param_shardings: Any
    compute_shardings: Any
    gradient_shardings: Any
    batch_sharding: Any
    grad_accum: int
    layer_layout: Callable[[], Any]
    nonfinite: str
    trainable: Any
    select_update: bool

    def forward(self, params: Any, rest: Any, batch: Any,
                weighted: bool) -> tuple[jax.Array, tuple[Metrics, Any]]:
        """The loss to differentiate: the mean, or with ``weighted`` the mean times its weight (a
        sum), and the metrics (times the weight too) with the weight itself and the new state."""
        params = jax.tree.map(in_compute_layout, params, self.compute_shardings, self.gradient_shardings,
                              self.param_shardings)
        model = _model(self.graphdef, params, rest, training=True)
        with self.layer_layout():
            loss, metrics, weight = split_loss(self.loss_fn(model, batch))
        if weighted:
            weight = jnp.ones((), jnp.float32) if weight is None else weight
            loss, metrics = loss * weight, {**{k: v * weight for k, v in metrics.items()}, WEIGHT: weight}
        return loss, (metrics, rest if self.graphdef is None else nnx.split(model, nnx.Param, ...)[2])

    def parts(self, tree: Any) -> tuple[Any, Any]:
        """(the trained parameters, the frozen ones) of a parameter-shaped tree."""
        return (tree, None) if self.trainable is None else nnx.split_state(tree, self.trainable, ...)

    @staticmethod
    def whole(trained: Any, frozen: Any) -> Any:
        return trained if frozen is None else nnx.merge_state(trained, frozen)

    def gradients(self, params: Any, rest: Any, batch: Any) -> tuple[Metrics, Any, Any]:
        """Metrics, gradients of the trained parameters, the model's new state."""
        params, frozen = self.parts(params)

        def objective(trained: Any, rest: Any, batch: Any,
                      weighted: bool) -> tuple[jax.Array, tuple[Metrics, Any]]:
            return self.forward(self.whole(trained, frozen), rest, batch, weighted)

        if self.grad_accum == 1:
            (loss, (metrics, rest)), grads = jax.value_and_grad(objective, has_aux=True)(
                params, rest, batch, False)
            return {"loss": loss, **metrics}, grads, rest
        return self.accumulated(jax.value_and_grad(functools.partial(objective, weighted=True), has_aux=True),
                                params, rest, batch)

    def accumulated(self, grad_fn: Callable, params: Any, rest: Any, batch: Any) -> tuple[Metrics, Any, Any]:
        """``gradients`` over ``grad_accum`` microbatches, in a scan.

        Each microbatch adds its loss times its weight (its token count, or 1 when the loss
        reports none) and the gradient of that; the sums are divided once by the total weight,
        so the update is the whole batch's even when microbatches count different numbers of
        tokens. Sums are float32, the gradient sum laid out like the gradients."""
        gradient_shardings = self.parts(self.gradient_shardings)[0]

        def accumulate(carry: tuple[Metrics, Any, Any], micro: Any) -> tuple[tuple[Metrics, Any, Any], None]:
            sums, grad_sum, rest = carry
            micro = jax.lax.with_sharding_constraint(micro, self.batch_sharding)
            (loss, (metrics, rest)), grads = grad_fn(params, rest, micro)
            sums = jax.tree.map(jnp.add, sums, {"loss": loss, **metrics})
            grad_sum = jax.tree.map(lambda total, g: total + g.astype(jnp.float32), grad_sum, grads)
            return (sums, jax.lax.with_sharding_constraint(grad_sum, gradient_shardings), rest), None

        micro = split_microbatches(batch, self.grad_accum)
        first = jax.tree.map(lambda leaf: leaf[0], micro)
        shapes = jax.eval_shape(lambda: grad_fn(params, rest, first)[0])
        sums = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32),
                            {"loss": shapes[0], **shapes[1][0]})
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zeros = jax.lax.with_sharding_constraint(zeros, gradient_shardings)
        (sums, grads, rest), _ = jax.lax.scan(accumulate, (sums, zeros, rest), micro)
        total = sums.pop(WEIGHT)
        grads = jax.tree.map(lambda g, p: weighted_mean(g, total).astype(p.dtype), grads, params)
        return {name: weighted_mean(value, total) for name, value in sums.items()}, grads, rest

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        metrics, grads, rest = self.gradients(state.params, state.rest, batch)
        grads = jax.lax.with_sharding_constraint(grads, self.parts(self.gradient_shardings)[0])
        grad_norm = optax.tree.norm(grads)
        apply = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        if self.nonfinite == "stop":
            # after the first bad step nothing moves, so the state is the last good one
            apply &= state.skipped == 0

        def update() -> tuple[Any, Any, Any]:
            trained, frozen = self.parts(state.params)
            updates, opt_state = self.tx.update(grads, state.opt_state, trained)
            return self.whole(optax.apply_updates(trained, updates), frozen), opt_state, rest

        params, opt_state, rest = keep_where(apply, update, (state.params, state.opt_state, state.rest),
                                             select=self.select_update)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rest=rest,
                               skipped=state.skipped + (~apply).astype(jnp.int32))
        return new_state, {**metrics, "grad_norm": grad_norm, "skipped_steps": new_state.skipped}


def in_compute_layout(value: jax.Array, compute: Any, gradient: Any, storage: Any) -> jax.Array:
    """A parameter in its compute layout (for FSDP the all-gather), its gradient kept in ``gradient``'s."""
    if compute == gradient == storage:  # used where it is stored, its gradient kept there (dp, tp)
        return value
    return gather_for_compute(value, compute, gradient)


def build_eval_step(
    graphdef: nnx.GraphDef, loss_fn: LossFn, *, compute_shardings: Any,
    layer_layout: Callable[[], Any] = contextlib.nullcontext,
) -> Callable[[TrainState, Any], Metrics]:
    """The un-jitted ``(state, batch) -> metrics``: the model in eval mode (running averages, no
    dropout); whatever it changes while evaluating is dropped, so the training state never moves.
    A weight the loss reports comes back as ``metrics["weight"]`` (to average batches by)."""

    def evaluate(state: TrainState, batch: Any) -> Metrics:
        params = jax.lax.with_sharding_constraint(state.params, compute_shardings)
        model = _model(graphdef, params, state.rest, training=False)
        with layer_layout():
            loss, metrics, weight = split_loss(loss_fn(model, batch))
        return {"loss": loss, **metrics, **({} if weight is None else {WEIGHT: weight})}

    return evaluate
