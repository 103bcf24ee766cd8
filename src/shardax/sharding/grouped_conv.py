"""Grouped and depthwise convolutions whose kernel gradient XLA's partitioner gets right.

``jax.lax.conv_general_dilated`` with ``feature_group_count > 1`` (depthwise convolutions, as in
ConvNeXt and MobileNet) differentiates to a convolution with ``batch_group_count`` for its
kernel. XLA's SPMD partitioner (jaxlib 0.10) gets that one wrong when the batch is split over
some mesh axes and repeated over others, as it is under tensor parallelism: it sums the repeated
copies too, so the kernel gradient comes out multiplied by the size of the repeating axes (2x on
``data=4,model=2``; plain ``jax.jit`` does the same). The loss is unaffected, and AdamW, scale
invariant, hides the error.

``grouped_conv`` is a drop-in ``conv_general_dilated`` whose backward pass computes the kernel
gradient as a convolution with ``feature_group_count`` instead (the kernel's in-group channels
as its batch, each group's rows as its features, the output gradient as its window), which the
partitioner splits correctly. ``route_grouped_convs`` gives every ``nnx.Conv`` with groups this
function; ``parallelize`` does so under the strategies that repeat the batch over a tensor axis.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

SCOPE = "shardax_grouped_conv"  # the name scope its convolutions carry in a traced program


@dataclasses.dataclass(frozen=True)
class _Conv:
    """A grouped convolution's settings, in canonical dimension numbers and explicit padding."""

    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    dimension_numbers: Any  # jax.lax.ConvDimensionNumbers
    groups: int
    precision: Any
    preferred_element_type: Any
    out_sharding: Any

    def __call__(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        placed = {} if self.out_sharding is None else {"out_sharding": self.out_sharding}
        return jax.lax.conv_general_dilated(
            lhs, rhs, self.strides, self.padding, self.lhs_dilation, self.rhs_dilation,
            self.dimension_numbers, feature_group_count=self.groups, precision=self.precision,
            preferred_element_type=self.preferred_element_type, **placed)


def grouped_conv(lhs: jax.Array, rhs: jax.Array, window_strides: Any, padding: Any, lhs_dilation: Any = None,
                 rhs_dilation: Any = None, dimension_numbers: Any = None, feature_group_count: int = 1,
                 batch_group_count: int = 1, precision: Any = None, preferred_element_type: Any = None,
                 out_sharding: Any = None) -> jax.Array:
    """``jax.lax.conv_general_dilated``, the same arguments and result; with groups, a kernel
    gradient that is right under any sharding of the batch."""
    if feature_group_count == 1 or batch_group_count != 1:
        placed = {} if out_sharding is None else {"out_sharding": out_sharding}
        return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                            dimension_numbers, feature_group_count, batch_group_count,
                                            precision, preferred_element_type, **placed)
    spatial = lhs.ndim - 2
    numbers = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    lhs_dilation = tuple(lhs_dilation or (1,) * spatial)
    rhs_dilation = tuple(rhs_dilation or (1,) * spatial)
    if isinstance(padding, str):  # as conv_general_dilated resolves it (no lhs dilation with a string)
        window = [(k - 1) * d + 1 for k, d in zip(np.take(rhs.shape, numbers.rhs_spec)[2:], rhs_dilation)]
        padding = jax.lax.padtype_to_pads(np.take(lhs.shape, numbers.lhs_spec)[2:], window, window_strides,
                                          padding)
    conv = _Conv(tuple(window_strides), tuple((int(lo), int(hi)) for lo, hi in padding), lhs_dilation,
                 rhs_dilation, numbers, feature_group_count, precision, preferred_element_type, out_sharding)
    with jax.named_scope(SCOPE):
        return _grouped(conv, lhs, rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped(conv: _Conv, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    return conv(lhs, rhs)


def _grouped_forward(conv: _Conv, lhs: jax.Array,
                     rhs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return conv(lhs, rhs), (lhs, rhs)


def _grouped_backward(conv: _Conv, saved: tuple[jax.Array, jax.Array],
                      cotangent: jax.Array) -> tuple[Any, Any]:
    lhs, rhs = saved
    _, lhs_vjp = jax.vjp(lambda x: conv(x, rhs), lhs)  # the input's gradient partitions right as it is
    return lhs_vjp(cotangent)[0], kernel_gradient(conv, lhs, cotangent, rhs.shape).astype(rhs.dtype)


_grouped.defvjp(_grouped_forward, _grouped_backward)


def kernel_gradient(conv: _Conv, lhs: jax.Array, cotangent: jax.Array,
                    kernel_shape: tuple[int, ...]) -> jax.Array:
    """d(loss)/d(kernel) of ``conv`` as a feature-grouped convolution: batch = the kernel's
    in-group channels, features = (group, row), window = the output's gradient."""
    numbers, groups = conv.dimension_numbers, conv.groups
    x = lhs.transpose(numbers.lhs_spec)  # (N, C, spatial...)
    dy = cotangent.transpose(numbers.out_spec)  # (N, O, spatial...)
    kernel = np.take(kernel_shape, numbers.rhs_spec)  # (O, C / groups, spatial...)
    rows, per_group, spatial = x.shape[0], x.shape[1] // groups, x.shape[2:]
    x = (x.reshape(rows, groups, per_group, *spatial).swapaxes(0, 2)
         .reshape(per_group, groups * rows, *spatial))
    padding = []
    for size, window, out, (low, _), stride, dilation, lhs_dilation in zip(
            np.take(lhs.shape, numbers.lhs_spec)[2:], kernel[2:], dy.shape[2:], conv.padding,
            conv.strides, conv.rhs_dilation, conv.lhs_dilation):
        dilated = (size - 1) * lhs_dilation + 1
        padding.append((low, (window - 1) * dilation + (out - 1) * stride + 1 - dilated - low))
    canonical = tuple(range(lhs.ndim))
    # (C / groups, O, kernel spatial...)
    gradient = jax.lax.conv_general_dilated(
        x, dy.swapaxes(0, 1), conv.rhs_dilation, padding, conv.lhs_dilation, conv.strides,
        jax.lax.ConvDimensionNumbers(canonical, canonical, canonical), feature_group_count=groups,
        precision=conv.precision, preferred_element_type=conv.preferred_element_type)
    return gradient.swapaxes(0, 1).transpose(np.argsort(numbers.rhs_spec))


def route_grouped_convs(model: nnx.Module) -> nnx.Module:
    """Give every ``nnx.Conv`` of ``model`` with groups (and jax's own convolution) ``grouped_conv``."""
    for _, module in nnx.iter_graph(model):
        if (isinstance(module, nnx.Conv) and module.feature_group_count > 1
                and module.conv_general_dilated is jax.lax.conv_general_dilated):
            module.conv_general_dilated = grouped_conv
    return model
