"""Logical axis names and the rules that map them onto mesh axes.

Parameters and activations are annotated once with logical names (``embed``, ``mlp``, ...);
a rules table, a tuple of ``(logical_name, mesh_axis_or_None)`` pairs in the format
``nnx.logical_axis_rules`` takes, decides where each name lands on a given mesh.
"""

from __future__ import annotations

# Logical names used by shardax's layers and models.
BATCH = "batch"
LOGICAL_AXES = ("batch", "length", "embed", "mlp", "heads", "kv", "vocab", "layers")

Rules = tuple[tuple[str, "str | tuple[str, ...] | None"], ...]


def data_parallel_rules(data_axis: str = "data") -> Rules:
    """Rules for pure data parallelism: the batch is split over ``data_axis``, nothing else is.

    Every other logical name maps to ``None`` (replicated), so models annotated for model
    parallelism run data-parallel under these rules unchanged.
    """
    return ((BATCH, data_axis),) + tuple((name, None) for name in LOGICAL_AXES if name != BATCH)
