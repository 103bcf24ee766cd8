"""Many hosts on JAX's own multi-controller runtime (``jax.distributed``).

``init_distributed()`` finds out where it runs (explicit arguments, ``SHARDAX_*`` variables,
SLURM, Open MPI, Kubernetes or a Cloud TPU pod), then joins the cluster. On one process it
does nothing.

A coordinator that does not answer is a ``ClusterError`` before JAX is called. Once
``jax.distributed.initialize`` waits for its peers it cannot be interrupted, and JAX aborts the
whole process when one never arrives; a watchdog says first, in one line, what was expected,
and hands that line to ``on_timeout`` (the command line's own entry point ends the process
there, with exit code 3, ``EXIT_CLUSTER``; the library itself never ends a process).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

import jax

from shardax.cpu_devices import simulate_cpu_devices
from shardax.errors import ClusterError, UsageError

DEFAULT_PORT = 8476
JAX_DETECTS = ("slurm", "openmpi")  # clusters jax.distributed.initialize() finds from their variables alone
OVERRIDES = ("SHARDAX_COORDINATOR_ADDRESS", "SHARDAX_NUM_PROCESSES", "SHARDAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process stands: how it was found, the coordinator, the process count and index."""

    source: str  # explicit, environment, slurm, openmpi, kubernetes, tpu-pod, single
    coordinator_address: str | None
    num_processes: int
    process_id: int


def _first_slurm_host(nodelist: str) -> str:
    """``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise UsageError(f"cannot read a host from SLURM nodelist {nodelist!r}")
    prefix, ranges = head.group(1), head.group(3)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def _port(env: Mapping[str, str], fallback: int = DEFAULT_PORT) -> int:
    return int(env.get("SHARDAX_COORDINATOR_PORT", fallback))


def _scheduler(env: Mapping[str, str]) -> ClusterSpec | None:
    """What a scheduler's own variables say: SLURM, Open MPI, a Cloud TPU pod or a Kubernetes indexed Job."""
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        host = _first_slurm_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        port = _port(env, int(env.get("SLURM_JOB_ID", "0")) % 2**12 + 65535 - 2**12 + 1)  # JAX's own choice
        return ClusterSpec("slurm", f"{host}:{port}", int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]))
    if "OMPI_COMM_WORLD_SIZE" in env:
        uri = env.get("OMPI_MCA_orte_hnp_uri", "") or env.get("PMIX_SERVER_URI2", "")
        host = re.search(r"tcp4?://([^:,;/]+)", uri)
        address = f"{host.group(1)}:{_port(env)}" if host else None
        return ClusterSpec("openmpi", address, int(env["OMPI_COMM_WORLD_SIZE"]),
                           int(env["OMPI_COMM_WORLD_RANK"]))
    if "TPU_WORKER_HOSTNAMES" in env and env.get("TPU_WORKER_ID", "").isdigit():
        hosts = env["TPU_WORKER_HOSTNAMES"].split(",")
        return ClusterSpec("tpu-pod", f"{hosts[0]}:{_port(env)}", len(hosts), int(env["TPU_WORKER_ID"]))
    if "JOB_COMPLETION_INDEX" in env and "KUBERNETES_SERVICE_HOST" in env:
        count = env.get("SHARDAX_NUM_PROCESSES") or env.get("JOB_PARALLELISM") or env.get("NUM_PROCESSES")
        if count is None:
            raise UsageError("Kubernetes indexed Job found but the process count is unknown; "
                             "set SHARDAX_NUM_PROCESSES (and SHARDAX_COORDINATOR_ADDRESS=<pod-0 "
                             "host>:<port>)")
        return ClusterSpec("kubernetes", None, int(count), int(env["JOB_COMPLETION_INDEX"]))
    return None


def detect_cluster(env: Mapping[str, str] = os.environ) -> ClusterSpec:
    """The cluster this process belongs to (see the module docstring).

    A scheduler's variables give the process count and this process's index; ``SHARDAX_*``
    variables override what they set (``SHARDAX_COORDINATOR_ADDRESS``, ``SHARDAX_NUM_PROCESSES``,
    ``SHARDAX_PROCESS_ID``). Without a scheduler, ``SHARDAX_NUM_PROCESSES`` alone defines the
    cluster (``shardax launch``, or machines started by hand).
    """
    found = _scheduler(env)
    address = env.get("SHARDAX_COORDINATOR_ADDRESS")
    count, index = env.get("SHARDAX_NUM_PROCESSES"), env.get("SHARDAX_PROCESS_ID")
    if found is not None:
        return dataclasses.replace(found, coordinator_address=address or found.coordinator_address,
                                   num_processes=int(count) if count else found.num_processes,
                                   process_id=int(index) if index else found.process_id)
    if count is not None:
        return ClusterSpec("environment", address, int(count), int(index or 0))
    return ClusterSpec("single", None, 1, 0)


def _wait_for_coordinator(address: str, deadline: float) -> bool:
    host, _, port = address.rpartition(":")
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.25)
    return False


