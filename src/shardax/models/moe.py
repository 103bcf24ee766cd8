"""A mixture of experts in place of the MLP (Mixtral, Qwen3-MoE): a router picks ``top_k`` of
``n_experts`` gated MLPs for each token, whose outputs are summed with the router's weights.

Routing is dropless by default: the token copies are sorted by expert and each expert's run of
them goes through its weights in one grouped matmul (``jax.lax.ragged_dot``), so no token is
dropped and no expert computes padding. With a ``capacity_factor`` each expert takes at most
``capacity_factor * tokens * top_k / n_experts`` tokens (the earliest; the rest pass through the
layer unchanged, as Switch and GShard do), computed as dense per-expert batches.

What the router did is kept on the layer (``router_stats``, an ``nnx.Intermediate`` per layer)
for the loss to read; ``router_losses`` makes the auxiliary terms of them: the load-balancing loss (Switch
Transformer's ``E * sum_e f_e P_e``, f the token copies routed to e per token and P its mean router
probability, as transformers computes it) and the
router z-loss (ST-MoE's mean squared log-sum-exp of the router logits).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from shardax.experts import ExpertLayout
from shardax.layers import annotated_param
from shardax.models import ops
from shardax.sharding.compute import for_compute


class RouterStats(nnx.Intermediate):
    """What the last call of one MoE layer's router did, over all its tokens: the share of token
    copies each expert got (E), each expert's mean router probability (E) and the mean squared
    log-sum-exp of the logits (1); ``router_losses`` makes the auxiliary losses of them."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> nnx.Param:
    return annotated_param(nnx.initializers.normal(fan_in ** -0.5), rngs.params(), shape, axes)


