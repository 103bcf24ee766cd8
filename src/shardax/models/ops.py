"""The numerics of shardax's transformer: layer norm, RMSNorm, GELU and SwiGLU with backward
passes of their own (they keep less for the backward pass than autodiff would: benchmarks 13 and
22 in docs/benchmarks.md), and rotary position embeddings with Llama 3's scaling."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardax.layers import annotated_param
from shardax.sharding.compute import for_compute


def _normalized(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``((x - mean) / std, 1 / std)`` over the last axis."""
    centered = x - x.mean(-1, keepdims=True)
    inverse_std = jax.lax.rsqrt((centered * centered).mean(-1, keepdims=True) + 1e-5)
    return centered * inverse_std, inverse_std


@jax.custom_vjp
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """Layer normalisation over the last axis (float32 in and out) whose backward pass keeps
    only its input and recomputes the statistics.

    Autodiff of the plain formula saves the centred input, both statistics and more for the
    backward pass. What is saved is chosen by JAX when it differentiates, before any backend
    compiles the program, so the saving holds on every platform: the step's compiled peak is
    lower with these than with plain layer norm and GELU on XLA:CPU, on a GPU and on XLA:TPU
    (benchmarks 13 and 22 in docs/benchmarks.md).
    """
    return _normalized(x)[0] * scale + bias


def _layer_norm_forward(x: jax.Array, scale: jax.Array, bias: jax.Array) -> tuple[jax.Array, Any]:
    return layer_norm(x, scale, bias), (x, scale)


