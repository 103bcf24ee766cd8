"""Two public blocks that let any model run under pipeline and context parallelism.

- ``LayerStack(make_layer, count, rngs=...)``: ``count`` copies of a layer, their parameters
  stacked (a leading ``layers`` dimension) and applied one after another with ``nnx.scan``
  (or, with ``scan=False``, a Python loop), under the remat policy it is given. It is the unit
  a pipeline cuts into stages: under ``pp``, ``pp_fsdp`` and ``pp_tp`` its layers are split
  over the ``stage`` axis and the batch flows through them in microbatches.
- ``Attention(implementation=...)``: causal self-attention of projected queries, keys and
  values, with segment ids for packed documents and positions. It picks the fused kernel
  where it applies; on a mesh with a ``context`` axis it attends across a sequence split over
  devices (all-gather or ring).

Neither reads ambient state. ``parallelize`` tells them how the step runs by setting their
``plan`` (a ``StackPlan``) and ``sequence`` (a ``ContextLayout``) on the copy of the model
the step traces; outside it they are plain NNX modules that compute the same thing on one
device. shardax's own ``TransformerLM`` is built from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.errors import UsageError
from shardax.layers import metadata_only
from shardax.runtime import context, kv_cache
from shardax.runtime.attention import allowed, dense_attention
from shardax.runtime.context import ContextLayout
from shardax.runtime.kv_cache import CacheLayer  # noqa: F401  (shardax.blocks.CacheLayer, as documented)
from shardax.runtime.pipeline import PipelineRun, Specs, run_pipeline
from shardax.sharding.compute import gather_for_compute, remat_policy
from shardax.sharding.paths import path_to_str
from shardax.sharding.rules import logical_axes_of
from shardax.vocabulary import ATTENTION_KERNELS, LAYERS

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
IMPLEMENTATIONS = ATTENTION_KERNELS


def remat_plain_loop(platform: str) -> bool:
    """Whether a Python loop of layers that neither recomputes (``remat="none"``) nor gathers
    weights runs under ``nnx.remat`` anyway on ``platform`` (every value saved, each marked by a
    reduce-precision op): on GPUs, where it makes the step a little faster and smaller on an H100
    (benchmark 24 in docs/benchmarks.md). Not on TPUs, where XLA:TPU's compile needs less memory
    and fewer HBM bytes without it (benchmark 22), nor on XLA:CPU, which runs each mark as one more
    copy (benchmark 5; inside a scan, dropping it measured no faster)."""
    return platform == "gpu"


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """How a ``LayerStack`` runs in the step being traced (set by ``parallelize``).

    pipeline: cut into stages and run as this pipeline (None: one device group runs every layer).
    sequence: the activations' sequence dimension is split over devices like this.
    mesh, specs: each stacked parameter's (path within the stack) storage, compute and gradient
      specs on ``mesh``. A scanned stack lays out each layer's weights for compute inside the
      scan (FSDP: the all-gather of just this layer, and the reduce-scatter of its gradient).
    gathers_weights: the strategy gathers weights for compute (FSDP), so a loop of layers runs
      under remat even with ``remat="none"``, which then keeps every value but the gathered weights.
    """

    pipeline: PipelineRun | None = None
    sequence: ContextLayout | None = None
    mesh: Mesh | None = None
    specs: tuple[tuple[str, Specs], ...] = ()
    gathers_weights: bool = False

    def one_layer(self, path: str) -> tuple[NamedSharding, NamedSharding] | None:
        """Compute and gradient shardings of one layer of the stacked parameter at ``path`` (the
        leading ``layers`` dimension gone), or None where it is used as it is stored."""
        specs = dict(self.specs).get(path)
        if specs is None or self.mesh is None:
            return None
        storage, compute, gradient = (PartitionSpec(*tuple(spec)[1:]) for spec in specs)
        if compute == storage and gradient == storage:
            return None
        return NamedSharding(self.mesh, compute), NamedSharding(self.mesh, gradient)


class LayerSetting(nnx.Variable):
    """A constant of each layer that may differ from layer to layer (a sliding window): never
    trained, kept in the model's state beside its weights, so that inside a ``LayerStack`` it is
    stacked, scanned over and cut into pipeline stages with them."""


class LayerStack(nnx.Module):
    """``count`` layers made by ``make_layer(rngs)``, applied in order: ``stack(x, *riders)``.

    Each layer is called as ``layer(x, *riders)`` and returns the next ``x`` (same shape and
    dtype). ``riders`` are per-row inputs every layer sees unchanged, each with the batch as
    its leading dimension (positions, segment ids), or None.

    Args:
      scan: stack the parameters (a leading ``layers`` dimension, one compiled layer whatever
        the depth) and apply them with ``nnx.scan``; False keeps one module per layer in a
        Python loop (no pipeline then: there is no stack to cut).
      remat: what the backward pass recomputes: a key of ``REMAT_POLICIES``.

    A stacked parameter that carries no logical names gets ``("layers", None, ...)``, so that
    strategies know its leading dimension is the layers (tensor parallelism still reads the
    rest off the model's program).
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, *, rngs: nnx.Rngs,
                 scan: bool = True, remat: str = "none") -> None:
        if remat not in REMAT_POLICIES:
            raise UsageError(f"remat={remat!r}; use one of {', '.join(REMAT_POLICIES)}")
        if count < 1:
            raise UsageError(f"LayerStack of {count} layers; give at least 1")
        self.count, self.scan, self.remat = count, scan, remat
        self.plan = StackPlan()
        with metadata_only():
            if not scan:
                self.layers = nnx.List([make_layer(rngs) for _ in range(count)])
                return

            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def make_layers(rngs: nnx.Rngs) -> nnx.Module:
                return make_layer(rngs)

            self.layers = make_layers(rngs)
        for _, node in nnx.iter_graph(self.layers):
            if isinstance(node, nnx.Param) and logical_axes_of(node) is None and node[...].ndim:
                node.set_metadata(out_sharding=(LAYERS,) + (None,) * (node[...].ndim - 1))

    def __call__(self, x: jax.Array, *riders: Any) -> jax.Array:
        plan = self.plan
        if plan.sequence is not None:  # each device computes its share of the sequence
            plan.sequence.check_length(x.shape[1])
            x = plan.sequence.split_sequence(x)
        if plan.pipeline is None:
            return self._apply(self.layers, x, riders)
        graphdef, stacked = nnx.split(self.layers)
        # a circular schedule checkpoints each stage iteration with this policy itself
        inside_checkpoint = plan.pipeline.schedule.repeats > 1

        def apply_stage(chunk: Any, x: jax.Array, riders: Any) -> tuple[jax.Array, Any]:  # laid out already
            layers = nnx.merge(graphdef, chunk)
            x = self._apply(layers, x, riders, checkpointed=inside_checkpoint, lay_out=False)
            return x, nnx.to_pure_dict(nnx.state(layers, nnx.Intermediate))  # a router's statistics, say

        x, recorded = run_pipeline(apply_stage, stacked, x, riders, run=plan.pipeline,
                                   remat=REMAT_POLICIES[self.remat])
        if recorded:  # each layer's record: the mean over the microbatches, as one pass would make it
            intermediates = nnx.state(self.layers, nnx.Intermediate)
            nnx.replace_by_pure_dict(intermediates, recorded)
            nnx.update(self.layers, intermediates)
        return x

    def _apply(self, layers: Any, x: jax.Array, riders: Any, *, checkpointed: bool = False,
               lay_out: bool = True) -> jax.Array:
        """``x`` through ``layers``: a stack (scanned) or a list (a Python loop)."""
        lay_out = lay_out and self.scan and any(self.plan.one_layer(path) for path, _ in self.plan.specs)

        def apply_layer(x: jax.Array, layer: nnx.Module) -> jax.Array:
            if not lay_out:
                return layer(x, *riders)
            graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
            laid_out = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(
                self._for_compute, params, is_leaf=lambda node: isinstance(node, nnx.Variable)), rest)
            x = laid_out(x, *riders)
            nnx.update(layer, nnx.split(laid_out, nnx.Param, ...)[2])  # what it changed besides weights
            return x

        # Under remat, which with "none" saves everything but FSDP's gathered weights; a loop of
        # layers that neither recomputes nor gathers goes without it except on GPUs (remat_plain_loop).
        policy = REMAT_POLICIES[self.remat]
        mesh = self.plan.mesh
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        if not checkpointed and (policy is not None or self.scan or self.plan.gathers_weights
                                 or self.plan.sequence is not None or remat_plain_loop(platform)):
            apply_layer = nnx.remat(apply_layer, policy=remat_policy(policy))
        if self.scan:
            layer_axes: Any = 0
            counters = [block.cache_layer for _, block in blocks_of(layers, Attention)
                        if hasattr(block, "cache_layer")]
            if counters:  # decoding: the caches travel through the scan whole (see CacheLayer)
                for counter in counters:
                    counter[...] = jnp.zeros_like(counter[...])
                layer_axes = nnx.StateAxes({nnx.Cache: nnx.Carry, ...: 0})
            return nnx.scan(apply_layer, in_axes=(nnx.Carry, layer_axes), out_axes=nnx.Carry,
                            transform_metadata={nnx.PARTITION_NAME: LAYERS})(x, layers)
        for layer in layers:
            x = apply_layer(x, layer)
        return x


    def _for_compute(self, keypath: Any, variable: nnx.Variable) -> nnx.Variable:
        """One layer's weight laid out for compute (see ``StackPlan.one_layer``)."""
        shardings = self.plan.one_layer(path_to_str(keypath))
        if shardings is None:
            return variable
        return variable.replace(gather_for_compute(variable[...], *shardings))


