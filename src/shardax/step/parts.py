"""A step over named parts, written by the user: a GAN's two updates, a student beside a frozen teacher.

    def gan_step(parts, batch):
        generator, discriminator = parts["generator"], parts["discriminator"]
        fake = generator(batch["noise"])
        d_loss, grads = nnx.value_and_grad(lambda d: bce(d(batch["image"]), d(fake)))(discriminator)
        parts.update("discriminator", grads)
        g_loss, grads = nnx.value_and_grad(lambda g: fooled(discriminator(g(batch["noise"]))))(generator)
        parts.update("generator", grads)
        return {"d_loss": d_loss, "g_loss": g_loss}

The step runs inside one compiled program over the global batch, as the one-model step does.
Each part arrives as an ``nnx.Module`` in training mode (a frozen part in eval mode: a teacher
or reference model without dropout, its batch statistics fixed), its parameters in their
compute layout (for FSDP: gathered). ``parts.update(name, grads)`` is the part's optimizer step: the gradients
go to the part's gradient layout (a reduce-scatter under zero2 and fsdp), and an update whose
gradient norm is not finite is dropped (the part keeps its parameters and optimizer state) and
counted in ``skipped_steps``. What the modules change in ``__call__`` (batch statistics, RNG
counters) is kept, as in the one-model step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax.errors import UsageError
from shardax.sharding.paths import leaves_with_paths
from shardax.step.state import TrainState
from shardax.step.train import in_compute_layout, keep_where

Metrics = dict[str, jax.Array]
StepFn = Callable[["Parts", Any], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class PartPlan:
    """How one part lives in the step: its structure, optimizer (None: frozen), trained filter and layouts."""

    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation | None
    trainable: Any
    param_shardings: Any
    compute_shardings: Any
    gradient_shardings: Any

    def trained(self, tree: Any) -> Any:
        return tree if self.trainable is None else nnx.split_state(tree, self.trainable, ...)[0]


class NamedModules:
    """Modules by part name: ``parts["name"]`` or ``parts.name``, and iteration over the names."""

    _modules: dict[str, nnx.Module]

    def __getitem__(self, name: str) -> nnx.Module:
        if name not in self._modules:
            raise UsageError(f"the step asked for part {name!r}; the parts are "
                             f"{', '.join(map(repr, self._modules))}")
        return self._modules[name]

    def __getattr__(self, name: str) -> nnx.Module:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __iter__(self) -> Any:
        return iter(self._modules)


class Parts(NamedModules):
    """What the user's step receives: ``parts["name"]`` (or ``parts.name``) is that part's
    ``nnx.Module``; ``parts.update(name, grads)`` applies the part's optimizer."""

    def __init__(self, plans: dict[str, PartPlan], state: TrainState, *, training: bool, allowed: jax.Array,
                 select: bool) -> None:
        self._plans, self._training, self._allowed, self._select = plans, training, allowed, select
        self._modules: dict[str, nnx.Module] = {}
        for name, plan in plans.items():
            params = jax.tree.map(in_compute_layout, state.params[name], plan.compute_shardings,
                                  plan.gradient_shardings, plan.param_shardings)
            module = nnx.merge(plan.graphdef, params, state.rest[name], copy=True)
            module.train() if training and plan.tx is not None else module.eval()  # a frozen part: eval mode
            self._modules[name] = module
        self.opt_state = dict(state.opt_state)
        self.metrics: Metrics = {}
        self.applied = jnp.ones((), bool)
        self.updated: set[str] = set()

    def update(self, name: str, grads: Any) -> None:
        """One optimizer step of part ``name`` with ``grads`` (``nnx.grad`` of a loss with respect
        to the part: the gradient of each of its parameters, or of the trained ones alone)."""
        module, plan = self[name], self._plans[name]
        if not self._training:
            raise UsageError(f"parts.update({name!r}, ...) in an evaluation step; evaluation changes no "
                             "part: return metrics only")
        if plan.tx is None:
            raise UsageError(f"parts.update({name!r}, ...): part {name!r} is frozen (no optimizer), so "
                             "nothing can update it; give it one (Part(model, optax.adam(...))) or do not "
                             "update it")
        params = nnx.state(module, nnx.Param)
        trained = plan.trained(params)
        grads = self._matching(name, grads, params, plan)
        grads = jax.lax.with_sharding_constraint(grads, plan.trained(plan.gradient_shardings))
        norm = optax.tree.norm(grads)
        apply = jnp.isfinite(norm) & self._allowed

        def step() -> tuple[Any, Any]:
            updates, opt_state = plan.tx.update(grads, self.opt_state[name], trained)
            return optax.apply_updates(trained, updates), opt_state

        new, self.opt_state[name] = keep_where(apply, step, (trained, self.opt_state[name]),
                                               select=self._select)
        new = jax.tree.map(in_compute_layout, new, plan.trained(plan.compute_shardings),
                           plan.trained(plan.gradient_shardings), plan.trained(plan.param_shardings))
        nnx.update(module, new)
        self.metrics[f"grad_norm/{name}"] = norm
        self.applied &= apply
        self.updated.add(name)

    @staticmethod
    def _matching(name: str, grads: Any, params: Any, plan: PartPlan) -> Any:
        """``grads`` of the trained parameters; refused in one line unless they match the part."""
        structure, trained = jax.tree.structure(grads), plan.trained(params)
        if structure == jax.tree.structure(params) and structure != jax.tree.structure(trained):
            grads = plan.trained(grads)  # every parameter's gradient: the trained ones
        elif structure != jax.tree.structure(trained):
            count, expected = len(jax.tree.leaves(grads)), len(jax.tree.leaves(trained))
            raise UsageError(f"parts.update({name!r}, grads): grads hold {count} arrays that are not the "
                             f"gradients of part {name!r} ({expected} trained parameters); pass "
                             f"nnx.grad(loss)(parts[{name!r}]), the gradient with respect to that part")
        for (path, grad), param in zip(leaves_with_paths(grads), jax.tree.leaves(trained), strict=True):
            given, expected = jax.ShapeDtypeStruct(jnp.shape(grad), jnp.result_type(grad)), param
            if given.shape != expected.shape or given.dtype != expected.dtype:
                raise UsageError(
                    f"parts.update({name!r}, grads): the gradient of {path} is "
                    f"{given.dtype.name}{list(given.shape)} where the parameter is "
                    f"{jnp.dtype(expected.dtype).name}{list(expected.shape)}; pass "
                    f"nnx.grad(loss)(parts[{name!r}]) unchanged (cast or reshape nothing)")
        return grads

    def final(self, state: TrainState) -> TrainState:
        """The new state: each part's parameters and variables as the step left them."""
        params, rest = {}, {}
        for name, module in self._modules.items():
            _, params[name], rest[name] = nnx.split(module, nnx.Param, ...)
        return TrainState(step=state.step + 1, params=params, opt_state=self.opt_state, rest=rest,
                          skipped=state.skipped + (~self.applied).astype(jnp.int32))


