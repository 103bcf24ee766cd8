"""Simulated CPU devices whose collectives cannot starve each other.

XLA:CPU runs the devices of one process on a shared pool of threads, ``max(cores, devices)``
of them, and a collective holds its thread until every device has joined it. Within one
program it may run, side by side, collectives that do not depend on each other: in jaxlib
0.10 a loop or a conditional that holds collectives is not ordered against the collectives
around it. When some devices start one of them and the rest start the other, every thread
of the pool waits in a half-joined collective and none is left to start the other half:
XLA aborts after its rendezvous timeout (LoRA under fsdp on 8 simulated devices: the forward
loop's all-gather beside the loss's token-count all-reduce). A real accelerator runs one
device's collectives in program order on its own stream, so this stall belongs to the
simulator, and a pool with two threads per device removes it (``tests/test_cpu_devices.py``
holds the smallest program that stalls). ``PJRT_NPROC`` sizes that pool; it is read once,
when JAX starts its CPU backend.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

POOL_VARIABLE = "PJRT_NPROC"
# A device ran at most two collectives side by side in every program seen (a loop holding some,
# beside one outside it); a pool of 2 per device serves them all at once. A larger pool slows
# the default run's step on 2 cores (benchmark 25 in docs/benchmarks.md), so the pool is no larger.
THREADS_PER_DEVICE = 2


def collective_threads(devices: int) -> int:
    """The pool size that lets ``devices`` simulated devices each run collectives side by side."""
    return max(os.cpu_count() or 1, THREADS_PER_DEVICE * max(devices, 1))


def pool_size() -> int | None:
    """The pool size this process asks XLA:CPU for (``PJRT_NPROC``, else ``NPROC``), or None."""
    for name in (POOL_VARIABLE, "NPROC"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def simulate_cpu_devices(count: int) -> None:
    """Simulate ``count`` CPU devices in this process, with a thread pool their collectives
    cannot starve (``PJRT_NPROC`` of ``collective_threads(count)``; a size set before is kept,
    and ``parallelize`` warns where it is too small). Call it before JAX runs anything, in place
    of ``jax.config.update("jax_num_cpu_devices", count)``."""
    import jax

    if count < 1:
        raise ValueError(f"simulate_cpu_devices({count}): the count must be at least 1")
    if pool_size() is None:
        os.environ[POOL_VARIABLE] = str(collective_threads(count))
    jax.config.update("jax_num_cpu_devices", count)


def starved_pool_warning(devices: int) -> str | None:
    """A line saying that ``devices`` simulated CPU devices may stall each other, or None."""
    pool = pool_size()
    if devices <= 1 or (pool is not None and pool >= THREADS_PER_DEVICE * devices):
        return None
    threads = max(pool or os.cpu_count() or 1, devices)
    return (f"{devices} simulated CPU devices share {threads} threads, and XLA:CPU can stall (abort after "
            f"its rendezvous timeout) when their collectives run side by side; call "
            f"shardax.simulate_cpu_devices({devices}) before JAX starts, or set "
            f"{POOL_VARIABLE}={collective_threads(devices)}")


def simulated_here(mesh: Any) -> int:
    """How many of ``mesh``'s devices this process simulates on its CPU (0 or 1: none simulated)."""
    import jax

    here = jax.process_index()
    return sum(device.platform == "cpu" and device.process_index == here for device in mesh.devices.flat)


def describe_devices(mesh: Any) -> str:
    """``8 cpu devices``, and where this process simulates several, the threads they share."""
    platform = mesh.devices.flat[0].platform
    local = simulated_here(mesh)
    if local <= 1:
        return f"{mesh.devices.size} {platform} devices"
    threads = max(pool_size() or os.cpu_count() or 1, local)
    return f"{mesh.devices.size} {platform} devices, {local} simulated here on {threads} threads"


def warn_if_starved(mesh: Any) -> None:
    """Warn (once per place) where ``mesh``'s simulated CPU devices in this process may stall."""
    line = starved_pool_warning(simulated_here(mesh))
    if line:
        warnings.warn(line, RuntimeWarning, stacklevel=3)
