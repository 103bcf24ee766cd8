"""Generation with a key/value cache, sharded like the model, from any model that implements
``shardax.decoding.CachedDecoder`` (shardax's ``TransformerLM`` does).

    tokens = shardax.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)            # greedy
    tokens = shardax.generate(model, prompts, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=1)

The prompts are run through the model once (prefill), their keys and values written into a
cache of every layer; then each new token is one call of a compiled decode step that attends
to the cache through ``shardax.blocks.Attention``. Prompts of different lengths share a batch:
each row has its own positions, and what follows a row's prompt is never attended before it is
written. Shapes come in buckets (prompt length to a multiple of 16), so a new prompt compiles
nothing when its bucket has been seen. The cache grows as it fills, doubling from 16 positions
(16, 32, 64, ...: one compiled step per length), so each step attends over at most twice the
tokens so far, not the longest length asked for: a token's cost does not depend on how many
more are to come. A windowed layer keeps a ring of its window (and at least the prompt): its
cache stops growing there, however long the text, while the full layers' grow beside it (Gemma
2 and 3 alternate the two). Inside a scanned stack of layers the cache travels through the scan
whole and each layer writes its one new token in place (``shardax.runtime.kv_cache``).

On a mesh (the model's parameters placed by ``parallelize``) the cache is split like the
attention it serves: rows over the data axes, key/value heads over ``model`` where they divide.
The model runs its plain forward pass (a pipeline's stages or a context axis only hold rows).
Draws are made row by row from ``seed``, the step and the row's index, so the same prompts give
the same tokens on every mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.decoding import CachedDecoder, DecodeSpec, decode_spec_of
from shardax.errors import UsageError
from shardax.vocabulary import MODEL

PROMPT_BUCKET = 16  # prompts are padded to a multiple of this; the cache grows from it by doubling
CACHE_DTYPES = ("float32", "bfloat16", "float16")  # what the keys and values may be held as


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _mesh_of(model: nnx.Module) -> Mesh | None:
    """The mesh the model's parameters are placed on, with every axis Auto (the decoder lays out
    its own arrays and lets the compiler propagate; None: not placed on a mesh)."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
            return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return None


def cache_dtype_name(spec: DecodeSpec, cache_dtype: Any) -> str:
    """The name of the dtype the cache holds keys and values in: ``cache_dtype``, or the model's
    compute dtype (``spec.dtype``) where it is None; refused unless a float the cache may hold."""
    try:
        name = jnp.dtype(spec.dtype if cache_dtype is None else cache_dtype).name
    except TypeError:
        name = None
    if name not in CACHE_DTYPES:
        raise UsageError(f"cache_dtype={cache_dtype!r} is not a dtype the key/value cache holds; use one of "
                         f"{', '.join(CACHE_DTYPES)} (None: the model's compute dtype, "
                         f"{jnp.dtype(spec.dtype).name})")
    return name


def check_request(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, cache_dtype: Any = None) -> None:
    """What ``generate`` refuses, refused before anything is computed (or printed)."""
    spec = decode_spec_of(model)
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise UsageError("generate() needs at least one prompt, each of at least one token")
    vocab = spec.vocab_size
    for row, prompt in enumerate(prompts):
        wrong = [int(t) for t in prompt if not 0 <= int(t) < vocab]
        if wrong:
            raise UsageError(f"prompt {row} holds token id {wrong[0]}, outside the model's vocabulary of "
                             f"{vocab}; tokenize with the model's own tokenizer")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UsageError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                         f"{temperature}, {top_k} and {top_p} (temperature 0 is greedy, top_k 0 and top_p 1 "
                         "keep every token)")
    cache_dtype_name(spec, cache_dtype)
    longest = max(len(prompt) for prompt in prompts)
    if longest + max_new_tokens > spec.seq_len:
        raise UsageError(f"a prompt of {longest} tokens and {max_new_tokens} new ones need "
                         f"{longest + max_new_tokens} positions, more than the model's "
                         f"{spec.seq_len}; shorten the prompt or ask for fewer new tokens")