def metrics_of(output: Any, where: str) -> Metrics:
    """The step's returned metrics as float32 scalars, refused in one line unless a dict of scalars."""
    if not isinstance(output, Mapping):
        raise UsageError(f"the {where} returned a {type(output).__name__}; return a dict of scalar metrics, "
                         "e.g. {'d_loss': d_loss, 'g_loss': g_loss}")
    checked = {}
    for name, value in output.items():
        if not isinstance(name, str) or name.startswith("grad_norm") or name == "skipped_steps":
            raise UsageError(f"the {where} returned a metric named {name!r}; use a string that is not "
                             "'skipped_steps' and does not start with 'grad_norm' (shardax reports those)")
        if jnp.ndim(value) != 0:
            raise UsageError(f"the {where} returned metric {name!r} of shape {jnp.shape(value)}; return its "
                             "mean over the batch (a scalar)")
        checked[name] = jnp.asarray(value, jnp.float32)
    return checked


def build_parts_step(plans: dict[str, PartPlan], step_fn: StepFn, *, nonfinite: str = "stop",
                     layer_layout: Callable[[], Any] = contextlib.nullcontext,
                     select_update: bool = False) -> Callable[[TrainState, Any], tuple[TrainState, Metrics]]:
    """The un-jitted ``(state, batch) -> (state, metrics)`` of ``step_fn`` over the parts.

    Every trained part must be updated by the step; one that is not is refused (in one line,
    when the step is traced), as is an update of a frozen part. An update whose gradient norm is
    not finite is dropped. With ``nonfinite="stop"`` the whole step is then dropped (every part,
    its variables too) and nothing after it is applied: the state stays the last good one until
    the host notices ``skipped`` and stops. With ``"skip"`` the other updates of that step stand
    and training goes on."""

    def step(state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        allowed = state.skipped == 0 if nonfinite == "stop" else jnp.ones((), bool)
        parts = Parts(plans, state, training=True, allowed=allowed, select=select_update)
        with layer_layout():
            metrics = metrics_of(step_fn(parts, batch), "step")
        idle = [name for name, plan in plans.items() if plan.tx is not None and name not in parts.updated]
        if idle:
            raise UsageError(f"part {idle[0]!r} has an optimizer but the step never called "
                             f"parts.update({idle[0]!r}, grads); update it in the step, or make it frozen "
                             "(Part(model) with no optimizer)")
        new = parts.final(state)
        if nonfinite == "stop":  # a step with a dropped update moves nothing but its counters, as one model's
            kept = state.replace(step=new.step, skipped=new.skipped)
            new = jax.tree.map(lambda moved, still: jnp.where(parts.applied, moved, still), new, kept)
        return new, {**metrics, **parts.metrics, "skipped_steps": new.skipped}

    return step


def build_parts_eval_step(plans: dict[str, PartPlan], eval_fn: StepFn, *,
                          layer_layout: Callable[[], Any] = contextlib.nullcontext,
                          ) -> Callable[[TrainState, Any], Metrics]:
    """The un-jitted ``(state, batch) -> metrics`` of ``eval_fn`` over the parts in eval mode; the
    state is left as it was."""

    def evaluate(state: TrainState, batch: Any) -> Metrics:
        parts = Parts(plans, state, training=False, allowed=jnp.zeros((), bool), select=False)
        with layer_layout():
            return metrics_of(eval_fn(parts, batch), "evaluation step")

    return evaluate
