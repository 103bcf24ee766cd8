"""Runs that survive: resume restores the run, non-finite steps never reach a checkpoint, damaged
checkpoints are detected and passed over, a failed write is one line, preemption checkpoints and
resumes bit for bit."""

import hashlib
import json
import math
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from cli_helpers import QUICK, WORKERS, last_logged_step, read_metrics, shardax, stalled, subprocess_env
from user_models import DropoutMLP, classification_loss, on_host, vector_batches

from shardax import Trainer
from shardax.cli import main, signals
from shardax.errors import NonFiniteError, Stopped
from shardax.trainer import manifest
from shardax.trainer.checkpoint import saved_arrays, saved_steps
from shardax.trainer.lock import LOCK_NAME
from shardax.trainer.preemption import StopSignals

pytestmark = pytest.mark.xdist_group("test_survival")

BATCHES = list(vector_batches(8, seed=11))


def trainer():
    return Trainer(DropoutMLP, optax.adamw(1e-2), classification_loss, strategy="fsdp")


def files_of(folder):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}  # the lock is taken (and let go) by each run that checks


# -- resume restores the run ---------------------------------------------------------------------------------

LM = (*QUICK, "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0)


@pytest.fixture(scope="module")
def saved_lm_run(small_corpus, tmp_path_factory):
    """A run of 4 steps with seed 3, checkpointed at 2 and 4; --data given relative to the directory
    it was started in (the resumes below run elsewhere and must read the same data)."""
    folder = tmp_path_factory.mktemp("lm")
    here = os.getcwd()
    os.chdir(small_corpus.parent)
    try:
        assert main(list(map(str, ["train", *LM, "--steps", 4, "--seed", 3, "--data", small_corpus.name,
                                   "--checkpoint-every", 2, "--checkpoint-dir", folder / "ckpt", "--metrics",
                                   folder / "m.jsonl"]))) == 0
    finally:
        os.chdir(here)
    return folder


@pytest.mark.parametrize("flag, value, message", [
    ("--seed", 1, "--seed 1 contradicts the checkpoint's --seed 3"),
    ("--batch-size", 8, "--batch-size 8 contradicts the checkpoint's --batch-size 16"),
    ("--lr", 0.01, "--lr 0.01 contradicts the checkpoint's --lr"),
    ("--seq-len", 64, "--seq-len 64 contradicts the checkpoint's --seq-len 32"),
    ("--steps", 10,
     "--steps 10 contradicts the checkpoint's --steps 4 (its schedule's length); to train on past "
     "step 4, use --extend-to 10"),
    ("--data", "/tmp", "--data /tmp contradicts the checkpoint's --data"),
])
@pytest.mark.slow
def test_resume_refuses_flags_that_contradict_the_saved_run(saved_lm_run, flag, value, message, capsys):
    before = files_of(saved_lm_run)
    args = ["train", *LM, "--checkpoint-dir", saved_lm_run / "ckpt", "--resume", flag, value]
    assert main(list(map(str, args))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert files_of(saved_lm_run) == before


@pytest.mark.slow
def test_resume_takes_seed_data_and_schedule_from_the_checkpoint(saved_lm_run, small_corpus, tmp_path):
    """Resumed from step 2 with no run flags at all: the seed-3 run's steps 3 and 4, bit for bit."""
    for name in ("ckpt", "m.jsonl"):
        os.system(f"cp -r {saved_lm_run / name} {tmp_path / name}")
    os.system(f"rm -r {tmp_path / 'ckpt' / '4'}")
    assert main(list(map(str, ["train", *QUICK[:2], "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0,
                               "--checkpoint-dir", tmp_path / "ckpt", "--metrics", tmp_path / "m.jsonl",
                               "--resume", "--strategy", "fsdp"]))) == 0
    expected = [r["loss"] for r in read_metrics(saved_lm_run / "m.jsonl")]
    np.testing.assert_allclose([r["loss"] for r in read_metrics(tmp_path / "m.jsonl")], expected, rtol=1e-5)


def test_extend_to_continues_a_finished_run_at_the_final_learning_rate(saved_lm_run, tmp_path, capsys):
    os.system(f"cp -r {saved_lm_run / 'ckpt'} {tmp_path / 'ckpt'}")
    args = ["train", *QUICK[:2], "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0,
            "--checkpoint-dir", tmp_path / "ckpt", "--metrics", tmp_path / "m.jsonl", "--resume"]
    assert main(list(map(str, args))) == 2
    assert "is complete at step 4; to train it further, pass --extend-to N" in capsys.readouterr().err
    assert main(list(map(str, [*args, "--extend-to", 6]))) == 0
    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [5, 6]
    peak = 3e-3  # the tiny preset's
    assert all(math.isclose(r["lr"], peak / 10, rel_tol=1e-6) for r in records)  # the schedule's end value
    assert saved_steps(tmp_path / "ckpt")[-1] == 6


# -- non-finite steps ----------------------------------------------------------------------------------------

def poisoned(at):
    """BATCHES with a NaN in the inputs of step ``at`` (1-based)."""
    batches = [dict(batch) for batch in BATCHES]
    batches[at - 1]["inputs"] = np.full_like(batches[at - 1]["inputs"], np.nan)
    return batches


def test_a_nan_step_stops_the_run_and_the_last_good_checkpoint_is_kept(tmp_path):
    run = trainer()
    with pytest.raises(NonFiniteError,
                       match=r"^step 5: the loss or gradient norm is NaN or infinite.*the last "
                             r"good checkpoint is step 4 in"):
        run.fit(poisoned(5), steps=8, log_every=3, checkpoint_every=2, checkpoint_dir=tmp_path)
    assert saved_steps(tmp_path) == [2, 4]  # step 6 (a frozen state after the bad step) was never written
    clean = trainer()
    clean.fit(BATCHES[:4], steps=4)
    # the state the run stopped with is the state after step 4: nothing from step 5 on was applied
    state = on_host(run.state)
    jax.tree.map(np.testing.assert_array_equal, state.params, on_host(clean.state).params)
    np.testing.assert_array_equal(saved_arrays(tmp_path, 4)["params.hidden.kernel"],
                                  state.params["hidden"]["kernel"])


@pytest.mark.slow
def test_shardax_train_stops_a_diverging_run_with_one_line_and_exit_code_4(small_corpus, tmp_path):
    """A learning rate of 1e30 overflows the parameters within a few steps: the command line says
    which step went non-finite and where the last good checkpoint is, in one line, and exits 4."""
    result = shardax("train", *LM, "--steps", 6, "--lr", "1e30", "--data", small_corpus, "--checkpoint-every",
                     1, "--checkpoint-dir", tmp_path / "ckpt", check=False)
    assert result.returncode == 4, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    bad = int(re.search(r"^shardax train: error: step (\d+): the loss or gradient norm is NaN or infinite",
                        lines[0]).group(1))
    assert f"the last good checkpoint is step {bad - 1} in" in lines[0]
    assert saved_steps(tmp_path / "ckpt")[-1] == bad - 1


def test_skip_mode_drops_the_bad_update_and_counts_it():
    run = trainer()
    result = run.fit(poisoned(3), steps=8, log_every=1, on_nonfinite="skip")
    assert [r["skipped_steps"] for r in result.history] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert result.history[2]["loss"] is None  # NaN, written as null
    clean = trainer()
    # the same updates, without the bad batch
    clean.fit([b for i, b in enumerate(BATCHES) if i != 2], steps=7)
    jax.tree.map(np.testing.assert_array_equal, on_host(run.state).params, on_host(clean.state).params)
    jax.tree.map(np.testing.assert_array_equal, on_host(run.state).opt_state, on_host(clean.state).opt_state)


# -- damaged checkpoints -------------------------------------------------------------------------------------

def damage_largest_file(directory, how):
    files = sorted((p for p in directory.rglob("*") if p.is_file() and p.name != "shardax_manifest.json"),
                   key=lambda p: p.stat().st_size)
    target = files[-1]
    if how == "missing":
        target.unlink()
    elif how == "truncated":
        os.truncate(target, target.stat().st_size // 2)
    elif how == "zeroed":
        target.write_bytes(bytes(target.stat().st_size))
    elif how == "unsealed":
        (directory / "shardax_manifest.json").unlink()
    elif how == "unlisted":  # orbax's own metadata gone: orbax no longer lists the step at all
        (directory / "_CHECKPOINT_METADATA").unlink()
    return target


@pytest.mark.parametrize("how", ["missing", "truncated", "zeroed", "unsealed", "unlisted"])
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(how, tmp_path, capsys):
    straight = trainer().fit(BATCHES, steps=6, log_every=1)
    trainer().fit(BATCHES, steps=6, log_every=1, checkpoint_every=2, checkpoint_dir=tmp_path)
    damage_largest_file(tmp_path / "6", how)
    capsys.readouterr()
    resumed = trainer().fit(BATCHES, steps=6, log_every=1, checkpoint_dir=tmp_path, resume=True)
    out = capsys.readouterr().out
    assert f"checkpoint step 6 in {tmp_path} is damaged (" in out and "resuming from step 4" in out
    assert resumed.start_step == 4 and (tmp_path / "6.damaged").is_dir()
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history[4:]]
    jax.tree.map(np.testing.assert_array_equal, on_host(resumed.state), on_host(straight.state))


def test_a_torn_last_metrics_line_is_dropped_on_resume_with_a_note(tmp_path, capsys):
    first = trainer()
    first.fit(BATCHES, steps=4, log_every=1, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
              metrics=str(tmp_path / "m.jsonl"))
    text = (tmp_path / "m.jsonl").read_text()
    (tmp_path / "m.jsonl").write_text(text + '{"step": 5, "lo')  # a crash mid-append
    capsys.readouterr()
    trainer().fit(BATCHES, steps=6, log_every=1, checkpoint_dir=str(tmp_path / "ckpt"), resume=True,
                  metrics=str(tmp_path / "m.jsonl"))
    assert "its last line was cut off mid-write (15 bytes" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5, 6]
    (tmp_path / "m.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(Exception, match=r"m.jsonl line 2 is not a JSON record; move the file aside"):
        trainer().fit(BATCHES, steps=8, checkpoint_dir=str(tmp_path / "ckpt"), resume=True,
                      metrics=str(tmp_path / "m.jsonl"))


def sealed_folder(folder, monkeypatch):
    """Files as two processes and the committing one leave them, sealed in blocks of 1 KiB."""
    monkeypatch.setattr(manifest, "BLOCK", 1024)
    (folder / "state" / "ocdbt.process_1").mkdir(parents=True)
    (folder / "state" / "ocdbt.process_1" / "data").write_bytes(os.urandom(5000))  # 5 blocks
    (folder / "state" / "ocdbt.process_0.orbax-checkpoint-tmp").mkdir()
    (folder / "state" / "ocdbt.process_0.orbax-checkpoint-tmp" / "data").write_bytes(os.urandom(3000))
    (folder / "record").write_text("{}")
    (folder / "_CHECKPOINT_METADATA").write_text("{}")  # orbax's own, written as the checkpoint is committed
    manifest.seal_part(folder, 1)
    manifest.seal_part(folder, 0)
    (folder / "state" / "ocdbt.process_0.orbax-checkpoint-tmp").rename(folder / "state" / "ocdbt.process_0")
    manifest.seal(folder, 0)
    return json.loads((folder / manifest.MANIFEST).read_text())["files"]


def test_each_process_seals_what_it_wrote_and_checking_is_shared(tmp_path, monkeypatch):
    files = sealed_folder(tmp_path, monkeypatch)
    assert {name: (entry["by"], len(entry["blocks"])) for name, entry in files.items()} == {
        "record": (0, 1), "state/ocdbt.process_0/data": (0, 3), "state/ocdbt.process_1/data": (1, 5)}
    assert not list(tmp_path.glob("shardax_manifest.process_*"))  # merged into the manifest
    assert [manifest.damage(tmp_path, (i, 2)) for i in (0, 1)] == [None, None]
    target = tmp_path / "state" / "ocdbt.process_1" / "data"
    data = bytearray(target.read_bytes())
    # its 4th block: unit 7 of 0..8 (record, process 0's 3 blocks, then this file's 5)
    data[3 * 1024 + 5] ^= 1
    target.write_bytes(bytes(data))
    alone = [manifest.damage(tmp_path, (i, 2)) for i in (0, 1)]  # each process hashes every other unit
    assert alone == [None, "state/ocdbt.process_1/data changed since it was sealed"]
    firsts = []
    found = [manifest.damage(tmp_path, (i, 2), agree=lambda first: firsts.append(first) or 7) for i in (0, 1)]
    assert firsts == [-1, 7] and found == ["state/ocdbt.process_1/data changed since it was sealed"] * 2


def test_an_intact_checkpoint_is_hashed_once_until_its_files_change(tmp_path, monkeypatch):
    sealed_folder(tmp_path, monkeypatch)
    assert manifest.damage(tmp_path) is None
    monkeypatch.setattr(manifest, "_digest", lambda *args: pytest.fail("hashed again"))
    assert manifest.damage(tmp_path) is None
    monkeypatch.undo()
    monkeypatch.setattr(manifest, "BLOCK", 1024)
    target = tmp_path / "record"
    target.write_text("[]")  # the same size, written again
    assert manifest.damage(tmp_path) == "record changed since it was sealed"


def test_a_checkpoint_sealed_before_blocks_is_still_checked(tmp_path):
    (tmp_path / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / manifest.MANIFEST).write_text(json.dumps(
        {"files": {"a": {"bytes": 100, "sha256": hashlib.sha256(b"x" * 100).hexdigest()}}}))
    assert manifest.damage(tmp_path) is None
    (tmp_path / "a").write_bytes(b"y" * 100)
    assert manifest.damage(tmp_path) == "a changed since it was sealed"


def test_a_damaged_checkpoint_that_cannot_be_set_aside_is_one_line(tmp_path, monkeypatch):
    """The rename fails as on a read-only filesystem (tests run as root, which chmod does not stop)."""
    import errno
    import pathlib

    trainer().fit(BATCHES, steps=4, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    damage_largest_file(tmp_path / "ckpt" / "4", "truncated")

    def read_only(self, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(pathlib.Path, "rename", read_only)
    with pytest.raises(Exception) as error:
        trainer().fit(BATCHES, steps=6, checkpoint_dir=str(tmp_path / "ckpt"), resume=True)
    assert str(error.value) == (f"checkpoint of step 4 in {tmp_path / 'ckpt'} is damaged and cannot be set "
                                "aside as 4.damaged (Read-only file system); resume from a writable copy of "
                                "the directory, or remove that step yourself")
    monkeypatch.undo()
    assert saved_steps(tmp_path / "ckpt") == [2, 4]


def test_no_good_checkpoint_is_a_clear_error_and_nothing_is_loaded(tmp_path):
    trainer().fit(BATCHES, steps=4, checkpoint_every=2, checkpoint_dir=tmp_path, keep_checkpoints=2)
    for step in (2, 4):
        damage_largest_file(tmp_path / str(step), "zeroed")
    before = files_of(tmp_path)
    with pytest.raises(ValueError,
                       match=r"no good checkpoint in .*step 4 is damaged \(.*\); step 2 is damaged"):
        trainer().fit(BATCHES, steps=6, checkpoint_dir=tmp_path, resume=True)
    assert files_of(tmp_path) == before


def test_keep_checkpoints_keeps_the_latest(tmp_path):
    trainer().fit(BATCHES, steps=8, checkpoint_every=1, checkpoint_dir=tmp_path, keep_checkpoints=2)
    assert saved_steps(tmp_path) == [7, 8]


def limit_file_size(limit):
    """A process whose writes past ``limit`` bytes fail with EFBIG, as writes to a full disk fail."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
@pytest.mark.parametrize("more, failing", [(("--extend-to", 4), 4),
                                           (("--extend-to", 5, "--checkpoint-every", 1), 3)],
                         ids=["at-the-end", "in-the-background"])
def test_a_write_that_fails_is_one_line_and_earlier_checkpoints_stay(small_corpus, tmp_path, more, failing):
    """A write that fails in the background is named by its own step, not by the next save's."""
    run = ["train", *LM, "--steps", 2, "--data", small_corpus, "--checkpoint-dir", tmp_path / "ckpt"]
    shardax(*run)
    before = files_of(tmp_path / "ckpt")
    env = dict(subprocess_env(), JAX_ENABLE_COMPILATION_CACHE="false")
    failed = subprocess.run([sys.executable, "-m", "shardax.cli", *map(str, run), "--resume",
                             *map(str, more)],
                            capture_output=True, text=True, timeout=300, env=env,
                            preexec_fn=limit_file_size(4096))
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines() == [
        f"shardax train: error: could not write the checkpoint of step {failing} to {tmp_path / 'ckpt'} "
        "(File too large); the checkpoints already there are intact (steps [2]); free space or choose "
        "another checkpoint directory"]
    step_2 = tmp_path / "ckpt" / "2"
    assert files_of(step_2) == {p: v for p, v in before.items() if step_2 in p.parents}


# -- preemption ----------------------------------------------------------------------------------------------

PREEMPTIBLE = (*LM, "--steps", 8, "--checkpoint-every", 100)


@pytest.mark.slow
def test_one_run_writes_a_checkpoint_directory_and_a_dead_runs_lock_is_taken_over(small_corpus, tmp_path):
    """A second run into a directory a live run writes is refused in one line naming the holder,
    and writes nothing; once the holder is killed, a new run takes the lock over and says so."""
    checkpoints = tmp_path / "ckpt"
    common = ["train", *LM, "--steps", 4, "--data", small_corpus, "--checkpoint-dir", checkpoints]
    first = subprocess.Popen(stalled(1, 240, "shardax", *common, "--metrics", tmp_path / "first.jsonl"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        deadline = time.time() + 240
        while (time.time() < deadline and first.poll() is None
               and last_logged_step(tmp_path / "first.jsonl") < 1):
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()[-2000:]
        for extra in ([], ["--resume"]):
            second = shardax(*common, "--seed", 5, "--metrics", tmp_path / "second.jsonl", *extra,
                             check=False)
            assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-2000:]
            line = second.stderr.strip().splitlines()[-1]
            assert (f"{checkpoints} is being written by another run (host " in line
                    and f"pid {first.pid}," in line)
            assert not (tmp_path / "second.jsonl").exists()
    finally:
        first.kill()
        first.communicate(timeout=60)
    taken = shardax(*common, "--seed", 5, "--metrics", tmp_path / "second.jsonl")
    assert f"took over the lock of {checkpoints} that a run which is no longer running left" in taken.stdout
    assert f"pid {first.pid}" in taken.stdout and saved_steps(checkpoints) == [4]
    assert (checkpoints / ".shardax-lock").read_text() == ""  # let go when the run ended


def preempt(command, metrics, at_step, sig, launcher_lines=None):
    """Run ``command`` (paused after ``at_step``), send ``sig`` once that step is logged, return the
    result."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and last_logged_step(metrics) < at_step:
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read()[-2000:]
    process.send_signal(sig)
    out, err = process.communicate(timeout=240)
    return process.returncode, out, err


@pytest.fixture(scope="module")
def one_process_run(small_corpus, tmp_path_factory):
    """An uninterrupted run of the preemptible job in one process: what a stopped run must end as."""
    straight = tmp_path_factory.mktemp("straight")
    shardax("train", *PREEMPTIBLE, "--data", small_corpus, "--checkpoint-dir", straight / "ckpt",
            "--metrics", straight / "m.jsonl")
    return straight


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_after_a_checkpoint_and_the_resumed_run_is_bit_identical(sig, one_process_run,
                                                                                 small_corpus, tmp_path):
    straight, stopped = one_process_run, tmp_path / "stopped"
    run = ["train", *PREEMPTIBLE, "--data", small_corpus, "--run-dir", stopped]
    code, out, err = preempt(stalled(3, 120, "shardax", *run), stopped / "metrics.jsonl", 3, sig)
    assert code == 75, err[-2000:]
    assert f"stopped by {sig.name} after step 3: checkpoint of step 3 in {stopped / 'checkpoints'}" in out
    assert saved_steps(stopped / "checkpoints") == [3]
    # the command the run printed, as is
    [command] = re.findall(r"^to resume: (shardax train .*)$", out, re.M)
    assert command == f"shardax train --run-dir {stopped} --resume"
    resumed = shardax(*shlex.split(command)[1:])
    assert "resumed from step 3" in resumed.stdout
    losses = [r["loss"] for r in read_metrics(straight / "m.jsonl")]
    assert [r["loss"] for r in read_metrics(stopped / "metrics.jsonl")] == losses
    expected, got = saved_arrays(straight / "ckpt", 8), saved_arrays(stopped / "checkpoints", 8)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


@pytest.fixture
def command_line_signals():
    """The command line's stop handlers installed, as ``shardax`` installs them; the test's own after."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signals.install()
    try:
        yield
    finally:
        signals.finish()
        for number, handler in previous.items():
            signal.signal(number, handler)


class SignalledInItsFinalizer:
    def __init__(self, sig):
        self.sig = sig

    def __del__(self):
        signal.raise_signal(self.sig)


def swallowed_signal(sig=signal.SIGTERM):
    """``sig`` arrives while a finalizer runs (as JAX's garbage-collection hook does, often): the
    exception the handler raises there is lost."""
    SignalledInItsFinalizer(sig)


def test_a_stop_swallowed_before_training_is_honoured_as_the_trainer_takes_the_signals(
        command_line_signals, monkeypatch):
    monkeypatch.setattr(signals, "RETRY_S", 3600.0)  # only the hand-over here
    swallowed_signal()
    assert signals.received == ["SIGTERM"]
    with pytest.raises(Stopped, match="stopped by SIGTERM"):
        with StopSignals():
            pytest.fail("training began after a stop signal")
    assert signal.getsignal(signal.SIGTERM) is signals._stop  # nothing was installed
    with StopSignals() as stops:  # handed over once
        assert stops.received is None


def test_a_stop_swallowed_anywhere_is_raised_again_within_seconds(command_line_signals, monkeypatch, capfd):
    monkeypatch.setattr(signals, "RETRY_S", 0.1)
    swallowed_signal()
    assert signals.received == ["SIGTERM"] and capfd.readouterr().err == ""  # no traceback of it either
    start = time.monotonic()
    with pytest.raises(Stopped, match="stopped by SIGTERM"):  # (raised again, not a second signal: no exit)
        while time.monotonic() - start < 20:  # the command goes on, in Python
            sum(range(1000))
    signals.finish()  # the command ends by it
    assert time.monotonic() - start < 10
    signals.install()  # the next command: where JAX starts, a signal waits, and is raised as that ends
    slept = []
    with pytest.raises(Stopped, match="stopped by SIGINT"):
        with signals.deferred():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.5)
            slept.append(True)
    signals.finish()
    assert slept


# how a run signalled at each moment ends: (exit code, the line it ends with, the checkpoints left)
AT_EACH_MOMENT = {
    "before-jax": ("stopped", "stopped by {sig} before training began: this run wrote nothing", []),
    "swallowed": ("stopped", "stopped by {sig} before training began: this run wrote nothing", []),
    "restore": (75, "stopped by {sig} after step 3: checkpoint of step 3 in {ckpt}; resume from it to go on",
                [2, 3]),
    "first-step": (75,
                   "stopped by {sig} after step 1: checkpoint of step 1 in {ckpt}; resume from it to go on",
                   [1]),
    "final-save": (75,
                   "stopped by {sig} after step 3: checkpoint of step 3 in {ckpt}; resume from it to go on",
                   [3]),
}


# Each moment with one of the two signals, each signal at moments of both endings (the shell's
# code before training, 75 after a step): the handler is the same for both, only the code differs.
SIGNAL_AT = {"before-jax": signal.SIGINT, "swallowed": signal.SIGTERM, "restore": signal.SIGINT,
             "first-step": signal.SIGTERM, "final-save": signal.SIGINT}


@pytest.mark.slow
@pytest.mark.parametrize("moment, sig", list(SIGNAL_AT.items()),
                         ids=[f"{moment}-{sig.name}" for moment, sig in SIGNAL_AT.items()])
def test_a_signal_at_any_moment_ends_the_run_in_one_line_with_its_code(moment, sig, small_corpus, tmp_path):
    """SIGINT or SIGTERM before JAX starts, while a checkpoint is restored, as the first step
    compiles, or while the last checkpoint is written: one line and the documented exit code
    (75 where a step could be finished and saved, else the shell's 130/143), never a crash or a
    traceback, never ignored; every committed checkpoint stays restorable."""
    run = tmp_path / "run"
    command = ["train", *LM, "--data", small_corpus, "--run-dir", run, "--checkpoint-every", 100]
    if moment == "restore":
        shardax(*command, "--steps", 2)
        command += ["--steps", 2, "--resume", "--extend-to", 3]
    else:
        command += ["--steps", 3]
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, str(WORKERS / "pause.py"), moment, str(ready), "shardax",
                                *map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env())
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and not ready.exists():
        time.sleep(0.02)
    assert process.poll() is None, process.stderr.read()[-2000:]
    process.send_signal(sig)
    out, err = process.communicate(timeout=240)
    code, line, kept = AT_EACH_MOMENT[moment]
    line = line.format(sig=sig.name, ckpt=run / "checkpoints")
    assert process.returncode == (128 + sig if code == "stopped" else code), err[-2000:]
    assert "Traceback" not in err and "Fatal" not in err and "Segmentation" not in err, err[-2000:]
    assert line in (err.strip().splitlines()[-1] if code == "stopped" else out), (out[-1500:], err[-1500:])
    if not kept:  # nothing written at all
        assert not run.exists()
        return
    assert saved_steps(run / "checkpoints") == kept
    for step in kept:  # committed, and restorable as they are
        assert saved_arrays(run / "checkpoints", step)["step"] == step


@pytest.fixture(scope="module")
def two_process_run(small_corpus, tmp_path_factory):
    """An uninterrupted 2 x 4 run of the preemptible job: what every stopped run must end as."""
    straight = tmp_path_factory.mktemp("straight")
    shardax(*TWO_PROCESSES, "shardax", "train", *PREEMPTIBLE, "--data", small_corpus, "--strategy", "fsdp_tp",
            "--checkpoint-dir", straight / "ckpt", "--metrics", straight / "m.jsonl")
    return straight


TWO_PROCESSES = ("launch", "-n", 2, "--devices-per-process", 4, "--")


@pytest.mark.slow
@pytest.mark.parametrize("target, sig", [("process 1", signal.SIGTERM), ("the launcher", signal.SIGINT)])
def test_a_signal_to_a_two_process_run_stops_both_at_the_same_step(two_process_run, small_corpus, tmp_path,
                                                                   target, sig):
    """SIGTERM to one process (JAX's preemption service tells the other), or Ctrl-C to the launcher
    (passed on to both): every process saves the same step and exits 75, as does the launcher,
    and the resumed run ends bit-identical to one never stopped."""
    straight, stopped, release = two_process_run, tmp_path / "stopped", tmp_path / "release"
    run = ["train", *PREEMPTIBLE, "--data", small_corpus, "--strategy", "fsdp_tp"]
    command = [sys.executable, "-m", "shardax.cli", *map(str, TWO_PROCESSES),
               *stalled(3, 600, "shardax", *run, "--checkpoint-dir", stopped / "ckpt", "--metrics",
                        stopped / "m.jsonl")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**subprocess_env(), "STALL_RELEASE": str(release)})
    deadline = time.time() + 240
    while time.time() < deadline and last_logged_step(stopped / "m.jsonl") < 3:
        time.sleep(0.05)
    line = process.stdout.readline()
    while not line.startswith("[launch] process 1:"):
        line = process.stdout.readline()
    os.kill(int(line.split("pid")[1]) if target == "process 1" else process.pid, sig)
    # Both processes wait after step 3 until released; the notice reaches JAX's preemption
    # service within milliseconds, so it is known before either asks whether to stop at step 3.
    time.sleep(2)
    release.touch()
    out, err = process.communicate(timeout=240)
    assert process.returncode == 75, (out + err)[-3000:]
    assert "[0] stopped by SIGTERM after step 3: checkpoint of step 3" in out, out[-3000:]
    assert "every process stopped after a checkpoint" in out
    assert saved_steps(stopped / "ckpt") == [3]
    shardax(*TWO_PROCESSES, "shardax", *run, "--checkpoint-dir", stopped / "ckpt", "--metrics",
            stopped / "m.jsonl", "--resume")
    losses = [r["loss"] for r in read_metrics(straight / "m.jsonl")]
    assert [r["loss"] for r in read_metrics(stopped / "m.jsonl")] == losses
    expected, got = saved_arrays(straight / "ckpt", 8), saved_arrays(stopped / "ckpt", 8)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