def _draw(logits: jax.Array, key: jax.Array, rows: jax.Array, temperature: float, top_k: int,
          top_p: float) -> jax.Array:
    """One token per row of ``logits`` (B, V): greedy at temperature 0, else drawn from the
    tempered distribution cut to the ``top_k`` likeliest and to the smallest set holding
    ``top_p`` of the probability, with a key of the row's own."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        # the smallest logit still inside the nucleus: the first whose cumulative mass reaches top_p
        cut = jnp.take_along_axis(ordered, jnp.argmax(cumulative >= top_p, axis=-1)[:, None], axis=-1)
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(rows)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The cache ``generate`` makes: ``batch`` rows (the prompts, padded to a multiple of the
    data axes' size) of ``lengths[0]`` positions, grown to each of ``lengths`` in turn as the
    tokens fill it (``length``: the last), prompts run ``prompt_length`` at a time; each
    layer's keys and values ``(batch, kv_heads, length, head_dim)`` split by ``spec`` on ``mesh``.
    ``ring``: where windowed layers sit beside full ones, the windowed layers' cache stops
    growing at this many positions (a ring of the window); None: every layer grows alike.
    ``dtype``: the keys' and values' (None: the model's compute dtype)."""

    mesh: Mesh | None
    batch: int
    lengths: tuple[int, ...]
    prompt_length: int
    spec: tuple[Any, ...]
    ring: int | None = None
    dtype: str | None = None

    @property
    def length(self) -> int:
        return self.lengths[-1]

    def length_for(self, tokens: int) -> int:
        """The cache's length once ``tokens`` positions have been written (a ring past the last)."""
        return next((length for length in self.lengths if length >= tokens), self.length)

    def bytes_per_device(self, config: Any, length: int | None = None) -> int:
        """Bytes of the keys and values of every layer on one device, at ``length`` positions
        (default: the last); ``config``: the model's ``DecodeSpec`` (or a ``TransformerConfig``)."""
        length = self.length if length is None else length
        held = sum(min(length, self.ring) if self.ring and window else length
                   for window in config.layer_windows)
        size = jnp.dtype(self.dtype or config.dtype).itemsize
        whole = 2 * held * self.batch * config.kv_heads * config.head_dim * size
        axes = [axis for entry in self.spec if entry
                for axis in ((entry,) if isinstance(entry, str) else entry)]
        split = 1 if self.mesh is None else math.prod(self.mesh.shape[axis] for axis in axes)
        return whole // split


def cache_layout(model: CachedDecoder, rows: int, longest: int, max_new_tokens: int,
                 cache_dtype: Any = None) -> CacheLayout:
    """How ``generate`` lays out the cache for ``rows`` prompts of at most ``longest`` tokens: rows
    over the mesh's data axes, key/value heads over ``model`` where they divide, held as
    ``cache_dtype`` (None: the model's compute dtype)."""
    spec, mesh = decode_spec_of(model), _mesh_of(model)
    data_axes: tuple[str, ...] = ()
    heads_axis = None
    if mesh is not None:  # rows over every axis but model (a pipeline's stages and a context axis too)
        data_axes = tuple(axis for axis in mesh.axis_names if axis != MODEL and mesh.shape[axis] > 1)
        if mesh.shape.get(MODEL, 1) > 1 and spec.kv_heads % mesh.shape[MODEL] == 0:
            heads_axis = MODEL
    batch = _round_up(rows, math.prod(mesh.shape[axis] for axis in data_axes) if mesh is not None else 1)
    last = min(_round_up(longest + max_new_tokens, PROMPT_BUCKET), spec.seq_len)
    prompt_length = min(_round_up(longest, PROMPT_BUCKET), last)
    windows, ring = set(spec.layer_windows), None
    if windows - {0}:  # a windowed layer needs its window (and the prompt, written at once): a ring of that
        ring = max(_round_up(max(windows), PROMPT_BUCKET), prompt_length)
    if 0 not in windows:  # every layer windowed alike: the whole cache is the ring (Attention)
        last, ring = min(last, ring), None
    lengths = [PROMPT_BUCKET]
    while lengths[-1] < last:
        lengths.append(lengths[-1] * 2)
    lengths = [length for length in lengths if length >= prompt_length]
    return CacheLayout(mesh, batch, tuple(min(length, last) for length in lengths), prompt_length,
                       (data_axes or None, heads_axis, None, None), ring if ring and ring < last else None,
                       cache_dtype_name(spec, cache_dtype))


_STEPS: dict[Any, Any] = {}


def _step(graphdef: nnx.GraphDef, mesh: Mesh | None, cache_shardings: Any, temperature: float, top_k: int,
          top_p: float, vocab: int | None) -> Callable[..., tuple[jax.Array, Any]]:
    """The jitted prefill/decode step ``(weights, cache, tokens, positions, last, key) -> (the next
    token of each row, the cache)``, one per model structure, layout and sampling (each shape
    bucket then compiles once)."""
    key = (graphdef, mesh, None if cache_shardings is None else tuple(jax.tree.leaves(cache_shardings)),
           temperature, top_k, top_p, vocab)
    if key not in _STEPS:
        def step(weights: Any, cache: Any, tokens: jax.Array, positions: jax.Array, last: jax.Array,
                 key: jax.Array) -> tuple[jax.Array, Any]:
            module = nnx.merge(graphdef, cache, weights)
            logits = module(tokens, positions=positions)  # (B, T, vocab)
            logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :vocab]
            chosen = _draw(logits, key, jnp.arange(logits.shape[0]), temperature, top_k, top_p)
            return chosen, nnx.state(module, nnx.Cache)

        if mesh is None:
            _STEPS[key] = jax.jit(step, donate_argnums=(1,))
        else:
            _STEPS[key] = jax.jit(step, donate_argnums=(1,),
                                  out_shardings=(NamedSharding(mesh, PartitionSpec()), cache_shardings))
    return _STEPS[key]