def attention_kernel(implementation: str, dtype: Any, head_dim: int, platform: str | None = None, *,
                     masked: bool = False,
                     named: str = "attention implementation 'cudnn'") -> tuple[str, str]:
    """The kernel attention runs with (``"xla"`` or ``"cudnn"``) and why: the one rule, for the
    attention call and for a model's configuration alike (``named``: how the error names it).

    cuDNN's fused kernel needs a GPU, bfloat16 or float16 compute and a head dimension that is a
    multiple of 8 and at most 256, and shardax does not give it sliding windows or soft-capped
    scores (``masked``); ``auto`` takes it when all hold, ``cudnn`` where one does not is an error."""
    if implementation not in IMPLEMENTATIONS:
        raise UsageError(f"attention implementation {implementation!r}; use one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    platform = platform or jax.devices()[0].platform
    problems = []
    if platform != "gpu":
        problems.append(f"it needs a GPU (this is {platform})")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        problems.append(f"it needs bfloat16 compute (or float16; this is {jnp.dtype(dtype).name})")
    if head_dim % 8 or head_dim > 256:
        problems.append(f"it needs a head dimension that is a multiple of 8 and at most 256 (this is "
                        f"{head_dim})")
    if masked:
        problems.append("sliding windows and soft-capped scores run in XLA's attention")
    if implementation == "xla":
        return "xla", "asked for"
    if not problems:
        return "cudnn", "fused cuDNN kernel"
    if implementation == "cudnn":
        raise UsageError(f"{named}: {'; '.join(problems)}; use 'auto' or 'xla'")
    return "xla", "cuDNN does not apply: " + "; ".join(problems)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array | None = None,
              segments: jax.Array | None = None, implementation: str = "auto",
              sequence: ContextLayout | None = None, window: Any = None, scale: float | None = None,
              softcap: float | None = None) -> jax.Array:
    """Causal self-attention: ``q`` (B, T, N, H), ``k`` and ``v`` (B, T, K, H) with K dividing N
    (grouped-query attention) -> (B, T, N, H).

    ``segments`` (B, T): packed documents numbered from 1; a token sees only earlier tokens of
    its own document. ``positions`` (B, T): each token's place (default ``0..T-1``); with a
    ``sequence`` split over devices the mask is made from positions and segments, so any order
    of the tokens is correct (``shardax.runtime.context``). ``window``: a sliding window of that
    many tokens, the query's own included (an integer, traced or not; None or 0: none).
    ``scale``: of the scores (default ``H ** -0.5``); ``softcap``: Gemma 2's ``cap * tanh(s / cap)``
    on them."""
    masked = window is not None or softcap is not None
    kernel = attention_kernel(implementation, q.dtype, q.shape[-1], masked=masked)[0]
    if sequence is None:
        if window is None and softcap is None:
            mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
            scaled = {} if scale is None else {"scale": scale}
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=kernel,
                                                **scaled)
        positions = jnp.broadcast_to(jnp.arange(q.shape[1]) if positions is None else positions, q.shape[:2])
        tokens = jnp.zeros_like(positions) if segments is None else segments
        mask = allowed(positions, tokens, positions, tokens, 0 if window is None else window)[:, None]
        return dense_attention(q, k, v, mask, scale=scale, softcap=softcap, implementation=kernel)
    if k.shape[2] != q.shape[2]:  # the context runtime attends head by head
        k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    return context.attention(q, k, v, positions, segments, layout=sequence, implementation=kernel,
                             window=0 if window is None else window, scale=scale, softcap=softcap)