class MixtureOfExperts(nnx.Module):
    """(B, T, D) -> (B, T, D): each token through its ``top_k`` experts, weighted by the router.
    An ``ExpertMixture`` (``shardax.experts``): ``parallelize`` tells it how the step splits it."""

    def __init__(self, config: Any, rngs: nnx.Rngs) -> None:
        d, f, e = config.d_model, config.ff_width, config.n_experts
        self.config = config
        self.router = _param(rngs, (d, e), ("embed", None), d)
        self.gate_up = _param(rngs, (e, d, 2, f), ("expert", "embed", None, "mlp"), d)
        self.down = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), f)
        self.router_stats = RouterStats(jnp.zeros((2 * e + 1,), jnp.float32))
        if config.shared_expert_d_ff:  # Qwen2-MoE: one more MLP for every token, its output gated
            s = config.shared_expert_d_ff
            self.shared_gate_up = _param(rngs, (d, 2, s), ("embed", None, "mlp"), d)
            self.shared_down = _param(rngs, (s, d), ("mlp", "embed"), s)
            self.shared_gate = _param(rngs, (d, 1), ("embed", None), d)
        self.expert_layout: ExpertLayout | None = None  # set by parallelize (shardax.experts.ExpertMixture)

    @property
    def routes_per_device(self) -> bool:
        """Dropless routing runs per device; a capacity per expert is the whole batch's."""
        return self.config.capacity_factor is None

    def route(self, y: jax.Array, router: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Each token's experts (N, k), their weights (N, k) and the router's logits (N, E)."""
        config = self.config
        router = for_compute(self.router, y.dtype) if router is None else router
        logits = (y @ router).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = jax.lax.top_k(probs, config.experts_per_token)
        if config.normalize_top_k:
            weights = weights / weights.sum(-1, keepdims=True)
        return chosen, weights, logits

    def __call__(self, y: jax.Array) -> jax.Array:
        return self._routed(y) + self._shared(y) if self.config.shared_expert_d_ff else self._routed(y)

    def _shared(self, y: jax.Array) -> jax.Array:
        """The shared expert's output, gated per token by a sigmoid."""
        dtype, glu = y.dtype, ops.swiglu if self.config.mlp == "swiglu" else ops.geglu
        h = jnp.einsum("btd,dcf->btcf", y, for_compute(self.shared_gate_up, dtype))
        out = glu(h[:, :, 0], h[:, :, 1]) @ for_compute(self.shared_down, dtype)
        return jax.nn.sigmoid(y @ for_compute(self.shared_gate, dtype)) * out

    def _routed(self, y: jax.Array) -> jax.Array:
        config = self.config
        if self.expert_layout is not None:
            out, self.router_stats[...] = _across_devices(self, y)
            return out
        batch, length, width = y.shape
        tokens = y.reshape(batch * length, width)
        chosen, weights, logits = self.route(tokens)
        self.router_stats[...] = router_stats(logits, chosen, config.n_experts)
        if config.capacity_factor is None:
            out = self.dropless(tokens, chosen, weights.astype(y.dtype))
        else:
            out = self._with_capacity(tokens, chosen, weights.astype(y.dtype))
        return out.reshape(batch, length, width)

    def _experts(self, x: jax.Array, group_sizes: jax.Array | None) -> jax.Array:
        """Rows of ``x`` through their experts: sorted rows with ``group_sizes`` (ragged), or
        (E, C, D) batches, one per expert."""
        gate_up, down = for_compute(self.gate_up, x.dtype), for_compute(self.down, x.dtype)
        if group_sizes is None:
            glu = ops.swiglu if self.config.mlp == "swiglu" else ops.geglu
            h = jnp.einsum("ecd,edgf->ecgf", x, gate_up)
            return jnp.einsum("ecf,efd->ecd", glu(h[..., 0, :], h[..., 1, :]), down)
        return self.expert_rows(x, group_sizes, gate_up, down)

    def expert_rows(self, x: jax.Array, group_sizes: jax.Array, gate_up: jax.Array,
                    down: jax.Array) -> jax.Array:
        """Rows of ``x`` sorted by expert, ``group_sizes[e]`` of them for expert e (any rows after
        those come out as zeros), through their experts' ``gate_up`` and ``down``."""
        glu = ops.swiglu if self.config.mlp == "swiglu" else ops.geglu
        e, d, _, f = gate_up.shape
        h = ops.grouped_matmul(x, gate_up.reshape(e, d, 2 * f), group_sizes).reshape(-1, 2, f)
        return ops.grouped_matmul(glu(h[:, 0], h[:, 1]), down, group_sizes)

    def dropless(self, tokens: jax.Array, chosen: jax.Array, weights: jax.Array,
                 gate_up: jax.Array | None = None, down: jax.Array | None = None) -> jax.Array:
        """Every token copy, sorted by expert, through one grouped matmul per weight (the layer's
        own weights, or ``gate_up`` and ``down`` as given)."""
        k = chosen.shape[1]
        experts = chosen.reshape(-1)
        order = jnp.argsort(experts, stable=True)
        source = order // k  # the token each sorted copy is of
        sizes = jnp.bincount(experts, length=self.config.n_experts).astype(jnp.int32)
        rows = tokens[source]
        done = self._experts(rows, sizes) if gate_up is None else self.expert_rows(rows, sizes, gate_up, down)
        out = done * weights.reshape(-1)[order][:, None]
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


def router_stats(logits: jax.Array, chosen: jax.Array, experts: int, axes: tuple[str, ...] = ()) -> jax.Array:
    """``RouterStats`` of one layer's routing: logits (N, E), chosen (N, k); with ``axes``, over
    the tokens of every device on them (inside ``shard_map``, equal shares)."""
    routed = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(1)  # (N, E): copies per expert
    stats = jnp.concatenate([routed.mean(0), jax.nn.softmax(logits, axis=-1).mean(0),
                             jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)[None]])
    return jax.lax.pmean(stats, axes) if axes else stats


def router_losses(stats: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) of ``RouterStats`` of any number of layers (leading
    dimensions), over all of them: ``E * sum_e f_e P_e`` with f and P averaged over the layers
    first, as transformers' ``load_balancing_loss_func`` does, and the mean z-loss."""
    stats = stats.reshape(-1, stats.shape[-1]).mean(0)
    experts = (stats.shape[0] - 1) // 2
    return experts * jnp.sum(stats[:experts] * stats[experts:2 * experts]), stats[-1]