def _decoder(model: CachedDecoder, layout: CacheLayout) -> tuple[nnx.GraphDef, Any, Any]:
    """``(graphdef, cache, weights)`` of a copy of ``model`` in eval mode with an empty cache laid
    out as ``layout`` says (``model`` itself is not changed)."""
    mesh = layout.mesh
    graphdef, state = nnx.split(model)
    work = nnx.merge(graphdef, state)  # a copy of the structure over the same arrays
    work.eval()
    placed = None if mesh is None else (
        lambda shape: NamedSharding(mesh, PartitionSpec(*(None,) * (len(shape) - 4), *layout.spec)
                                    if len(shape) >= 4 else PartitionSpec()))
    work.init_cache(layout.batch, layout.lengths[0], layout.dtype, placed, ring=layout.ring)
    graphdef, cache, weights = nnx.split(work, nnx.Cache, ...)
    del work
    if mesh is not None:  # the same layout on the mesh's Auto twin (no copy where it already is)
        weights = jax.tree.map(lambda leaf: jax.device_put(leaf, NamedSharding(mesh, leaf.sharding.spec))
                               if isinstance(getattr(leaf, "sharding", None), NamedSharding) else leaf,
                               weights)
    return graphdef, cache, weights


@functools.partial(jax.jit, static_argnums=(1, 2))
def _grown(cache: Any, length: int, ring: int | None) -> Any:
    """``cache`` with its keys and values padded to ``length`` positions (axis -2 of each), a
    windowed layers' ring to at most ``ring``."""
    def pad(path: Any, leaf: jax.Array) -> jax.Array:
        if leaf.ndim < 4:
            return leaf
        wanted = min(length, ring) if ring and "ring_" in jax.tree_util.keystr(path) else length
        return jnp.pad(leaf, [(0, 0)] * (leaf.ndim - 2) + [(0, wanted - leaf.shape[-2]), (0, 0)])

    return jax.tree_util.tree_map_with_path(pad, cache)


def _with_room(cache: Any, layout: CacheLayout, tokens: int) -> Any:
    """``cache``, grown to the next of the layout's lengths when ``tokens`` positions would not fit."""
    now = max(leaf.shape[-2] for leaf in jax.tree.leaves(cache) if leaf.ndim >= 4)
    wanted = layout.length_for(tokens)
    return cache if wanted <= now else _grown(cache, wanted, layout.ring)


