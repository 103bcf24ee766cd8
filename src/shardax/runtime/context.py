"""Context parallelism: the sequence dimension of activations split over a ``context`` mesh axis.

Everything a transformer does to one token at a time (embeddings, layer norms, the MLP, the
head, the loss) runs on each device's share of the sequence with no communication; only
attention needs the other shares' keys and values. Two ways to get them, chosen per step:

- ``all-gather`` (the default, as Llama 3 trained): every layer all-gathers the keys and
  values over ``context``, and each device attends with its own queries to the whole sequence.
  Its backward pass reduce-scatters their gradients.
- ``ring``: the key/value shares travel round the devices, one neighbour hop per step
  (``ppermute``), C steps for C shares, each folded into the output with an online softmax, in
  blocks of at most ``RING_BLOCK`` tokens; its backward pass goes round the ring again (a
  custom VJP, flash-attention style), so a device holds a couple of shares of keys and values
  and one block's scores at a time.

The mask is computed from each token's position (and document, for packed sequences), never
from where a token sits in the array, so any order of the sequence is correct. The order
``token_losses`` uses is the zig-zag one (``zigzag_order``): the sequence is cut into 2C
chunks and device i holds chunks i and 2C-1-i, so under a causal mask every device has the same
amount of attention to compute. Under ``ring`` a block with no allowed (query, key) pair is
skipped (``lax.cond``): with the zig-zag order and two blocks a share, every device computes
exactly two of the four at every hop but its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.runtime.attention import allowed, dense_attention
from shardax.vocabulary import CONTEXT, CONTEXT_ATTENTIONS, DATA

AXIS = CONTEXT
VARIANTS = CONTEXT_ATTENTIONS


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """How the step being traced splits sequences: over ``axis`` of ``mesh``, attention by ``variant``."""

    mesh: Mesh
    axis: str
    variant: str
    batch_axes: tuple[str, ...]
    heads_axes: tuple[str, ...] = ()  # where attention heads are split (tensor parallelism)

    @classmethod
    def create(cls, mesh: Mesh, variant: str = "all-gather", batch_axes: tuple[str, ...] = (DATA,),
               heads_axes: tuple[str, ...] = (), axis: str = AXIS) -> "ContextLayout":
        """Sequences split over ``axis``; rows over ``batch_axes`` and attention heads over
        ``heads_axes`` (those the mesh has)."""
        if variant not in VARIANTS:
            raise UsageError(f"`context_attention={variant!r}`; use one of {', '.join(VARIANTS)}")
        return cls(mesh, axis, variant, tuple(batch_axes), tuple(a for a in heads_axes if a in mesh.shape))

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]

    def check_length(self, length: int, what: str = "a sequence") -> None:
        """The sequence must cut into 2C equal chunks (C shares, two chunks each)."""
        chunks = 2 * self.shards
        if length % chunks:
            lower, upper = length - length % chunks, length - length % chunks + chunks
            nearest = " or ".join(str(n) for n in (lower, upper) if n > 0)
            raise UsageError(f"{what} of {length} tokens does not cut into {chunks} equal chunks "
                             f"({self.axis}={self.shards} shares of two chunks each); use "
                             f"`seq_len={nearest}`")

    @property
    def rows(self) -> Any:
        """The spec entry of the batch dimension."""
        batch = tuple(a for a in self.batch_axes if a in self.mesh.shape)
        return None if not batch else batch[0] if len(batch) == 1 else batch

    def split_sequence(self, x: jax.Array) -> jax.Array:
        """``x`` (B, T, ...) laid out with rows over the batch axes and the sequence over ``axis``."""
        spec = PartitionSpec(self.rows, self.axis, *(None,) * (x.ndim - 2))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """The permutation of ``range(length)`` that gives share i chunks i and 2C-1-i of 2C chunks."""
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segments: jax.Array | None, *,
              layout: ContextLayout, implementation: str | None = None, window: Any = 0,
              scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Causal attention over a sequence split by ``layout``.

    ``q``, ``k``, ``v``: (B, T, N, H) global arrays; ``positions`` (B, T): each token's place in
    its document; ``segments`` (B, T) or None: its document. A query attends to the keys of its
    own document at positions up to its own, within ``window`` of it where one is given
    (``shardax.runtime.attention.allowed``). ``scale``: of the scores (default ``H ** -0.5``);
    ``softcap``: Gemma 2's cap on them (all-gather only)."""
    shards = layout.shards
    if q.shape[1] % shards:
        layout.check_length(q.shape[1])
    if softcap is not None and layout.variant == "ring":
        raise UsageError(f"attention soft-capping (this model caps its scores at {softcap}) runs with "
                         "`context_attention='all-gather'`, not 'ring'; choose all-gather")
    segments = jnp.zeros_like(positions) if segments is None else segments
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    window = jnp.asarray(window, jnp.int32)

    def gathered(q, k, v, positions, segments, window):
        # Under --remat none the gathered copies are kept for the backward pass (one gather per
        # layer); a policy that saves only dots, or nothing, gathers them again there (two).
        def everyone(x):
            return jax.lax.all_gather(x, layout.axis, axis=1, tiled=True)

        k_all, v_all, pos_all, seg_all = everyone(k), everyone(v), everyone(positions), everyone(segments)
        mask = allowed(positions, segments, pos_all, seg_all, window)[:, None]  # (B, 1, t, T)
        return dense_attention(q, k_all, v_all, mask, scale=scale, softcap=softcap,
                               implementation=implementation)

    def ring(q, k, v, positions, segments, window):
        return _ring_attention(layout.axis, shards, scale, q, k, v, positions, segments, window)

    # Every axis is manual: rows stay on their batch axes and heads on theirs, as around it. (The
    # ring's gradient is its own, and the gather's transpose is a reduce-scatter either way, so
    # JAX's tracking of which values vary over which axes is not needed.)
    body = gathered if layout.variant == "all-gather" else ring
    heads = (None if not layout.heads_axes else layout.heads_axes[0] if len(layout.heads_axes) == 1
             else layout.heads_axes)
    split, tokens = PartitionSpec(layout.rows, layout.axis, heads), PartitionSpec(layout.rows, layout.axis)
    return jax.shard_map(body, mesh=layout.mesh,
                         in_specs=(split, split, split, tokens, tokens, PartitionSpec()), out_specs=split,
                         check_vma=False)(q, k, v, positions, segments, window)


