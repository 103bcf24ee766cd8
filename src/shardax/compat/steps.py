"""Data-parallel train steps: SPMD (the compiler inserts the collectives) and shard_map (we do).

``spmd_train_step`` is the body of an ``nnx.jit`` function; ``data_parallel_train_step`` runs
one step of explicit data parallelism: each device differentiates its slice of the batch,
gradients are averaged with ``pmean`` over the data axis, and every device applies the same
optimizer update to its replica.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.compat.gradients import check_reduce_type
from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.paths import path_to_str
from shardax.sharding.place import place_batch
from shardax.step.state import TrainState
from shardax.step.train import build_train_step


def spmd_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    batch: Any,
) -> jax.Array:
    """One optimizer step on ``loss_fn(model, batch)``; returns the loss.

    Call it inside an ``nnx.jit`` function under ``jax.set_mesh(mesh)`` with the batch sharded
    over the data axis: XLA inserts the gradient all-reduce that the shardings imply.
    """
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _current_mesh(mesh: Mesh | None, data_axis: str) -> Mesh:
    """``mesh``, or the one set with ``jax.set_mesh``; it must have ``data_axis``."""
    if mesh is None:
        mesh = jax.sharding.get_mesh()
        if mesh is None or mesh.empty:
            raise UsageError("data_parallel_train_step needs a mesh: pass mesh=... or call it under "
                             "`with jax.set_mesh(mesh):`")
    if data_axis not in mesh.shape:
        raise UsageError(f"data_axis={data_axis!r} is not an axis of the mesh {describe_mesh(mesh)}; "
                         f"use one of {tuple(mesh.axis_names)}")
    return mesh


def _state_fields(state: Any) -> tuple[Any, Any]:
    if isinstance(state, Mapping):
        return state["params"], state["opt_state"]
    return state.params, state.opt_state


def _with_fields(state: Any, params: Any, opt_state: Any) -> Any:
    if isinstance(state, Mapping):
        step = state.get("step")
        new = dict(state, params=params, opt_state=opt_state)
        if step is not None:
            new["step"] = step + 1
        return new
    if hasattr(state, "step"):
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    return state.replace(params=params, opt_state=opt_state)


def _check_state(state: Any, optimizer: Any) -> optax.GradientTransformation:
    has_fields = (isinstance(state, Mapping) and {"params", "opt_state"} <= set(state)) or (
        hasattr(state, "params") and hasattr(state, "opt_state") and hasattr(state, "replace")
    )
    if not has_fields:
        raise UsageError(
            f"state is a {type(state).__name__}; data_parallel_train_step takes a flax TrainState "
            "(or any flax struct with params/opt_state) or a dict {'params': ..., 'opt_state': ...}"
        )
    tx = optimizer if optimizer is not None else getattr(state, "tx", None)
    if not isinstance(tx, optax.GradientTransformation):
        raise UsageError(
            f"optimizer is {type(optimizer).__name__}; give an optax.GradientTransformation "
            "(e.g. optax.adamw(1e-3)), or None to use state.tx"
        )
    return tx


def _specs(batch: Any) -> tuple[Any, tuple[PartitionSpec, ...]]:
    """A placed batch's structure and specs, hashable (a static argument of ``engine_step``)."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple(leaf.sharding.spec for leaf in leaves)


def _device_loss(loss_fn: Callable, mesh: Mesh, data_axis: str, reduce_type: str, has_aux: bool,
                 with_rng: bool, batch_specs: Any) -> Callable:
    """The engine's ``loss(params, (batch, rng))``: ``loss_fn`` on each device's slice inside
    ``shard_map``, reduced over ``data_axis`` by ``pmean`` (or ``psum`` for ``reduce_type="sum"``).

    The parameters enter replicated, so differentiating the reduced loss all-reduces the
    per-device gradients in the backward pass (the transpose of the replication): the mean or
    the sum of them, as ``reduce_type`` says."""
    reduce = lax.pmean if reduce_type == "mean" else lax.psum

    def local(params: Any, batch: Any, rng: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        args = (batch, jax.random.fold_in(rng, lax.axis_index(data_axis))) if with_rng else (batch,)
        loss, aux = loss_fn(params, *args) if has_aux else (loss_fn(params, *args), None)
        metrics = {"mean_loss": lax.pmean(loss, data_axis)}
        for keypath, value in jax.tree_util.tree_leaves_with_path(aux):  # scalars named by their paths
            metrics[f"aux/{path_to_str(keypath) or 'value'}"] = lax.pmean(value, data_axis)
        return reduce(loss, data_axis), metrics

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), jax.tree.unflatten(*batch_specs),
                                                        PartitionSpec()),
                            out_specs=(PartitionSpec(), PartitionSpec()))
    return lambda params, inputs: sharded(params, *inputs)


