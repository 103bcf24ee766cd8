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

# Values that remat policies must never save, by checkpoint name: FSDP's gathered weights (the
# backward pass gathers each layer again instead of keeping every layer's full weights alive:
# ZeRO-3), reduced-precision copies of weights (cast again, instead of keeping every layer's
# bfloat16 copy), and a circular pipeline's pick of this pass's layers from its stage's chunks
# (picked again, not kept once per stage iteration). Each is made inside a small custom
# gradient and named inside it: a name on a bare op only marks the name's own output, and the
# op's output under it stays saveable (a copy of the same bytes). The policy below tells these
# custom VJPs from every other one (layer norms, fused attention, a user's op) by the name.
GATHERED = "shardax_gathered_weight"
COMPUTE_COPY = "shardax_compute_copy"
PIPELINE_CHUNK = "shardax_pipeline_chunk"
NEVER_SAVED = frozenset({GATHERED, COMPUTE_COPY, PIPELINE_CHUNK})


def _names_inside(params: dict[str, Any]) -> set[str]:
    """The checkpoint names bound inside a custom VJP's primal computation (``call_jaxpr``)."""
    jaxpr = params.get("call_jaxpr")
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return {eqn.params.get("name") for eqn in getattr(jaxpr, "eqns", ()) if eqn.primitive.name == "name"}


def remat_policy(policy: Any = None, *, save_custom_vjps: bool | None = None) -> Any:
    """The remat policy shardax applies: what ``policy`` saves (everything if None), except what
    is named in ``NEVER_SAVED``.

    ``save_custom_vjps``: whether the outputs of other custom VJPs are saved. JAX's policies see
    a custom VJP as one opaque primitive that is not a dot, so ``dots_saveable`` alone would run
    fused attention (cuDNN's is a custom VJP) and a user's custom ops twice. Default: saved
    unless ``policy`` is ``nothing_saveable`` (full remat recomputes everything).
    Primitives are recognised by their public names (``checkpoint_name`` binds one called
    ``name``), so nothing here depends on JAX's private modules."""
    if save_custom_vjps is None:
        save_custom_vjps = policy is not jax.checkpoint_policies.nothing_saveable

    def decide(primitive: Any, *avals: Any, **params: Any) -> bool:
        if primitive.name == "name" and params.get("name") in NEVER_SAVED:
            return False
        if primitive.name.startswith("custom_vjp_call"):
            return save_custom_vjps and not _names_inside(params) & NEVER_SAVED
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


@contextlib.contextmanager
def laid_out_already() -> Iterator[None]:
    """Within this context ``for_compute`` is a plain read: the weights were laid out for compute
    beforehand (a pipeline gathers its stage's weights once, before its loop)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


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
        return checkpoint_name(jax.lax.with_sharding_constraint(x, compute).astype(target_dtype), GATHERED)

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


def compute_spec_of(param: nnx.Variable) -> PartitionSpec | None:
    """The layout ``for_compute`` gives ``param`` under the active strategy (None outside one)."""
    active = _ACTIVE.get()
    logical = logical_axes_of(param)
    if active is None or logical is None or len(logical) != param[...].ndim:
        return None
    mesh, strategy = active
    return layer_specs(strategy, logical, param[...].shape, mesh, f"parameter {logical}")[1]


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
    """``value`` cast to ``dtype``, its cotangent cast back. The cast is one custom-gradient
    primitive named ``COMPUTE_COPY`` inside (a bare cast's output would be saveable on its own),
    so ``remat_policy`` recomputes it in the backward pass instead of keeping every layer's
    copy (under mixed precision, half the parameters' bytes)."""
    source_dtype = value.dtype

    @jax.custom_vjp
    def cast(x: jax.Array) -> jax.Array:
        return checkpoint_name(x.astype(dtype), COMPUTE_COPY)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return cast(x), None

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        return (cotangent.astype(source_dtype),)

    cast.defvjp(forward, backward)
    return cast(value)