# The most tokens of one block of queries or keys the ring folds at once: a block's scores are
# (block x block) per head, so the memory it needs grows with the block, not with the sequence.
RING_BLOCK = 512


def _parts(length: int) -> int:
    """How many blocks a share of ``length`` tokens is cut into: its two zig-zag chunks (where it
    has two), each cut further until a block holds at most ``RING_BLOCK`` tokens."""
    if length % 2:
        return 1
    parts = 2
    while length // parts > RING_BLOCK and length % (2 * parts) == 0:
        parts *= 2
    return parts


def _stacked(x: jax.Array, parts: int) -> jax.Array:
    """``x`` (B, t, ...) as (parts, B, t/parts, ...): blocks to scan over."""
    return jnp.moveaxis(x.reshape(x.shape[0], parts, x.shape[1] // parts, *x.shape[2:]), 1, 0)


def _unstacked(x: jax.Array) -> jax.Array:
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring_attention(axis: str, shards: int, scale: float, q: jax.Array, k: jax.Array, v: jax.Array,
                    positions: jax.Array, segments: jax.Array, window: jax.Array) -> jax.Array:
    """Ring attention of one share (inside ``shard_map`` over ``axis``); see the module docstring."""
    return _ring_forward(axis, shards, scale, q, k, v, positions, segments, window)[0]


def _ring_forward(axis, shards, scale, q, k, v, positions, segments, window):
    """The output of this share's queries and the log of their softmax denominators.

    Keys and values travel one hop per step (C - 1 hops, a loop). At each, every block of
    queries scans the blocks of keys that arrived, folding each block that holds an allowed
    (query, key) pair into its running sums (an online softmax) and skipping the others."""
    parts = _parts(q.shape[1])
    hop = [(j, (j + 1) % shards) for j in range(shards)]
    query_blocks = tuple(_stacked(x, parts) for x in (q * scale, positions, segments))
    blocks, length, heads = parts, q.shape[1] // parts, q.shape[2]
    sums = (jnp.zeros((blocks, *query_blocks[0].shape[1:]), jnp.float32),
            jnp.full((blocks, q.shape[0], heads, length), -jnp.inf, jnp.float32),
            jnp.zeros((blocks, q.shape[0], heads, length), jnp.float32))

    def fold_share(sums, share):
        key_blocks = tuple(_stacked(x, parts) for x in share)

        def per_query_block(_, inputs):
            query, q_pos, q_seg, block_sums = inputs

            def fold(block_sums, keys):
                # the mask is made inside the branch from the tokens' places (B, q) and (B, k)
                tokens = (q_pos, q_seg, keys[2], keys[3], window)
                return jax.lax.cond(jnp.any(allowed(*tokens)), _fold, lambda s, *_: s, block_sums, query,
                                    keys[0], keys[1], tokens), None

            return None, jax.lax.scan(fold, block_sums, key_blocks)[0]

        return jax.lax.scan(per_query_block, None, (*query_blocks, sums))[1]

    def hop_step(_, carry):
        sums, share = carry
        sums = fold_share(sums, share)
        return sums, jax.lax.ppermute(share, axis, hop)

    sums, share = _loop(shards - 1, hop_step, (sums, (k, v, positions, segments)))
    out, top, total = fold_share(sums, share)
    total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
    out = _unstacked(out / jnp.swapaxes(total, 2, 3)[..., None])
    log_sum = _rows_last(top + jnp.log(total))  # (B, N, t)
    return out.astype(q.dtype), log_sum


def _loop(count: int, body: Any, carry: Any) -> Any:
    """``body(i, carry)`` for i < ``count``, as a ``while_loop``. The ring differentiates itself
    (a custom VJP), so its loops are never differentiated; as a while loop (which JAX cannot
    split for reverse mode) the hops are also never taken apart by an outer remat, which could
    otherwise keep every block's scores of every hop for the backward pass."""
    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    return jax.lax.while_loop(lambda state: state[0] < count, step, (0, carry))[1]


def _rows_last(x: jax.Array) -> jax.Array:
    """(blocks, B, N, c) -> (B, N, blocks * c)."""
    return jnp.moveaxis(x, 0, 2).reshape(x.shape[1], x.shape[2], -1)


def _rows_blocked(x: jax.Array, parts: int) -> jax.Array:
    """(B, N, t) -> (parts, B, N, t / parts)."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], parts, -1), 2, 0)


def _ring_forward_rule(axis, shards, scale, q, k, v, positions, segments, window):
    out, log_sum = _ring_forward(axis, shards, scale, q, k, v, positions, segments, window)
    return out, (q, k, v, positions, segments, window, out, log_sum)


def _ring_backward_rule(axis, shards, scale, saved, d_out):
    """The flash-attention backward pass, round the ring again: keys and values travel with the
    gradients of their own share, which come home on one last hop. Only this share's queries,
    keys, values, output and softmax denominators were kept from the forward pass."""
    q, k, v, positions, segments, window, out, log_sum = saved
    parts = _parts(q.shape[1])
    hop = [(j, (j + 1) % shards) for j in range(shards)]
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out.astype(jnp.float32)).sum(-1).transpose(0, 2, 1)  # D = rowsum(dO * O), (B, N, t)
    query_blocks = (*(_stacked(x, parts) for x in (q, positions, segments, d_out)),
                    _rows_blocked(log_sum, parts), _rows_blocked(delta, parts))
    d_queries = jnp.zeros(query_blocks[0].shape, jnp.float32)

    def unfold_share(d_queries, share):
        key_blocks = tuple(_stacked(x, parts) for x in share)

        def per_query_block(key_grads, inputs):
            query, q_pos, q_seg, d_out, log_sum, delta, d_query = inputs

            def unfold(d_query, keys):
                tokens = (q_pos, q_seg, keys[2], keys[3], window)
                d_query, d_keys, d_values = jax.lax.cond(
                    jnp.any(allowed(*tokens)), _unfold, lambda g, *_: g, (d_query, keys[4], keys[5]), query,
                    keys[0], keys[1], d_out, log_sum, delta, tokens, scale)
                return d_query, (d_keys, d_values)

            d_query, key_grads = jax.lax.scan(unfold, d_query, (*key_blocks[:4], *key_grads))
            return key_grads, d_query

        key_grads, d_queries = jax.lax.scan(per_query_block, key_blocks[4:], (*query_blocks, d_queries))
        return d_queries, (*share[:4], *map(_unstacked, key_grads))

    def hop_step(_, carry):
        d_queries, share = carry
        d_queries, share = unfold_share(d_queries, share)
        return d_queries, jax.lax.ppermute(share, axis, hop)

    zeros = jnp.zeros(k.shape, jnp.float32)
    share = (k, v, positions, segments, zeros, zeros)
    d_queries, share = _loop(shards - 1, hop_step, (d_queries, share))
    d_queries, share = unfold_share(d_queries, share)
    # after C - 1 hops each device holds the gradients of its next neighbour's keys and values
    d_k, d_v = jax.lax.ppermute(share[4:], axis, hop)
    no_grad = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731  (integer inputs)
    return (_unstacked(d_queries).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
            no_grad(positions), no_grad(segments), no_grad(window))


_ring_attention.defvjp(_ring_forward_rule, _ring_backward_rule)


def _unfold(grads, q, k, v, d_out, log_sum, delta, tokens, scale):
    """One block's share of the gradients of the queries, keys and values."""
    d_q, d_k, d_v = grads
    seen = allowed(*tokens)[:, None]  # (B, 1, q, k)
    logits = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32) * scale
    weights = jnp.where(seen, jnp.exp(logits - log_sum[..., None]), 0.0)  # (B, N, q, k)
    d_v = d_v + jnp.einsum("bnqk,bqnh->bknh", weights, d_out)
    d_weights = jnp.einsum("bqnh,bknh->bnqk", d_out, v.astype(jnp.float32))
    d_logits = weights * (d_weights - delta[..., None]) * scale
    d_q = d_q + jnp.einsum("bnqk,bknh->bqnh", d_logits, k.astype(jnp.float32))
    d_k = d_k + jnp.einsum("bnqk,bqnh->bknh", d_logits, q.astype(jnp.float32))
    return d_q, d_k, d_v


def _fold(sums: tuple[jax.Array, jax.Array, jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
          tokens: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one block of keys and values into the running sums of ``q``'s rows."""
    out, top, total = sums
    seen = allowed(*tokens)[:, None]  # (B, 1, q, k)
    logits = jnp.einsum("bqnh,bknh->bnqk", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(seen, logits, -jnp.inf)
    # the result does not depend on the running maximum, so its gradient is not followed
    new_top = jax.lax.stop_gradient(jnp.maximum(top, logits.max(-1)))
    shrink = jnp.exp(jnp.where(jnp.isfinite(top), top - new_top, -jnp.inf))
    weights = jnp.where(seen, jnp.exp(logits - jnp.where(jnp.isfinite(new_top), new_top, 0.0)[..., None]),
                        0.0)
    total = total * shrink + weights.sum(-1)
    update = jnp.einsum("bnqk,bknh->bqnh", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out * shrink.transpose(0, 2, 1)[..., None] + update, new_top, total