def _across_devices(moe: "MixtureOfExperts", y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``moe`` on ``y`` (B, T, D) laid out by ``moe.expert_layout``: each device routes its own tokens (not
    the whole batch's, as the compiler would make of a sort over tokens split over devices).
    With the experts split over an axis it sends each copy to the device of its expert (an
    all-to-all), computes its experts' rows in grouped matmuls and sends the results back (a
    second all-to-all). Returns the output and the router statistics over every token."""
    layout, config = moe.expert_layout, moe.config
    layout.check(config.n_experts, config.capacity_factor)
    rows = tuple(a for a in layout.batch_axes if layout.mesh.shape.get(a, 1) > 1)
    tokens_spec = PartitionSpec(rows or None, layout.sequence_axis, None)
    dtype = y.dtype
    weights = (for_compute(moe.router, dtype), for_compute(moe.gate_up, dtype), for_compute(moe.down, dtype))

    def local(y: jax.Array, router: jax.Array, gate_up: jax.Array,
              down: jax.Array) -> tuple[jax.Array, jax.Array]:
        batch, length, width = y.shape
        tokens = y.reshape(batch * length, width)
        chosen, gates, logits = moe.route(tokens, router)
        stats = router_stats(logits, chosen, config.n_experts, layout.token_axes)
        if layout.shards == 1:
            out = moe.dropless(tokens, chosen, gates.astype(dtype), gate_up, down)
        else:
            out = _exchange(moe, tokens, chosen, gates.astype(dtype), gate_up, down, layout)
        return out.reshape(batch, length, width), stats

    experts = PartitionSpec(layout.axis if layout.shards > 1 else None)
    return jax.shard_map(local, mesh=layout.mesh, in_specs=(tokens_spec, PartitionSpec(), experts, experts),
                         out_specs=(tokens_spec, PartitionSpec()))(y, *weights)


def _exchange(moe: "MixtureOfExperts", tokens: jax.Array, chosen: jax.Array, gates: jax.Array,
              gate_up: jax.Array, down: jax.Array, layout: ExpertLayout) -> jax.Array:
    """One device's part of ``_across_devices``: its tokens' copies there and back.

    Copies go out in fixed-size slots, ``tokens x min(top_k, local experts)`` per destination
    (the most one device's tokens can send to one device), because XLA:CPU has no
    ``ragged_all_to_all``; each device then sorts what it received by its own experts."""
    shards, (n, k) = layout.shards, chosen.shape
    local_experts = moe.config.n_experts // shards
    slots = n * min(k, local_experts)
    experts = chosen.reshape(-1)
    order = jnp.argsort(experts, stable=True)
    destination = experts[order] // local_experts
    counts = (jnp.bincount(experts, length=moe.config.n_experts).astype(jnp.int32)
              .reshape(shards, local_experts))
    sent = counts.sum(1)
    slot = jnp.arange(n * k) - (jnp.cumsum(sent) - sent)[destination]
    outbox = (jnp.zeros((shards, slots, tokens.shape[1]), tokens.dtype)
              .at[destination, slot].set(tokens[order // k]))
    inbox = jax.lax.all_to_all(outbox, layout.axis, 0, 0)  # (source, slot, D)
    received = jax.lax.all_to_all(counts, layout.axis, 0, 0)  # (source, local expert): copies sent
    # each source's rows are sorted by expert: number them by (local expert, source); padding last
    ends = jnp.cumsum(received, axis=1)
    # (source, slot)
    expert_of = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(slots), side="right"))(ends)
    key = (expert_of * shards + jnp.arange(shards)[:, None]).reshape(-1)
    mine = jnp.argsort(key, stable=True)
    done = moe.expert_rows(inbox.reshape(shards * slots, -1)[mine], received.sum(0), gate_up, down)
    done = jnp.where((key[mine] < local_experts * shards)[:, None], done, 0)  # padding rows: nothing
    outbox = jnp.zeros_like(done).at[mine].set(done).reshape(shards, slots, -1)
    back = jax.lax.all_to_all(outbox, layout.axis, 0, 0)[destination, slot]  # each copy's result, sorted
    return jnp.zeros_like(tokens).at[order // k].add(back * gates.reshape(-1)[order][:, None])
