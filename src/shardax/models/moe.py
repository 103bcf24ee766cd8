"""A mixture of experts in place of the MLP (Mixtral, Qwen3-MoE): a router picks ``top_k`` of
``n_experts`` gated MLPs for each token, whose outputs are summed with the router's weights.

Routing is dropless by default: the token copies are sorted by expert and each expert's run of
them goes through its weights in one grouped matmul (``jax.lax.ragged_dot``), so no token is
dropped and no expert computes padding. With a ``capacity_factor`` each expert takes at most
``capacity_factor * tokens * top_k / n_experts`` tokens (the earliest; the rest pass through the
layer unchanged, as Switch and GShard do), computed as dense per-expert batches.

The router's auxiliary terms are kept on the layer (``router_losses``, an ``nnx.Intermediate``
per layer) for the loss to read: the load-balancing loss (Switch Transformer's ``E * sum_e f_e
P_e``, f the token copies routed to e per token and P its mean router probability, as transformers
computes it) and the
router z-loss (ST-MoE's mean squared log-sum-exp of the router logits).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.layers import annotated_param
from shardax.models import ops
from shardax.sharding.compute import for_compute


class RouterLosses(nnx.Intermediate):
    """(load-balancing loss, z-loss) of the last call of one MoE layer."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> nnx.Param:
    return annotated_param(nnx.initializers.normal(fan_in ** -0.5), rngs.params(), shape, axes)


class MixtureOfExperts(nnx.Module):
    """(B, T, D) -> (B, T, D): each token through its ``top_k`` experts, weighted by the router."""

    def __init__(self, config: Any, rngs: nnx.Rngs) -> None:
        d, f, e = config.d_model, config.ff_width, config.n_experts
        self.config = config
        self.router = _param(rngs, (d, e), ("embed", None), d)
        self.gate_up = _param(rngs, (e, d, 2, f), ("expert", "embed", None, "mlp"), d)
        self.down = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), f)
        self.router_losses = RouterLosses(jnp.zeros((2,), jnp.float32))

    def route(self, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Each token's experts (N, k), their weights (N, k) and the router's logits (N, E)."""
        config = self.config
        logits = (y @ for_compute(self.router, y.dtype)).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = jax.lax.top_k(probs, config.experts_per_token)
        if config.normalize_top_k:
            weights = weights / weights.sum(-1, keepdims=True)
        return chosen, weights, logits

    def __call__(self, y: jax.Array) -> jax.Array:
        config = self.config
        batch, length, width = y.shape
        tokens = y.reshape(batch * length, width)
        chosen, weights, logits = self.route(tokens)
        self.router_losses[...] = router_losses(logits, chosen, config.n_experts)
        if config.capacity_factor is None:
            out = self._dropless(tokens, chosen, weights.astype(y.dtype))
        else:
            out = self._with_capacity(tokens, chosen, weights.astype(y.dtype))
        return out.reshape(batch, length, width)

    def _experts(self, x: jax.Array, group_sizes: jax.Array | None) -> jax.Array:
        """Rows of ``x`` through their experts: sorted rows with ``group_sizes`` (ragged), or
        (E, C, D) batches, one per expert."""
        config, dtype = self.config, x.dtype
        gate_up = for_compute(self.gate_up, dtype)
        down = for_compute(self.down, dtype)
        glu = ops.swiglu if config.mlp == "swiglu" else ops.geglu
        if group_sizes is None:
            h = jnp.einsum("ecd,edgf->ecgf", x, gate_up)
            return jnp.einsum("ecf,efd->ecd", glu(h[..., 0, :], h[..., 1, :]), down)
        e, d, _, f = gate_up.shape
        h = jax.lax.ragged_dot(x, gate_up.reshape(e, d, 2 * f), group_sizes).reshape(-1, 2, f)
        return jax.lax.ragged_dot(glu(h[:, 0], h[:, 1]), down, group_sizes)

    def _dropless(self, tokens: jax.Array, chosen: jax.Array, weights: jax.Array) -> jax.Array:
        """Every token copy, sorted by expert, through one grouped matmul per weight."""
        k = chosen.shape[1]
        experts = chosen.reshape(-1)
        order = jnp.argsort(experts, stable=True)
        source = order // k  # the token each sorted copy is of
        sizes = jnp.bincount(experts, length=self.config.n_experts).astype(jnp.int32)
        out = self._experts(tokens[source], sizes) * weights.reshape(-1)[order][:, None]
        return jnp.zeros_like(tokens).at[source].add(out)

    def _with_capacity(self, tokens: jax.Array, chosen: jax.Array, weights: jax.Array) -> jax.Array:
        """At most ``capacity`` tokens per expert (the earliest), as dense (E, C, D) batches."""
        config = self.config
        n, k = chosen.shape
        e = config.n_experts
        capacity = max(1, int(-(-config.capacity_factor * n * k // e)))
        one_hot = jax.nn.one_hot(chosen.reshape(-1), e, dtype=jnp.int32)  # (N*k, E), token-major
        place = (jnp.cumsum(one_hot, axis=0) - 1) * one_hot  # each copy's place in its expert's queue
        kept = one_hot * (place < capacity)
        dispatch = kept[:, :, None] * jax.nn.one_hot(place, capacity, dtype=jnp.int32)  # (N*k, E, C)
        dispatch = dispatch.reshape(n, k, e, capacity).astype(tokens.dtype)
        batches = jnp.einsum("nkec,nd->ecd", dispatch, tokens)
        out = self._experts(batches, None)
        return jnp.einsum("nkec,nk,ecd->nd", dispatch, weights, out)


def router_losses(logits: jax.Array, chosen: jax.Array, experts: int) -> jax.Array:
    """(load-balancing loss, z-loss) of one layer's routing: logits (N, E), chosen (N, k)."""
    probs = jax.nn.softmax(logits, axis=-1)
    routed = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(1)  # (N, E): copies per expert
    balance = experts * jnp.sum(routed.mean(0) * probs.mean(0))  # as transformers' load_balancing_loss_func
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return jnp.stack([balance, z])
