"""``shardax launch -n N -- COMMAND``: N processes on this machine, wired into one JAX cluster.

Each process gets ``SHARDAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
``SHARDAX_NUM_PROCESSES``, ``SHARDAX_PROCESS_ID`` and ``SHARDAX_DEVICES_PER_PROCESS``; its
output lines come back prefixed with ``[i]``. When one process fails, the others are stopped
and the launcher exits non-zero naming it: a cluster with a dead member never hangs.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from shardax.errors import EXIT_PREEMPTED, UsageError

STOP_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(command: Sequence[str]) -> list[str]:
    """Run ``shardax ...`` with this same Python, whatever ``shardax`` is first on PATH."""
    if command and os.path.basename(command[0]) == "shardax":
        return [sys.executable, "-m", "shardax.cli", *command[1:]]
    return list(command)


def _relay(index: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{index}] {line if line.endswith(chr(10)) else line + chr(10)}")
            sys.stdout.flush()
    stream.close()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # exited between the check and the signal
        pass


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def launch(command: Sequence[str], num_processes: int, devices_per_process: int) -> int:
    """Run ``command`` as ``num_processes`` cooperating processes; returns the exit code."""
    if num_processes < 1 or devices_per_process < 1:
        raise UsageError(f"-n {num_processes} and --devices-per-process {devices_per_process} must be at "
                         "least 1")
    if not command:
        raise UsageError("nothing to launch; give the command after --, e.g. shardax launch -n 2 -- shardax "
                         "train")
    address = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    processes, relays = [], []
    for index in range(num_processes):
        env = dict(os.environ, SHARDAX_COORDINATOR_ADDRESS=address, SHARDAX_NUM_PROCESSES=str(num_processes),
                   SHARDAX_PROCESS_ID=str(index), SHARDAX_DEVICES_PER_PROCESS=str(devices_per_process),
                   PYTHONUNBUFFERED="1")
        process = subprocess.Popen(_command(command), env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        processes.append(process)
        print(f"[launch] process {index}: pid {process.pid}", flush=True)
        relay = threading.Thread(target=_relay, args=(index, process.stdout, lock), daemon=True)
        relay.start()
        relays.append(relay)
        threading.Thread(target=_report_exit, args=(index, process, exits), daemon=True).start()
    forward = _Forwarder(processes)
    previous = signal.signal(signal.SIGTERM, forward.sigterm)
    try:
        return _supervise(processes, relays, exits, forward)
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Forwarder:
    """SIGTERM or a first Ctrl-C to the launcher: SIGTERM to every process, which checkpoint and exit 75."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes, self.sent = processes, False

    def sigterm(self, number: int, frame: object) -> None:
        self.send()

    def send(self) -> None:
        if not self.sent:
            print("[launch] passing SIGTERM to every process: each stops after a checkpoint", flush=True)
            for process in self.processes:
                if process.poll() is None:
                    _signal_group(process, signal.SIGTERM)
        self.sent = True


def _report_exit(index: int, process: subprocess.Popen, exits: queue.Queue) -> None:
    exits.put((index, process.wait()))


BYSTANDER_WINDOW_S = 1.0


def _cause(index: int, code: int, exits: queue.Queue) -> tuple[int, int]:
    """The failure to blame, given the first one seen: a process that aborted (SIGABRT) is what JAX
    does when a peer is lost, so a failure of another kind arriving just after it is the cause.
    Exits are seen in the order their waiter threads wake, which a busy machine may swap."""
    if code != -signal.SIGABRT:
        return index, code
    deadline = time.monotonic() + BYSTANDER_WINDOW_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            other, other_code = exits.get(timeout=left)
        except queue.Empty:
            break
        if other_code not in (0, EXIT_PREEMPTED, -signal.SIGABRT):
            return other, other_code
    return index, code


def _supervise(processes: list[subprocess.Popen], relays: list[threading.Thread], exits: queue.Queue,
               forward: _Forwarder) -> int:
    """Wait for the processes; the first to fail is named, in the order they exited.

    When one member dies the others soon abort on their own (JAX's coordination service sees the
    lost peer), so naming the lowest failed index would often blame a bystander. A process that
    exits with ``EXIT_PREEMPTED`` stopped after a checkpoint that every process agreed on: the
    others are waited for, and the launcher exits with that code too.
    """
    finished, preempted = 0, False
    while finished < len(processes):
        try:
            index, code = exits.get(timeout=0.5)  # a timeout keeps Ctrl-C responsive
        except queue.Empty:
            continue
        except KeyboardInterrupt:
            if forward.sent:  # asked twice: stop now
                _stop(processes)
                return 130
            forward.send()
            continue
        if code == EXIT_PREEMPTED:
            preempted = True
        elif code != 0:
            index, code = _cause(index, code, exits)
            print(f"[launch] process {index} {_describe_exit(code)}; stopping the other processes",
                  flush=True)
            _stop(processes)
            for relay in relays:
                relay.join(timeout=1)
            print(f"shardax launch: error: process {index} of {len(processes)} {_describe_exit(code)}",
                  file=sys.stderr, flush=True)
            return 1
        finished += 1
    for relay in relays:
        relay.join(timeout=5)
    if preempted:
        print("[launch] every process stopped after a checkpoint; run the same command with --resume to go "
              "on",
              flush=True)
        return EXIT_PREEMPTED
    return 0
