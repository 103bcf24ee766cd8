"""Many hosts, proven with real processes on 127.0.0.1 (gloo collectives)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from cli_helpers import QUICK, WORKERS, last_logged_step, read_metrics, shardax, subprocess_env

from shardax.distributed import detect_cluster
from shardax.trainer.checkpoint import saved_arrays, saved_steps
from shardax.trainer.manifest import MANIFEST

# One pytest-xdist worker runs this file: the 1x8 / 2x4 runs are trained once and shared by the tests below.
pytestmark = pytest.mark.xdist_group("test_multihost")

RUN = (*QUICK, "--steps", 3, "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0)
LAUNCH_2x4 = ("launch", "-n", 2, "--devices-per-process", 4, "--", "shardax")


def final_arrays(directory, step):
    return saved_arrays(directory, step)


_PAIRS = {}


def train_pair(strategy, corpus, tmp_path_factory):
    """The same run as 1 process x 8 devices and as 2 processes x 4 devices (once per session)."""
    if strategy not in _PAIRS:
        folder = tmp_path_factory.mktemp(f"pair-{strategy}")
        args = (*RUN, "--data", corpus, "--strategy", strategy)
        one = shardax("train", *args, "--checkpoint-dir", folder / "one", "--metrics", folder / "one.jsonl")
        # the two processes agree on a new run directory (process 0 names it) and checkpoint into it together
        two = shardax(*LAUNCH_2x4, "train", *args, "--metrics", folder / "two.jsonl",
                      env={"SHARDAX_RUNS_DIR": str(folder / "runs")})
        [run] = (folder / "runs").iterdir()
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "tokenizer.json"]
        # the metrics elsewhere
        resume = f"shardax train --run-dir {run} --metrics {folder / 'two.jsonl'} --resume"
        assert two.stdout.count(f"run directory: {run} (resume it with: {resume})") == 1, two.stdout
        (run / "checkpoints").rename(folder / "two")
        _PAIRS[strategy] = (one, two, folder)
    return _PAIRS[strategy]


@pytest.mark.slow
# fsdp_tp gathers over data as fsdp does, and splits over model
@pytest.mark.parametrize("strategy", ["dp", "fsdp_tp"])
def test_two_processes_train_like_one(strategy, small_corpus, tmp_path_factory):
    one, two, tmp_path = train_pair(strategy, small_corpus, tmp_path_factory)
    assert "[0] shardax train" in two.stdout and "[1] shardax train" not in two.stdout  # printed once
    assert "on mesh" in two.stdout and "8 cpu devices" in two.stdout
    losses_one = [r["loss"] for r in read_metrics(tmp_path / "one.jsonl")]
    losses_two = [r["loss"] for r in read_metrics(tmp_path / "two.jsonl")]
    assert len(losses_two) == 3
    np.testing.assert_allclose(losses_two, losses_one, rtol=1e-5)
    expected, got = final_arrays(tmp_path / "one", 3), final_arrays(tmp_path / "two", 3)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # each process hashed the files it wrote; process 0 the ones written as the checkpoint was committed
    sealed = json.loads((tmp_path / "two" / "3" / MANIFEST).read_text())["files"]
    by = {name: entry["by"] for name, entry in sealed.items()}
    assert {by[name] for name in by if "process_1" in name} == {1}
    assert {by[name] for name in by if "process_0" in name} == {0}
    assert {by[name] for name in by if "process_" not in name} == {0}
    assert not list((tmp_path / "two" / "3").glob("shardax_manifest.process_*"))  # the parts were merged


@pytest.mark.slow
def test_checkpoints_cross_between_one_and_two_processes(small_corpus, tmp_path, tmp_path_factory):
    _, _, pair = train_pair("fsdp_tp", small_corpus, tmp_path_factory)
    for name in ("one", "two"):  # continue copies: the pair's own files stay as they were
        shutil.copytree(pair / name, tmp_path / name)
        shutil.copy(pair / f"{name}.jsonl", tmp_path / f"{name}.jsonl")
    # a copy of step 3 as step 5, damaged in a block that only process 1 checks (the processes share the
    # hashing)
    shutil.copytree(tmp_path / "one" / "3", tmp_path / "one" / "5")
    units = [(name, k)
             for name, entry in sorted(json.loads((tmp_path / "one" / "5" / MANIFEST).read_text())["files"]
                                       .items())
             for k in range(len(entry["blocks"]))]
    name = max((name for i, (name, k) in enumerate(units) if i % 2 == 1 and k == 0),
               key=lambda name: (tmp_path / "one" / "5" / name).stat().st_size)
    damaged = tmp_path / "one" / "5" / name
    damaged.write_bytes(bytes(damaged.stat().st_size))
    more = (*QUICK, "--extend-to", 4, "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0, "--data",
            small_corpus, "--strategy", "fsdp_tp", "--resume")
    into_two = shardax(*LAUNCH_2x4, "train", *more, "--checkpoint-dir", tmp_path / "one",
                       "--metrics", tmp_path / "one.jsonl")
    into_one = shardax("train", *more, "--checkpoint-dir", tmp_path / "two", "--metrics",
                       tmp_path / "two.jsonl")
    assert "resumed from step 3" in into_two.stdout and "resumed from step 3" in into_one.stdout
    assert (f"checkpoint step 5 in {tmp_path / 'one'} is damaged ({name} changed since it was sealed)"
            in into_two.stdout)
    assert (tmp_path / "one" / "5.damaged").is_dir() and not (tmp_path / "one" / "5").exists()
    step4 = [read_metrics(tmp_path / name)[-1] for name in ("one.jsonl", "two.jsonl")]
    assert [r["step"] for r in step4] == [4, 4]
    np.testing.assert_allclose(step4[0]["loss"], step4[1]["loss"], rtol=1e-5)
    a, b = final_arrays(tmp_path / "one", 4), final_arrays(tmp_path / "two", 4)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_the_processes_of_one_run_share_its_checkpoint_lock(small_corpus, tmp_path):
    """Two processes write one directory as one run: a second run is refused in one line naming
    process 0, the first goes on saving at every step, and lets the lock go when it ends."""
    checkpoints, release = tmp_path / "ckpt", tmp_path / "release"
    args = ("train", *RUN, "--checkpoint-every", 1, "--data", small_corpus,
            "--checkpoint-dir", checkpoints, "--metrics", tmp_path / "m.jsonl")
    first = subprocess.Popen(
        [sys.executable, "-m", "shardax.cli", *map(str, LAUNCH_2x4[:-1]), sys.executable,
         str(WORKERS / "stall.py"), "1", "240", "shardax", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(subprocess_env(), STALL_RELEASE=str(release)))
    try:
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None and last_logged_step(tmp_path / "m.jsonl") < 1:
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()[-2000:]
        holder = json.loads((checkpoints / ".shardax-lock").read_text())
        assert holder["processes"] == 2
        second = shardax("train", *RUN, "--data", small_corpus, "--checkpoint-dir", checkpoints,
                         "--resume", check=False)
        assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr[-2000:]
        assert (f"is being written by another run (host {holder['host']}, pid {holder['pid']},"
                in second.stderr)
        release.write_text("")
        out, err = first.communicate(timeout=300)
    finally:
        release.write_text("")
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-2000:]
    assert saved_steps(checkpoints) == [1, 2, 3] and (checkpoints / ".shardax-lock").read_text() == ""


def _collect(stream, lines):
    for line in iter(stream.readline, ""):
        lines.append(line)


@pytest.mark.slow
def test_a_killed_process_stops_the_cluster_and_the_checkpoint_resumes(small_corpus, tmp_path):
    args = (*QUICK, "--steps", 200, "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0, "--data",
            small_corpus, "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 2, "--metrics",
            tmp_path / "m.jsonl")
    env = subprocess_env()
    launcher = subprocess.Popen([sys.executable, "-m", "shardax.cli", *map(str, LAUNCH_2x4), "train",
                                 *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=_collect, args=(launcher.stdout, lines), daemon=True).start()
    deadline = time.time() + 240
    while time.time() < deadline and last_logged_step(tmp_path / "m.jsonl") < 5:
        assert launcher.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.1)
    pids = {int(line.split("pid")[1]) for line in lines if line.startswith("[launch] process")}
    victim = next(int(line.split("pid")[1]) for line in lines if line.startswith("[launch] process 1:"))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    launcher.wait(timeout=60)
    assert time.time() - killed_at < 60
    assert launcher.returncode != 0
    assert "process 1 of 2 was killed by SIGKILL" in launcher.stderr.read()
    for pid in pids:  # nobody left hanging
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    last = max(saved_steps(tmp_path / "ckpt"), default=None)
    assert last is not None and last >= 2
    resumed = shardax("train", *QUICK, "--extend-to", last + 1, "--eval-every", 0, "--sample-bytes", 0,
                      "--data", small_corpus, "--checkpoint-dir", tmp_path / "ckpt", "--resume")
    assert f"resumed from step {last}" in resumed.stdout


def _join(address, processes, index, timeout):
    """The library's own behaviour, in a program of the user's."""
    code = ("from shardax.distributed import init_distributed; from shardax.errors import ClusterError\n"
            "try:\n"
            f"    init_distributed({address!r}, {processes}, {index}, timeout_s={timeout}, cpu_devices=2)\n"
            "    print('joined')\n"
            "except ClusterError as error:\n"
            "    print('ClusterError:', error)")
    started = time.time()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return result, time.time() - started


def _train_as(address, processes, index, timeout):
    """``shardax train`` as one process of a cluster that does not form."""
    env = dict(subprocess_env(), SHARDAX_COORDINATOR_ADDRESS=address, SHARDAX_NUM_PROCESSES=str(processes),
               SHARDAX_PROCESS_ID=str(index), SHARDAX_JOIN_TIMEOUT_S=str(timeout))
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "shardax.cli", "train", *map(str, QUICK), "--steps", "1"],
                            capture_output=True, text=True, timeout=120, env=env)
    return result, time.time() - started


@pytest.mark.slow
def test_wrong_coordinator_address_is_a_clear_error_not_a_hang():
    expected = "process 1 of 2: nothing answered at the coordinator address 127.0.0.1:1 within 3 s"
    result, took = _join("127.0.0.1:1", 2, 1, 3)  # the library raises; the program goes on
    assert result.returncode == 0 and f"ClusterError: {expected}" in result.stdout and took < 60
    result, took = _train_as("127.0.0.1:1", 2, 1, 3)
    assert result.returncode == 3 and result.stderr.strip() == f"shardax train: error: {expected}; " \
        "check the address and that process 0 runs" and took < 60


@pytest.mark.slow
def test_missing_peer_is_a_clear_error_not_a_hang():
    from shardax.launch import free_port

    expected = "shardax: error: process 0 of 2: not every process joined the cluster at "
    result, took = _train_as(f"127.0.0.1:{free_port()}", 2, 0, 3)  # the command line ends its own process
    assert result.returncode == 3 and result.stderr.startswith(expected), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and took < 60
    # the library says it, and leaves the process to JAX
    result, _ = _join(f"127.0.0.1:{free_port()}", 2, 0, 3)
    assert result.stderr.startswith(expected) and "joined" not in result.stdout and result.returncode != 3


def test_a_join_timeout_that_is_not_a_number_is_one_line():
    result = shardax("train", *QUICK, "--steps", 1, check=False, env={"SHARDAX_NUM_PROCESSES": "2",
                                                                      "SHARDAX_JOIN_TIMEOUT_S": "soon"})
    assert result.returncode == 2 and result.stderr.strip() == (
        "shardax train: error: SHARDAX_JOIN_TIMEOUT_S='soon': give the seconds to wait for the cluster to "
        "form, a number above 0 (default 300)")


@pytest.mark.parametrize("env, expected", [
    ({}, ("single", None, 1, 0)),
    ({"SHARDAX_NUM_PROCESSES": "4", "SHARDAX_PROCESS_ID": "2",
      "SHARDAX_COORDINATOR_ADDRESS": "10.1.2.3:9999"},
     ("environment", "10.1.2.3:9999", 4, 2)),
    ({"SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
      "SLURM_JOB_ID": "4242"},
     ("slurm", "gpu07:61586", 16, 5)),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "node1,node2"},
     ("slurm", "node1:61440", 2, 1)),
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3",
      "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.5:4000"},
     ("openmpi", "10.0.0.5:8476", 8, 3)),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "2"}, ("tpu-pod", "t0:8476", 4, 2)),
    ({"JOB_COMPLETION_INDEX": "1", "KUBERNETES_SERVICE_HOST": "x", "JOB_PARALLELISM": "3",
      "SHARDAX_COORDINATOR_ADDRESS": "job-0.svc:1234"}, ("kubernetes", "job-0.svc:1234", 3, 1)),
    # docs/many-hosts.md's recipe: SHARDAX_NUM_PROCESSES must not hide the pod's own index
    ({"JOB_COMPLETION_INDEX": "3", "KUBERNETES_SERVICE_HOST": "x", "SHARDAX_NUM_PROCESSES": "4",
      "SHARDAX_COORDINATOR_ADDRESS": "shardax-0.shardax:8476"},
     ("kubernetes", "shardax-0.shardax:8476", 4, 3)),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "n1",
      "SHARDAX_COORDINATOR_ADDRESS": "n1:9"},
     ("slurm", "n1:9", 4, 2)),
])
def test_cluster_detection(env, expected):
    spec = detect_cluster(env)
    assert (spec.source, spec.coordinator_address, spec.num_processes, spec.process_id) == expected


def test_the_kubernetes_recipe_environment_forms_a_cluster():
    """Exactly what docs/many-hosts.md sets (plus what Kubernetes sets itself): each pod its own index."""
    from shardax.launch import free_port

    code = ("from shardax.distributed import init_distributed; import jax; "
            "spec = init_distributed(cpu_devices=2); "
            "print(spec.source, jax.process_index(), jax.process_count(), jax.device_count())")
    address = f"127.0.0.1:{free_port()}"
    pods = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True,
                             env=dict(subprocess_env(), JOB_COMPLETION_INDEX=str(index),
                                      KUBERNETES_SERVICE_HOST="10.0.0.1", SHARDAX_NUM_PROCESSES="2",
                                      SHARDAX_COORDINATOR_ADDRESS=address))
            for index in (0, 1)]
    outputs = [pod.communicate(timeout=120) for pod in pods]
    assert [out.split() for out, _ in outputs] == [["kubernetes", "0", "2", "4"],
                                                   ["kubernetes", "1", "2", "4"]], outputs


def test_a_slurm_allocation_forms_a_cluster_through_jaxs_own_detection():
    """SLURM's variables alone (one node, two tasks): JAX finds the coordinator, count and index itself."""
    code = ("from shardax.distributed import init_distributed; import jax; "
            "spec = init_distributed(cpu_devices=2); "
            "print(spec.source, spec.coordinator_address, jax.process_index(), jax.process_count())")
    job = str(1000 + os.getpid() % 3000)  # a port JAX derives from the job id; vary it between runs
    tasks = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True,
                              env=dict(subprocess_env(), SLURM_JOB_ID=job, SLURM_STEP_NODELIST="localhost",
                                       SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2",
                                       SLURM_PROCID=str(index), SLURM_LOCALID=str(index),
                                       SLURM_STEP_NUM_NODES="1"))
             for index in (0, 1)]
    outputs = [task.communicate(timeout=120) for task in tasks]
    port = str(int(job) % 4096 + 61440)
    assert [out.split() for out, _ in outputs] == [["slurm", f"localhost:{port}", str(i), "2"]
                                                   for i in (0, 1)], outputs