class Attention(nnx.Module):
    """``attention`` as a module, so that ``parallelize`` can tell it how sequences are split
    (its ``sequence``). It holds no parameters: the model keeps its own projections. ``scale``
    and ``softcap``: see ``attention``; a sliding window is given per call (it may differ
    from layer to layer of a stack).

    With a key/value cache (``init_cache``), each call writes its keys and values into the
    cache and its queries attend to what it holds: a prompt, then one token at a time (see
    ``shardax.runtime.kv_cache``)."""

    def __init__(self, *, implementation: str = "auto", scale: float | None = None,
                 softcap: float | None = None) -> None:
        if implementation not in IMPLEMENTATIONS:
            raise UsageError(f"Attention(implementation={implementation!r}); use one of "
                             f"{', '.join(IMPLEMENTATIONS)}")
        self.implementation, self.scale, self.softcap = implementation, scale, softcap
        self.sequence: ContextLayout | None = None

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array | None = None,
                 segments: jax.Array | None = None, window: Any = None) -> jax.Array:
        if hasattr(self, "cached_keys") or hasattr(self, "ring_keys"):  # set by init_cache
            return kv_cache.attend(self, q, k, v, positions, window)
        return attention(q, k, v, positions=positions, segments=segments, implementation=self.implementation,
                         sequence=self.sequence, window=window, scale=self.scale, softcap=self.softcap)


