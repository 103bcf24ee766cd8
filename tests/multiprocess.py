"""Start real JAX processes on 127.0.0.1 (gloo CPU collectives) and collect what they print."""

import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(script: str, num_processes: int = 2, devices_per_process: int = 4, timeout: float = 180,
                args: tuple[str, ...] = ()) -> list[str]:
    """Run ``tests/workers/<script>`` as ``num_processes`` processes; return each one's stdout.

    Each worker gets SHARDAX_TEST_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID / _DEVICES in its
    environment. Any worker failing fails the caller with that worker's stderr.
    """
    port = free_port()
    from cli_helpers import subprocess_env

    env_base = subprocess_env()
    procs = []
    for process_id in range(num_processes):
        env = dict(
            env_base,
            SHARDAX_TEST_COORDINATOR=f"127.0.0.1:{port}",
            SHARDAX_TEST_NUM_PROCESSES=str(num_processes),
            SHARDAX_TEST_PROCESS_ID=str(process_id),
            SHARDAX_TEST_DEVICES=str(devices_per_process),
            JAX_PLATFORMS="cpu",
        )
        procs.append(
            subprocess.Popen([sys.executable, str(WORKERS / script), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = []
    try:
        for process_id, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"process {process_id} exited {proc.returncode}:\n{err[-3000:]}"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs
