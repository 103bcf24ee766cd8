"""Bytes as XLA:TPU lays arrays out in HBM (its tiles), and what it keeps of each residual."""

from __future__ import annotations

import math

from shardax.analysis.residuals import STAND_IN, Residual
from shardax.vocabulary import LAYERS


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def tiled_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of an array as XLA:TPU lays it out in HBM: in tiles of 128 along its minor dimension
    and, for two or more dimensions, of 8 rows of 32 bits (16 of bfloat16) along the next, fewer
    when that dimension is smaller (1, 2, 4). The minor dimension is the last one unless making
    another one minor pads less. The state sized so equals XLA:TPU's argument bytes to the byte
    (``tests/test_tpu_plan.py``; tiny, small and two held-out shapes checked besides)."""
    if len(shape) <= 1:
        return round_up(math.prod(shape), 128) * itemsize
    rows = 32 // itemsize

    def laid_out(minor: int) -> int:
        order = [size for axis, size in enumerate(shape) if axis != minor] + [shape[minor]]
        tile = min(rows, 1 << max(order[-2] - 1, 0).bit_length())
        return math.prod(order[:-2]) * round_up(order[-2], tile) * round_up(order[-1], 128) * itemsize

    last = laid_out(len(shape) - 1)
    return min([last] + [laid_out(axis) for axis in range(len(shape) - 1)])


def stored_bytes(shape: tuple[int, ...], itemsize: int, tiled: bool) -> int:
    """An array's bytes: its elements', or, ``tiled``, in XLA:TPU's tiles."""
    return tiled_bytes(shape, itemsize) if tiled else math.prod(shape) * itemsize


def kept_bytes(kept: Residual, real: tuple[int, ...], compiler: str, shards: int = 1) -> int:
    """What one residual (``real``: its shape on a device) takes: its elements', or on XLA:TPU, in
    its tiles, float32 matmul operands in bfloat16 (also in float32 when they are used otherwise
    too), and a parameter only as the bfloat16 copy of a stacked layer weight a matmul reads (of
    each device's shard, ``shards`` of them, where FSDP gathers it)."""
    if compiler != "tpu":
        return 0 if kept.parameter else math.prod(real) * kept.itemsize
    narrowed = kept.itemsize == 4 and "dot" in kept.uses
    if kept.parameter:
        stacked = real and kept.dims[0] == STAND_IN[LAYERS]
        return real[0] * tiled_bytes(real[1:], 2) // shards if narrowed and stacked else 0
    return (tiled_bytes(real, 2) if narrowed else 0) + (
        0 if narrowed and kept.uses == {"dot"} else tiled_bytes(real, kept.itemsize))
