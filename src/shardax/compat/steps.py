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
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.sharding.place import place_batch
from shardax.compat.gradients import check_reduce_type, reduce_gradients_across_devices


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


def _current_mesh(mesh: Mesh | None) -> Mesh:
    if mesh is not None:
        return mesh
    concrete = jax.sharding.get_mesh()
    if concrete is None or concrete.empty:
        raise UsageError(
            "data_parallel_train_step needs a mesh: pass mesh=... or call it under "
            "`with jax.set_mesh(mesh):`"
        )
    return concrete


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


def _per_device(tree: Any, axis: str) -> Any:
    """Mark replicated values as varying over ``axis`` (differentiated per device).

    Inside ``shard_map`` the gradient of a replicated input comes back already summed over the
    axis (the transpose of its implicit broadcast). Casting the parameters to "varying" first
    keeps one gradient per device, so the reduction we apply is the only collective, and
    ``mean`` vs ``sum`` stays the caller's choice.
    """
    cast = getattr(lax, "pcast", None)
    if cast is not None:
        return jax.tree.map(lambda value: cast(value, axis, to="varying"), tree)
    return jax.tree.map(lambda value: lax.pvary(value, axis), tree)


@functools.lru_cache(maxsize=64)
def _compiled_step(
    loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, data_axis: str,
    reduce_type: str, has_aux: bool, with_rng: bool, batch_treedef: Any, leaf_specs: tuple,
) -> Callable:
    batch_specs = jax.tree.unflatten(batch_treedef, leaf_specs)

    def local_step(state, batch, rng):
        params, opt_state = _state_fields(state)
        args = (batch, jax.random.fold_in(rng, lax.axis_index(data_axis))) if with_rng else (batch,)
        (loss, aux), grads = jax.value_and_grad(
            lambda p: loss_fn(p, *args) if has_aux else (loss_fn(p, *args), None), has_aux=True
        )(_per_device(params, data_axis))
        grads = reduce_gradients_across_devices(grads, reduce_type, data_axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": lax.pmean(loss, data_axis), "grad_norm": optax.tree.norm(grads)}
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda value: lax.pmean(value, data_axis), aux)
        return _with_fields(state, params, opt_state), metrics

    sharded = jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(PartitionSpec(), batch_specs, PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec()),
    )
    return jax.jit(sharded)


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
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged into metrics.

    Returns:
      ``(new_state, metrics)`` with ``metrics = {"loss", "grad_norm"[, "aux"]}``; the loss is
      the mean over devices.
    """
    check_reduce_type(reduce_type)
    mesh = _current_mesh(mesh)
    if data_axis not in mesh.shape:
        raise UsageError(
            f"data_axis={data_axis!r} is not an axis of the mesh {describe_mesh(mesh)}; "
            f"use one of {tuple(mesh.axis_names)}"
        )
    tx = _check_state(state, optimizer)
    batch = place_batch(batch, NamedSharding(mesh, PartitionSpec(data_axis)))
    leaves, batch_treedef = jax.tree.flatten(batch)
    leaf_specs = tuple(leaf.sharding.spec for leaf in leaves)
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    rng = rngs if rngs is not None else jax.random.key(0)
    rng = jax.device_put(rng, NamedSharding(mesh, PartitionSpec()))
    step = _compiled_step(
        loss_fn, tx, mesh, data_axis, reduce_type, has_aux, rngs is not None, batch_treedef, leaf_specs
    )
    return step(state, batch, rng)