@functools.partial(jax.jit, static_argnames=("loss_fn", "tx", "mesh", "data_axis", "reduce_type", "has_aux",
                                             "with_rng", "batch_specs"))
def engine_step(params: Any, opt_state: Any, batch: Any, rng: jax.Array, *, loss_fn: Callable,
          tx: optax.GradientTransformation, mesh: Mesh, data_axis: str, reduce_type: str, has_aux: bool,
          with_rng: bool, batch_specs: Any) -> tuple[TrainState, dict[str, Any]]:
    """One step of the engine's train step (``shardax.step.train``) on a plain parameter tree,
    replicated over ``mesh``; jit's own cache keys it on the static settings."""
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
    step = build_train_step(None, tx, _device_loss(loss_fn, mesh, data_axis, reduce_type, has_aux, with_rng,
                                                   batch_specs),
                            param_shardings=replicated, compute_shardings=replicated,
                            gradient_shardings=replicated, batch_sharding=None, nonfinite="skip")
    zero = jnp.zeros((), jnp.int32)
    return step(TrainState(step=zero, params=params, opt_state=opt_state, rest=None, skipped=zero),
                (batch, rng))


def data_parallel_train_step(
    loss_fn: Callable,
    optimizer: Any,
    batch: Any,
    state: Any,
    rngs: Any | None = None,
    *,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    reduce_type: str = "mean",
    has_aux: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """One data-parallel step with explicit collectives (``jax.shard_map`` + ``lax.pmean``).

    Args:
      loss_fn: ``loss_fn(params, batch)`` (or ``loss_fn(params, batch, rng)`` when ``rngs`` is
        given) returning a scalar loss, or ``(loss, aux)`` with ``has_aux=True``. It sees one
        device's slice of the batch; with a mean loss and equal slices, the averaged gradient
        equals the full-batch gradient.
      optimizer: an ``optax.GradientTransformation``; ``None`` uses ``state.tx``.
      batch: a pytree of arrays whose leading dimension divides the data axis.
      state: a flax ``TrainState`` (or any flax struct with ``params``/``opt_state``), or a
        dict ``{"params": ..., "opt_state": ..., "step": ...}``; replicated on every device.
      rngs: an optional PRNG key; each device gets it folded with its index on the data axis.
      mesh: the mesh; defaults to the one set with ``jax.set_mesh``.
      data_axis: the mesh axis the batch is split over.
      reduce_type: ``"mean"`` or ``"sum"`` of the per-device gradients.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``: a scalar or a tree of scalars, each
        averaged over devices into ``metrics["aux"]``, a dict by path (``{"noise": ...}``,
        ``{"a/b": ...}``; a lone scalar as ``{"value": ...}``).

    Returns:
      ``(new_state, metrics)`` with ``metrics = {"loss", "grad_norm", "skipped_steps"[, "aux"]}``;
      the loss is the mean over devices. It is the engine's step (``shardax.step.train``): a step
      whose loss or gradient norm is not finite leaves the parameters and optimizer state as they
      were and says so with ``skipped_steps == 1``.
    """
    check_reduce_type(reduce_type)
    mesh = _current_mesh(mesh, data_axis)
    tx = _check_state(state, optimizer)
    batch = place_batch(batch, NamedSharding(mesh, PartitionSpec(data_axis)))
    batch_specs = _specs(batch)
    params, opt_state = jax.device_put(_state_fields(state), NamedSharding(mesh, PartitionSpec()))
    rng = jax.device_put(rngs if rngs is not None else jax.random.key(0),
                         NamedSharding(mesh, PartitionSpec()))
    new, metrics = engine_step(params, opt_state, batch, rng, loss_fn=loss_fn, tx=tx, mesh=mesh,
                         data_axis=data_axis, reduce_type=reduce_type, has_aux=has_aux,
                         with_rng=rngs is not None, batch_specs=batch_specs)
    return _with_fields(state, new.params, new.opt_state), _metrics(metrics, has_aux)


def _metrics(engine: dict[str, Any], has_aux: bool) -> dict[str, Any]:
    """The engine's metrics as this step names them: the mean loss over devices (the engine's
    ``loss`` is the reduced one, a sum under ``reduce_type="sum"``), ``aux`` gathered by path."""
    metrics = {name: value for name, value in engine.items() if not name.startswith("aux/")}
    metrics["loss"] = metrics.pop("mean_loss")
    if has_aux:
        metrics["aux"] = {name[len("aux/"):]: value for name, value in engine.items()
                          if name.startswith("aux/")}
    return metrics
