"""Parameters as layers use them: gathered for compute, their gradients sent to the storage layout.

``gather_for_compute`` constrains a value to its compute layout (for FSDP, an all-gather) and
its gradient to the gradient layout (a reduce-scatter), in one custom gradient. The step does
this for the weights outside any stack; ``shardax.blocks.LayerStack`` does it for one layer of
its stack at a time, inside the scan, from the specs ``parallelize`` hands it. Nothing here
reads ambient state: ``for_compute(param, dtype)`` only casts.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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


def for_compute(param: nnx.Variable, dtype: Any = None) -> jax.Array:
    """The value of ``param`` as a layer computes with it: cast to ``dtype`` when given (its
    gradient cast back; see ``cast_for_compute``). Where it lives while computing is laid out
    before the layer runs (by the step, or per layer by ``shardax.blocks.LayerStack``)."""
    value = param[...]
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
