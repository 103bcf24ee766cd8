"""Join the test's JAX cluster: gloo collectives on CPU, N local devices per process."""

import os

import jax


def start_worker() -> int:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", int(os.environ["SHARDAX_TEST_DEVICES"]))
    jax.distributed.initialize(
        os.environ["SHARDAX_TEST_COORDINATOR"],
        num_processes=int(os.environ["SHARDAX_TEST_NUM_PROCESSES"]),
        process_id=int(os.environ["SHARDAX_TEST_PROCESS_ID"]),
        initialization_timeout=60,
    )
    return jax.process_index()