def _say(message: str) -> None:
    """The library's default when joining times out: the line on stderr; JAX's abort follows."""
    print(f"shardax: error: {message}", file=sys.stderr, flush=True)


def _watchdog(spec: ClusterSpec, timeout_s: float, on_timeout: Callable[[str], None]) -> threading.Timer:
    """Calls ``on_timeout`` with a clear line if joining takes longer than ``timeout_s``."""
    who = f"process {spec.process_id} of {spec.num_processes}"
    if spec.process_id == 0:
        reason = (f"{who}: not every process joined the cluster at {spec.coordinator_address} within "
                  f"{timeout_s:.0f} s; check that all {spec.num_processes} were started with this address")
    else:
        reason = (f"{who}: the coordinator at {spec.coordinator_address} accepted the connection but the "
                  f"cluster did not form within {timeout_s:.0f} s; check that every process was started")
    timer = threading.Timer(timeout_s, on_timeout, args=(reason,))
    timer.daemon = True
    timer.start()
    return timer


def _requested(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None) -> ClusterSpec:
    """The detected cluster, or the explicit arguments where any is given (the rest detected)."""
    spec = detect_cluster()
    if coordinator_address or num_processes is not None or process_id is not None:
        spec = ClusterSpec("explicit", coordinator_address or spec.coordinator_address,
                           num_processes if num_processes is not None else spec.num_processes,
                           process_id if process_id is not None else spec.process_id)
    return spec


def _check_spec(spec: ClusterSpec) -> None:
    """A cluster of several processes needs a coordinator address and a process id within it."""
    if not spec.coordinator_address:
        raise UsageError(f"{spec.source} cluster of {spec.num_processes} processes but no coordinator "
                         "address; set SHARDAX_COORDINATOR_ADDRESS=host:port (process 0's host)")
    if not 0 <= spec.process_id < spec.num_processes:
        raise UsageError(f"process_id {spec.process_id} is outside 0..{spec.num_processes - 1}")


def _reach_coordinator(spec: ClusterSpec, deadline: float, timeout_s: float) -> None:
    """A ``ClusterError`` unless the coordinator answers by ``deadline`` (not checked on process 0,
    nor where JAX finds the cluster itself)."""
    if spec.process_id == 0 or spec.source in JAX_DETECTS:
        return
    if not _wait_for_coordinator(spec.coordinator_address, deadline):
        raise ClusterError(f"process {spec.process_id} of {spec.num_processes}: nothing answered at the "
                           f"coordinator address {spec.coordinator_address} within {timeout_s:.0f} s; check "
                           "the address and that process 0 runs")


def _initialize(spec: ClusterSpec, timeout_s: float, heartbeat_timeout_s: int) -> None:
    """``jax.distributed.initialize`` for ``spec``, which waits until every process has joined."""
    # Where JAX finds this cluster itself (SLURM, Open MPI, a Cloud TPU pod) and nothing overrides
    # it, JAX's own detection decides; shardax adds the watchdog and its clear message.
    found_by_jax = spec.source in JAX_DETECTS and not any(os.environ.get(name) for name in OVERRIDES)
    if found_by_jax:
        jax.distributed.initialize(initialization_timeout=int(timeout_s) + 10,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    else:
        jax.distributed.initialize(spec.coordinator_address, num_processes=spec.num_processes,
                                   process_id=spec.process_id, initialization_timeout=int(timeout_s) + 10,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float = 300,
    heartbeat_timeout_s: int = 60,
    cpu_devices: int | None = None,
    on_timeout: Callable[[str], None] | None = None,
) -> ClusterSpec:
    """Join the JAX cluster this process belongs to; a no-op on a single process.

    Args:
      coordinator_address: ``host:port`` of process 0; defaults come from the environment.
      num_processes, process_id: this cluster's size and this process's index.
      timeout_s: how long to wait for the coordinator and every peer before a clear error:
        a ``ClusterError`` when the coordinator does not answer; when a peer never joins,
        ``on_timeout`` gets the line saying so (JAX then aborts the process itself).
      heartbeat_timeout_s: how soon JAX notices that a peer died after the cluster formed.
      cpu_devices: on CPU, how many devices this process simulates.
      on_timeout: called from a watchdog thread with that line while JAX still waits, for
        a program that owns its process to end it cleanly (``shardax train`` exits with
        code 3); by default the line is printed on stderr.
    """
    spec = _requested(coordinator_address, num_processes, process_id)
    if cpu_devices is not None:
        simulate_cpu_devices(cpu_devices)
    if spec.num_processes <= 1:
        return spec
    _check_spec(spec)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + timeout_s
    _reach_coordinator(spec, deadline, timeout_s)
    timer = _watchdog(spec, max(deadline - time.monotonic(), 1.0), on_timeout or _say)
    try:
        _initialize(spec, timeout_s, heartbeat_timeout_s)
    finally:
        timer.cancel()
    return spec