def cache_bytes_per_device(cache: Any) -> int:
    """Bytes of a cache's keys and values on its first device (what each device holds)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(cache) if leaf.ndim >= 4)


def _placer(layout: CacheLayout) -> Callable[[np.ndarray], jax.Array]:
    """How the step's per-row inputs go to the devices: rows over the data axes, as the cache's."""
    mesh = layout.mesh
    if mesh is None:
        return jnp.asarray

    def place(array: np.ndarray) -> jax.Array:  # rows over the data axes
        rows = PartitionSpec(layout.spec[0], *(None,) * (array.ndim - 1))
        return jax.device_put(array, NamedSharding(mesh, rows))

    return place


def _prompt_batch(prompts: Sequence[Sequence[int]], layout: CacheLayout) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as one batch ``(batch, prompt_length)``, padded with zeros, and each row's length."""
    tokens = np.zeros((layout.batch, layout.prompt_length), np.int32)
    lengths = np.ones(layout.batch, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
        lengths[row] = len(prompt)
    return tokens, lengths


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """How fast one ``generate`` call ran, on the host's clock.

    ``time_to_first_token_s``: from the call to every row's first new token (the prompts' prefill,
    and its compilation when the shapes are new). ``decode_step_s``: the median time of a decode
    step, each of which adds one token to every row (a new shape's first step compiles; the
    median leaves it out); ``tokens_per_s`` is the rows over it. ``cache_bytes_per_device``:
    the key/value cache's bytes on each device when the last token came."""

    rows: int
    prompt_tokens: int
    new_tokens: int
    time_to_first_token_s: float
    decode_steps: int
    decode_step_s: float | None
    total_s: float
    cache_bytes_per_device: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        return self.rows / self.decode_step_s if self.decode_step_s else None

    def describe(self) -> str:
        """One line: ``12 new tokens for 2 prompts (19 tokens) in 0.52 s: first token after 0.41 s,
        then 45.3 tokens/s``."""
        rate = f", then {self.tokens_per_s:.1f} tokens/s" if self.tokens_per_s else ""
        return (f"{self.new_tokens} new tokens for {self.rows} prompt{'s' if self.rows != 1 else ''} "
                f"({self.prompt_tokens} tokens) in {self.total_s:.2f} s: first token after "
                f"{self.time_to_first_token_s:.2f} s{rate}")


class Generated(list):
    """``generate``'s new tokens, one list per prompt, and ``stats``: how fast they came."""

    stats: GenerationStats


def _stop_sequences(stop: int | Sequence[int | Sequence[int]] | None) -> list[tuple[int, ...]]:
    """``generate``'s ``stop`` as sequences of token ids (a lone id is a sequence of one)."""
    if stop is None:
        return []
    if isinstance(stop, (int, np.integer)):
        return [(int(stop),)]
    return [(int(s),) if isinstance(s, (int, np.integer)) else tuple(map(int, s)) for s in stop if
            isinstance(s, (int, np.integer)) or len(s)]


def generate(model: CachedDecoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop: int | Sequence[int | Sequence[int]] | None = None, vocab: int | None = None,
             on_token: Callable[[int, list[int]], None] | None = None, cache_dtype: Any = None) -> Generated:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens; returns the
    new tokens of each, ending at (and including) a ``stop`` (a token id, or ids in a row: a chat
    template's end of turn) where one comes, with ``.stats`` (time to the first token, tokens/s).

    ``temperature`` 0 is greedy; otherwise tokens are drawn (``top_k``, ``top_p`` cut the
    distribution) from ``seed``. ``on_token(step, tokens)`` is called after each step with
    every row's new token (for printing as they come). ``vocab``: draw only ids below it (a
    tokenizer smaller than the model's embedding). ``cache_dtype``: what the key/value cache holds
    keys and values as (default: the model's compute dtype; ``"bfloat16"`` under a float32 model
    halves the cache, its products still float32). The model is not changed."""
    started = time.perf_counter()
    check_request(model, prompts, max_new_tokens, temperature, top_k, top_p, cache_dtype)
    rows = len(prompts)
    layout = cache_layout(model, rows, max(len(prompt) for prompt in prompts), max_new_tokens, cache_dtype)
    graphdef, cache, weights = _decoder(model, layout)
    cache_shardings = None if layout.mesh is None else jax.tree.map(lambda leaf: leaf.sharding, cache)
    place = _placer(layout)
    compiled = _step(graphdef, layout.mesh, cache_shardings, temperature, top_k, top_p, vocab)
    batch = layout.batch
    tokens, lengths = _prompt_batch(prompts, layout)
    positions = np.broadcast_to(np.arange(layout.prompt_length, dtype=np.int32), tokens.shape)
    stops = _stop_sequences(stop)
    base = jax.random.key(seed)
    chosen, cache = compiled(weights, cache, place(tokens), place(positions), place(lengths - 1),
                             jax.random.fold_in(base, 0))
    out = Generated([] for _ in range(rows))
    done = np.zeros(rows, bool)
    times = []  # when each step's tokens reached the host
    for i in range(max_new_tokens):
        new = np.asarray(jax.device_get(chosen)).reshape(-1)[:rows]
        times.append(time.perf_counter())
        for row in np.flatnonzero(~done):
            out[row].append(int(new[row]))
            done[row] = any(tuple(out[row][-len(ids):]) == ids for ids in stops)
        if on_token is not None:
            on_token(i, [int(t) for t in new])
        if done.all() or i == max_new_tokens - 1:
            break
        at = (lengths + i)[:, None]
        cache = _with_room(cache, layout, int(at.max()) + 1)
        chosen, cache = compiled(weights, cache, place(np.asarray(jax.device_get(chosen)).reshape(batch, 1)),
                                 place(at.astype(np.int32)), place(np.zeros(batch, np.int32)),
                                 jax.random.fold_in(base, i + 1))
    steps = np.diff(times)
    out.stats = GenerationStats(rows, sum(map(len, prompts)), sum(map(len, out)), times[0] - started,
                                len(steps), float(np.median(steps)) if len(steps) else None,
                                time.perf_counter() - started, cache_bytes_per_device(cache))
    return out