def init_cache(model: Any, batch: int, length: int, kv_heads: int, head_dim: int, dtype: Any,
               sharding: Callable[[tuple[int, ...]], Any] | None = None, *,
               windows: Sequence[int] | None = None, ring: int | None = None) -> None:
    """Give every ``Attention`` of ``model`` (in place) an empty key/value cache of ``length``
    positions for ``batch`` rows: ``(batch, kv_heads, length, head_dim)``, with a leading
    layers dimension inside a scanned ``LayerStack`` (and a ``CacheLayer`` count there).
    ``windows`` (each layer's sliding window, 0 for none, for a stack of as many layers) and
    ``ring``: the windowed layers keep at most ``ring`` positions (see
    ``shardax.runtime.kv_cache``). ``sharding(shape)``: where each cache array is made
    (straight into its shards; default: JAX's default device)."""

    def make(shape: tuple[int, ...], kind: Any) -> jax.Array:
        return jnp.zeros(shape, kind, device=None if sharding is None else sharding(shape))

    shape, done = (batch, length, kv_heads, head_dim), set()
    for _, stack in blocks_of(model, LayerStack):
        per_layer = windows if windows is not None and len(windows) == stack.count else None
        layers = [(stack.count, per_layer, stack.layers)] if stack.scan else [
            (0, None if per_layer is None else per_layer[i:i + 1], layer)
            for i, layer in enumerate(stack.layers)]
        for count, layer_windows, layer in layers:
            for _, block in blocks_of(layer, Attention):
                kv_cache.allocate(block, make, shape, dtype, layers=count, windows=layer_windows, ring=ring)
                done.add(id(block))
    for _, block in blocks_of(model, Attention):
        if id(block) not in done:
            kv_cache.allocate(block, make, shape, dtype)


def blocks_of(model: Any, kind: type) -> list[tuple[str, Any]]:
    """``[(path, block)]`` of every ``kind`` (``LayerStack`` or ``Attention``) in ``model``."""
    return [("/".join(str(part) for part in path), node) for path, node in nnx.iter_graph(model)
            if isinstance(node, kind)]


def split_sequences(model: Any, layout: ContextLayout | None) -> None:
    """Tell ``model``'s blocks (in place) that sequences are split over devices by ``layout``
    (None: not split). ``parallelize`` does this on the copy its step traces; call it yourself
    to run a model's forward pass with a split sequence outside a step."""
    for _, block in blocks_of(model, Attention):
        block.sequence = layout
    for _, stack in blocks_of(model, LayerStack):
        stack.plan = dataclasses.replace(stack.plan, sequence=layout)


def sequence_split(model: Any) -> ContextLayout | None:
    """How the step ``model`` runs in splits sequences over devices (None: it does not); a loss
    that reorders tokens for balance (the LM's zig-zag order) reads it here."""
    return next((block.sequence for _, block in blocks_of(model, Attention) if block.sequence is not None),
                None)
