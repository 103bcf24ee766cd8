"""Parameters as layers use them: gathered for compute, their gradients sent to the storage layout.

Inside a scanned stack of layers the step cannot constrain one layer's weights at a time; the
layer has to. ``for_compute(param)`` does it: it reads the parameter, constrains it to the
strategy's compute layout (for FSDP, the all-gather of just this layer), and makes its
gradient take the strategy's gradient layout (the reduce-scatter of just this layer). Outside
a ``compute_layout`` context it is a plain read, so models stay usable on their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.sharding.rules import logical_axes_of

# Gathered weights are named so that remat policies can drop them: the backward pass then
# gathers each layer again instead of keeping every layer's full weights alive (ZeRO-3).
GATHERED = "shardax_gathered_weight"


def without_gathered(policy: Any = None) -> Any:
    """A remat policy: what ``policy`` saves (everything if None), except gathered weights.

    Primitives are recognised by their public names (``checkpoint_name`` binds one called
    ``name``), so nothing here depends on JAX's private modules."""

    def decide(primitive: Any, *avals: Any, **params: Any) -> bool:
        if primitive.name == "name" and params.get("name") == GATHERED:
            return False
        if primitive.name.startswith("custom_vjp_call"):  # the gather itself (see gather_for_compute)
            return False
        return True if policy is None else policy(primitive, *avals, **params)

    return decide

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Any] | None] = contextvars.ContextVar("shardax_compute", default=None)


@contextlib.contextmanager
def compute_layout(mesh: Mesh, strategy: Any) -> Iterator[None]:
    """Within this context (while a step is traced), ``for_compute`` applies ``strategy`` on ``mesh``."""
    token = _ACTIVE.set((mesh, strategy))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def gathers_weights() -> bool:
    """Whether the step being traced gathers weights for compute (an FSDP-like strategy)."""
    active = _ACTIVE.get()
    return active is not None and bool(active[1].gather_axes)


def gather_for_compute(value: jax.Array, compute: NamedSharding, gradient: NamedSharding,
                       dtype: Any = None) -> jax.Array:
    """``value`` constrained to ``compute`` (and cast to ``dtype``); its cotangent constrained
    to ``gradient`` (in ``value``'s dtype).

    A plain sharding constraint would transpose to the same constraint on the cotangent, which
    for a gathered (replicated) weight means an all-reduce of the full gradient; here the
    backward pass goes straight to the gradient layout, which the compiler turns into a
    reduce-scatter when that layout is sharded. The cast happens inside, so that remat
    policies drop the cast copy along with the gathered weight.
    """
    source_dtype = value.dtype
    target_dtype = source_dtype if dtype is None else dtype

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, compute).astype(target_dtype)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return gather(x), None

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        return (jax.lax.with_sharding_constraint(cotangent.astype(source_dtype), gradient),)

    gather.defvjp(forward, backward)
    return checkpoint_name(gather(value), GATHERED)


def layer_specs(strategy: Any, logical: tuple[str | None, ...] | None, shape: tuple[int, ...], mesh: Mesh,
                where: str) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    """(storage, compute, gradient) specs of one parameter under ``strategy``."""
    spec, _ = strategy.param_spec(logical, shape, mesh, where)
    gradient = strategy.optimizer_spec(spec, shape, mesh, logical) if strategy.shard_gradients else spec
    return spec, strategy.compute_spec(spec), gradient


def for_compute(param: nnx.Variable, dtype: Any = None) -> jax.Array:
    """The value of ``param`` laid out for compute under the active strategy (see module doc),
    cast to ``dtype`` when given."""
    value = param[...]
    active = _ACTIVE.get()
    logical = logical_axes_of(param)
    if active is not None and logical is not None and len(logical) == value.ndim:
        mesh, strategy = active
        storage, compute, gradient = layer_specs(strategy, logical, value.shape, mesh, f"parameter {logical}")
        if compute != storage or gradient != storage:
            return gather_for_compute(value, NamedSharding(mesh, compute), NamedSharding(mesh, gradient), dtype)
        # Nothing to gather or scatter (dp, zero1, tp): the weight is used where it is stored and
        # its gradient stays in that layout, so no constraint (and no custom gradient) is needed.
    return value if dtype is None or value.dtype == dtype else cast_for_compute(value, dtype)


def cast_for_compute(value: jax.Array, dtype: Any) -> jax.Array:
    """``value`` cast to ``dtype``, its cotangent cast back. Being a custom gradient, remat
    policies built by ``without_gathered`` recompute the cast in the backward pass instead of
    keeping every layer's copy (under mixed precision, half the parameters' bytes)."""
    source_dtype = value.dtype

    @jax.custom_vjp
    def cast(x: jax.Array) -> jax.Array:
        return x.astype(dtype)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return cast(x), None

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        return (cotangent.astype(source_dtype),)

    cast.defvjp(forward, backward)
    return cast(value)