def _layer_norm_backward(saved: Any, cotangent: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, scale = saved
    normalized, inverse_std = _normalized(x)
    scaled = cotangent * scale
    grad_x = inverse_std * (scaled - scaled.mean(-1, keepdims=True)
                            - normalized * (scaled * normalized).mean(-1, keepdims=True))
    rows = tuple(range(cotangent.ndim - 1))
    return grad_x, (cotangent * normalized).sum(rows), cotangent.sum(rows)


layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


class LayerNorm(nnx.Module):
    def __init__(self, features: int):
        key = jax.random.key(0)  # ones/zeros ignore it
        self.scale = annotated_param(nnx.initializers.ones, key, (features,), ("embed",))
        self.bias = annotated_param(nnx.initializers.zeros, key, (features,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = layer_norm(x.astype(jnp.float32), for_compute(self.scale, jnp.float32),
                            for_compute(self.bias, jnp.float32))
        return normed.astype(x.dtype)


def _rms_normalized(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """``(x / rms(x), 1 / rms(x))`` over the last axis."""
    inverse_rms = jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * inverse_rms, inverse_rms


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS normalisation over the last axis whose backward pass keeps only its input (as
    ``layer_norm``): with SwiGLU's, the default run's step is faster than with autodiff's on
    XLA:CPU (benchmark 20 in docs/benchmarks.md)."""
    return _rms_normalized(x, eps)[0] * scale


def _rms_norm_forward(x: jax.Array, scale: jax.Array, eps: float) -> tuple[jax.Array, Any]:
    return rms_norm(x, scale, eps), (x, scale)


def _rms_norm_backward(eps: float, saved: Any, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, scale = saved
    normalized, inverse_rms = _rms_normalized(x, eps)
    scaled = cotangent * scale
    grad_x = inverse_rms * (scaled - normalized * (scaled * normalized).mean(-1, keepdims=True))
    return grad_x, (cotangent * normalized).sum(tuple(range(cotangent.ndim - 1)))


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, in float32 (the Llama family's norm); with
    ``plus_one``, x / rms(x) * (1 + scale), the scale starting at zero (Gemma's)."""

    def __init__(self, features: int, eps: float, axis: str = "embed", plus_one: bool = False):
        self.eps, self.plus_one = eps, plus_one
        start = nnx.initializers.zeros if plus_one else nnx.initializers.ones
        self.scale = annotated_param(start, jax.random.key(0), (features,), (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = for_compute(self.scale, jnp.float32)
        scale = 1.0 + scale if self.plus_one else scale
        return rms_norm(x.astype(jnp.float32), scale, self.eps).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float = 10000.0,
                     scaling: tuple[float, float, float, int] | None = None) -> np.ndarray:
    """RoPE's angle per position for each pair of channels (``head_dim // 2`` of them), with
    Llama 3's scaling when given: wavelengths longer than the original context divided by
    ``factor``, shorter than it / ``high_freq_factor`` kept, and those between blended."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) / half)
    if scaling is None:
        return inv_freq.astype(np.float32)
    factor, low, high, context = scaling
    wavelength = 2 * np.pi / inv_freq
    blend = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)  # 0: long waves, 1: short
    return ((1 - blend) * inv_freq / factor + blend * inv_freq).astype(np.float32)


def rotary(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | None = None) -> jax.Array:
    """Rotate pairs of channels by position-dependent angles (RoPE). x: (B, T, N, H); positions:
    (T,) or (B, T); ``inv_freq``: ``rope_frequencies`` (default: base 10000, unscaled)."""
    half = x.shape[-1] // 2
    inv_freq = jnp.asarray(rope_frequencies(x.shape[-1]) if inv_freq is None else inv_freq)
    angles = jnp.atleast_2d(positions)[..., None].astype(jnp.float32) * inv_freq  # (B or 1, T, H/2)
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], -1).astype(x.dtype)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """GELU (tanh form) whose backward pass keeps only its input.

    Autodiff of ``jax.nn.gelu`` saves several intermediates per element (the MLP's widest
    activation) for the backward pass; this keeps one and recomputes the rest, on every
    platform (see ``layer_norm``).
    """
    return jax.nn.gelu(x)


def _gelu_forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.nn.gelu(x), x


def _gelu_backward(x: jax.Array, cotangent: jax.Array) -> tuple[jax.Array]:
    return jax.vjp(jax.nn.gelu, x)[1](cotangent)


gelu.defvjp(_gelu_forward, _gelu_backward)


def _gated(activation: Any, name: str, doc: str) -> Any:
    """``activation(gate) * up`` whose backward pass keeps only its two inputs (autodiff keeps
    the activation and the product too, each as wide as the MLP's hidden layer)."""
    def plain(gate: jax.Array, up: jax.Array) -> jax.Array:
        return activation(gate) * up

    @jax.custom_vjp
    def glu(gate: jax.Array, up: jax.Array) -> jax.Array:
        return plain(gate, up)

    def backward(saved: tuple[jax.Array, jax.Array], cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.vjp(plain, *saved)[1](cotangent)

    glu.defvjp(lambda gate, up: (plain(gate, up), (gate, up)), backward)
    glu.__name__, glu.__doc__ = name, doc
    return glu


swiglu = _gated(jax.nn.silu, "swiglu",
                "SwiGLU's ``silu(gate) * up`` (the Llama family's MLP), keeping only its two inputs for the "
                "backward pass.")
geglu = _gated(functools.partial(jax.nn.gelu, approximate=True), "geglu",
               "GeGLU's ``gelu(gate) * up`` (tanh GELU, Gemma's MLP), keeping only its two inputs for the "
               "backward pass.")



# the weights' gradient of a grouped matmul: each group's rows of x against the same rows of dy
_GROUP_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _batch_in_groups(x: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Batched rows ``x`` (b, m, ...) and ``group_sizes`` (b, g) as one batch of b * (g + 1)
    groups: each batch's rows past its groups (a group of its own, dropped later) keep the next
    batch's rows in that batch's groups."""
    b, m = x.shape[:2]
    rest = m - group_sizes.sum(axis=1, keepdims=True)
    return x.reshape(b * m, *x.shape[2:]), jnp.concatenate([group_sizes, rest], axis=1).reshape(-1)


def _all_batched(size: int, batched: list[bool], *arrays: jax.Array) -> list[jax.Array]:
    """``arrays`` each with the batch of ``size`` leading (those not batched broadcast to it)."""
    return [a if is_batched else jnp.broadcast_to(a, (size, *a.shape))
            for a, is_batched in zip(arrays, batched)]


@jax.custom_batching.custom_vmap
def _rows_by_group(x: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, weights, group_sizes)


@_rows_by_group.def_vmap
def _rows_by_group_batched(size: int, batched: list[bool], x: jax.Array, weights: jax.Array,
                           group_sizes: jax.Array) -> tuple[jax.Array, bool]:
    x, weights, group_sizes = _all_batched(size, batched, x, weights, group_sizes)
    rows, sizes = _batch_in_groups(x, group_sizes)
    weights = jnp.concatenate([weights, jnp.zeros_like(weights[:, :1])], axis=1)
    out = _rows_by_group(rows, weights.reshape(-1, *weights.shape[2:]), sizes)
    return out.reshape(size, -1, out.shape[-1]), True


@jax.custom_batching.custom_vmap
def _group_products(x: jax.Array, y: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot_general(x, y, group_sizes, _GROUP_WEIGHT_GRADIENT)


@_group_products.def_vmap
def _group_products_batched(size: int, batched: list[bool], x: jax.Array, y: jax.Array,
                            group_sizes: jax.Array) -> tuple[jax.Array, bool]:
    x, y, group_sizes = _all_batched(size, batched, x, y, group_sizes)
    rows, sizes = _batch_in_groups(x, group_sizes)
    out = _group_products(rows, y.reshape(-1, y.shape[-1]), sizes)  # (b * (g + 1), k, n)
    return out.reshape(size, -1, *out.shape[1:])[:, :-1], True


def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x, weights, group_sizes)``: rows (m, k) sorted into groups of
    ``group_sizes`` (g,), group e's rows times ``weights[e]`` (g, k, n). Under ``vmap`` (a
    pipeline runs its stages so) the batch joins the groups, one extra group per batch for the
    rows past its groups, rather than JAX's batched ragged product (which fails on CPU), and the
    gradient is written with two grouped products that batch the same way. Inside ``shard_map``
    the weights are first marked as varying over the axes the rows vary over (so the weights'
    gradient is summed over those axes, as JAX's own rule does)."""
    if _varying(x) - _varying(weights):
        weights = jax.lax.pcast(weights, tuple(sorted(_varying(x) - _varying(weights))), to="varying")
    if _varying(weights) - _varying(x):
        x = jax.lax.pcast(x, tuple(sorted(_varying(weights) - _varying(x))), to="varying")
    return _grouped_matmul(x, weights, group_sizes)


def _varying(value: jax.Array) -> frozenset[str]:
    """The ``shard_map`` axes ``value`` varies over (none outside one)."""
    aval = jax.typeof(value)
    if hasattr(aval, "vma"):  # JAX's name for them in most releases
        return frozenset(aval.vma)
    return frozenset(getattr(getattr(aval, "mat", None), "varying", ()) or ())


@jax.custom_vjp
def _grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return _rows_by_group(x, weights, group_sizes)


def _grouped_matmul_forward(x: jax.Array, weights: jax.Array,
                            group_sizes: jax.Array) -> tuple[jax.Array, Any]:
    return _rows_by_group(x, weights, group_sizes), (x, weights, group_sizes)


def _grouped_matmul_backward(saved: Any, cotangent: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    x, weights, group_sizes = saved
    dx = _rows_by_group(cotangent, jnp.swapaxes(weights, -1, -2), group_sizes)
    dw = _group_products(x, cotangent, group_sizes)
    return dx.astype(x.dtype), dw.astype(weights.dtype), None


_grouped_matmul.defvjp(_grouped_matmul_forward, _grouped_matmul_backward)