def test_kubernetes_without_a_process_count_says_what_to_set():
    with pytest.raises(ValueError, match="set SHARDAX_NUM_PROCESSES"):
        detect_cluster({"JOB_COMPLETION_INDEX": "0", "KUBERNETES_SERVICE_HOST": "x"})


def test_launcher_needs_a_command():
    result = shardax("launch", "-n", 2, check=False)
    assert result.returncode == 2 and "nothing to launch" in result.stderr


# Process 1 takes a lock and kills itself; process 0 waits on that lock and aborts 20 ms after the kill,
# as a JAX process does when the coordination service loses a peer. Both are dead when the launcher
# looks, and only the order of their exits says which one failed first.
_DIES_FIRST = """
import fcntl, os, signal, sys, time
index = int(os.environ["SHARDAX_PROCESS_ID"])
lock = open(sys.argv[1], "a")
if index == 1:
    fcntl.flock(lock, fcntl.LOCK_EX)
    open(sys.argv[1] + ".held", "w").close()
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
while not os.path.exists(sys.argv[1] + ".held"):
    time.sleep(0.01)
fcntl.flock(lock, fcntl.LOCK_EX)
time.sleep(0.02)
os.abort()
"""


def test_the_launcher_names_the_process_that_died_first_not_the_lowest_index(tmp_path):
    result = shardax("launch", "-n", 2, "--", sys.executable, "-c", _DIES_FIRST, tmp_path / "lock",
                     check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == "shardax launch: error: process 1 of 2 was killed by SIGKILL"
