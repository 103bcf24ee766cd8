"""What autodiff keeps for a ``TransformerLM``'s backward pass, and how the backward pass uses it.

The loss is linearised on a stand-in model with distinct small sizes (so that each dimension of
a residual can be told apart and mapped back to its size on one device); the linear function's
constants are the residuals ``jax.vjp`` keeps. Each is labelled with what the backward pass does
with it: a matmul operand only (``"dot"``), something else only, or both. XLA:TPU stores a
float32 residual that only feeds matmuls in bfloat16, one used both ways twice (float32 and
bfloat16), and a bfloat16 copy of each stacked layer weight a matmul reads (see docs/plan.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np

from shardax.vocabulary import LAYERS

# Stand-in sizes for tracing: distinct numbers, so each dimension of a saved residual can be
# told apart and mapped back to its size on one device (rows, sequence, heads, head size, half a
# head for rotary, MLP width, vocabulary, layers). Model width is heads x head size.
STAND_IN = dict(rows=23, seq=19, heads=5, head=14, mlp=13, vocab=17, layers=29)

# Primitives that only move or relabel data: a residual's use is what is done with their output.
_RELABEL = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "copy", "copy_p"})


class Residual(NamedTuple):
    dims: tuple[int, ...]  # in stand-in sizes
    itemsize: int
    uses: frozenset  # of "dot" and "other"
    parameter: bool  # a parameter the backward pass holds on to (not an activation)


def _inner_jaxprs(eqn: Any) -> list[tuple[Any, int]]:
    """The jaxprs an equation runs, each with how far its inputs are shifted from the equation's."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if eqn.params.get(key) is not None:
            inner = getattr(eqn.params[key], "jaxpr", eqn.params[key])
            return [(inner, len(inner.invars) - len(eqn.invars))]
    # a conditional's first operand is the branch index, which its branches do not take
    return [(getattr(branch, "jaxpr", branch), -1) for branch in eqn.params.get("branches", ())]


def _uses(jaxpr: Any, var: Any) -> frozenset:
    """What ``jaxpr`` does with ``var``: ``"dot"`` where it is a matmul operand, ``"other"`` otherwise."""
    kinds: set[str] = set()
    for eqn in jaxpr.eqns:
        for position, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            name, inner = eqn.primitive.name, _inner_jaxprs(eqn)
            if name == "dot_general":
                kinds.add("dot")
            elif name in _RELABEL:
                kinds |= _uses(jaxpr, eqn.outvars[0])
            elif inner:
                for body, shift in inner:
                    if 0 <= position + shift < len(body.invars):
                        kinds |= _uses(body, body.invars[position + shift])
            else:
                kinds.add("other")
    if any(out is var for out in jaxpr.outvars):
        kinds.add("other")
    return frozenset(kinds)


@functools.lru_cache(maxsize=64)
def traced_residuals(model: Any, layers: int = STAND_IN[LAYERS]) -> tuple[Residual, ...]:
    """The residuals of ``model``'s loss with ``layers`` layers, in stand-in sizes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shardax.models.transformer import TransformerLM, next_token_loss

    size = STAND_IN
    # every key/value head its own and the head width d_model / heads: a checkpoint's grouped-query
    # attention and explicit head_dim (a Hugging Face config's) are estimated as plain multi-head
    stand_in = dataclasses.replace(model, vocab_size=size["vocab"], seq_len=size["seq"],
                                   d_model=size["heads"] * size["head"], n_heads=size["heads"],
                                   n_kv_heads=None, attention_head_dim=None, n_layers=layers,
                                   d_ff=size["mlp"])
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: TransformerLM(stand_in, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    params, rest = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), (params, rest))
    tokens = jnp.zeros((size["rows"], size["seq"] + 1), jnp.int32)
    loss = lambda p: next_token_loss(nnx.merge(graphdef, p, rest, copy=True), {"tokens": tokens})  # noqa: E731
    linear = jax.make_jaxpr(jax.linearize(loss, params)[1])(params)
    # a constant shaped like an argument not yet matched is taken to be that argument
    arguments = [(tuple(leaf.shape), leaf.dtype) for leaf in jax.tree.leaves((params, tokens))]
    residuals = []
    for var, const in zip(linear.jaxpr.constvars, linear.consts):
        key = (tuple(const.shape), const.dtype)
        matched = key in arguments
        if matched:
            arguments.remove(key)
        residuals.append(Residual(key[0], np.dtype(const.dtype).itemsize, _uses(linear.jaxpr, var), matched))
    return tuple(residuals)
