"""The train step's choices undone while tracing, for benchmarks 22 (XLA:TPU) and 24 (a real GPU).

Each is a context manager: a step traced inside it has that one choice undone, and everything
else as shipped.
"""

from __future__ import annotations

import contextlib

import jax

from shardax import blocks
from shardax.models import ops
from shardax.step import train


@contextlib.contextmanager
def plain_autodiff():
    """Layer norm and GELU differentiated by JAX itself (what the custom VJPs replace)."""
    saved = ops.layer_norm, ops.gelu
    ops.layer_norm = lambda x, scale, bias: ops._normalized(x)[0] * scale + bias
    ops.gelu = jax.nn.gelu
    try:
        yield
    finally:
        ops.layer_norm, ops.gelu = saved


@contextlib.contextmanager
def update_by(select: bool):
    """The optimizer update kept by a select (computed every step) or inside a ``lax.cond``
    (computed only when it applies), whatever the device (``shardax.step.train.keep_where``)."""
    saved = train.keep_where
    train.keep_where = lambda apply, update, kept, **_: saved(apply, update, kept, select=select)
    try:
        yield
    finally:
        train.keep_where = saved


def cond_update():
    """The update inside a ``lax.cond`` (what the step does on XLA:CPU and GPUs)."""
    return update_by(select=False)


def select_update():
    """The update computed every step and kept by a select (what the step does on TPUs)."""
    return update_by(select=True)


@contextlib.contextmanager
def plain_loop_remat(on: bool):
    """A Python loop of layers with nothing to recompute or gather run under ``nnx.remat`` (or
    not), whatever the device (``shardax.blocks.remat_plain_loop``: on GPUs only)."""
    saved = blocks.remat_plain_loop
    blocks.remat_plain_loop = lambda platform: on
    try:
        yield
    finally:
        blocks.remat_plain_loop = saved


def remat_every_loop():
    """Layers in a Python loop under ``nnx.remat`` even with ``--remat none`` and nothing to gather."""
    return plain_loop_remat(True)


def no_remat_on_plain_loops():
    """Layers in a Python loop without ``nnx.remat`` when nothing is recomputed or gathered."""
    return plain_loop_remat(False)
