"""Join the test's JAX cluster: gloo collectives on CPU, N local devices per process.

Gloo's C++ code prints "[Gloo] Rank ... is connected to ..." straight to file descriptor 1, which
can land in the middle of a line the worker prints for its test to read. So file descriptor 1 is
pointed at stderr, and Python's own prints go, line by line, to the real stdout.
"""

import os
import sys

import jax

from shardax import simulate_cpu_devices


def _keep_stdout_for_python() -> None:
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1)


def start_worker() -> int:
    _keep_stdout_for_python()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    simulate_cpu_devices(int(os.environ["SHARDAX_TEST_DEVICES"]))
    jax.distributed.initialize(
        os.environ["SHARDAX_TEST_COORDINATOR"],
        num_processes=int(os.environ["SHARDAX_TEST_NUM_PROCESSES"]),
        process_id=int(os.environ["SHARDAX_TEST_PROCESS_ID"]),
        initialization_timeout=60,
    )
    return jax.process_index()
