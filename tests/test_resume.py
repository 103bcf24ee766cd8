"""Checkpoints: a run killed with SIGKILL resumes bit-exactly; a checkpoint restores into another layout."""

import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from cli_helpers import QUICK, last_logged_step, read_metrics, sealed, shardax, stalled, subprocess_env

from shardax.trainer.checkpoint import saved_arrays, saved_steps
from shardax.trainer.lock import LOCK_NAME

STEPS = 8
COMMON = (*QUICK, "--steps", STEPS, "--log-every", 1, "--eval-every", 0, "--checkpoint-every", 3)


def final_arrays(directory, step=STEPS):
    return saved_arrays(directory, step)


def run_until_killed(args, metrics, checkpoints, kill_after_step, committed_step):
    """Run ``shardax``, paused after ``kill_after_step``, and SIGKILL it once ``committed_step`` is sealed.

    The pause (tests/workers/stall.py) means no machine, however loaded, reaches the end of the
    run first; checkpoints are written in the background, so the kill also waits for the seal.
    """
    process = subprocess.Popen(stalled(kill_after_step, 3600, "shardax", *args), env=subprocess_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if last_logged_step(metrics) >= kill_after_step and sealed(checkpoints, committed_step):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read()[-2000:]


@pytest.mark.slow
def test_sigkill_between_checkpoints_then_resume_is_bit_exact(small_corpus, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    shardax("train", *COMMON, "--data", small_corpus, "--checkpoint-dir", straight / "ckpt",
            "--metrics", straight / "m.jsonl")
    run_until_killed(["train", *COMMON, "--data", small_corpus, "--checkpoint-dir", killed / "ckpt",
                      "--metrics", killed / "m.jsonl"], killed / "m.jsonl", killed / "ckpt",
                     kill_after_step=4, committed_step=3)
    saved = saved_steps(killed / "ckpt")
    assert saved == [3]  # killed after step 4, between checkpoints
    resumed = shardax("train", *COMMON, "--data", small_corpus, "--checkpoint-dir", killed / "ckpt",
                      "--metrics", killed / "m.jsonl", "--resume")
    assert f"resumed from step {max(saved)}" in resumed.stdout
    expected, got = final_arrays(straight / "ckpt"), final_arrays(killed / "ckpt")
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    straight_losses = [r["loss"] for r in read_metrics(straight / "m.jsonl")]
    assert [r["loss"] for r in read_metrics(killed / "m.jsonl")] == straight_losses  # bit-identical floats


@pytest.mark.slow
def test_checkpoint_from_dp_restores_into_fsdp_tp(small_corpus, tmp_path):
    base = (*QUICK, "--steps", 6, "--log-every", 1, "--eval-every", 0, "--data", small_corpus)
    shardax("train", *base, "--checkpoint-every", 4, "--checkpoint-dir", tmp_path / "dp",
            "--metrics", tmp_path / "dp.jsonl")
    shutil.copytree(tmp_path / "dp", tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "6")  # keep the dp checkpoint of step 4 only
    moved = shardax("train", *base, "--checkpoint-dir", tmp_path / "moved", "--resume", "--strategy",
                    "fsdp_tp", "--mesh", "data=2,model=4", "--metrics", tmp_path / "moved.jsonl")
    assert "resumed from step 4" in moved.stdout and "strategy fsdp_tp" in moved.stdout
    assert ("changed since the checkpoint was saved: strategy dp -> fsdp_tp; mesh data=8 -> data=2,model=4\n"
            in moved.stdout)
    continued = [r["loss"] for r in read_metrics(tmp_path / "moved.jsonl")]
    uninterrupted = [r["loss"] for r in read_metrics(tmp_path / "dp.jsonl")]
    assert len(continued) == 2
    np.testing.assert_allclose(continued, uninterrupted[4:], rtol=1e-5)  # the same run, in another layout
    restored = final_arrays(tmp_path / "moved", 6)
    for key, value in final_arrays(tmp_path / "dp", 6).items():
        np.testing.assert_allclose(restored[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_existing_checkpoints_are_not_overwritten(small_corpus, tmp_path):
    shardax("train", *QUICK, "--steps", 2, "--eval-every", 0, "--data", small_corpus, "--checkpoint-dir",
            tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    result = shardax("train", *QUICK, "--steps", 2, "--data", small_corpus, "--checkpoint-dir", tmp_path,
                     check=False)
    assert (result.returncode == 2
            and "already holds checkpoints (latest step 2); pass --resume" in result.stderr)
    result = shardax("train", *QUICK, "--steps", 2, "--data", small_corpus, "--checkpoint-dir", tmp_path,
                     "--resume", "--preset", "small", check=False)
    assert (result.returncode == 2
            and "--preset small contradicts the checkpoint's --preset tiny" in result.stderr)
    result = shardax("train", *QUICK, "--data", small_corpus, "--checkpoint-dir", tmp_path, "--resume",
                     check=False)
    assert (result.returncode == 2
            and "is complete at step 2; to train it further, pass --extend-to N" in result.stderr)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")
            if p.is_file() and p.name != LOCK_NAME} == before


def test_a_checkpoint_of_shardax_0_1s_gpt_shaped_preset_is_refused_in_one_line():
    """A run of the ``tiny`` preset saved by shardax 0.1 (layer norms, a GELU MLP of width 512, bytes
    embedded without the end-of-document token) cannot resume into today's Llama-shaped ``tiny``:
    one line names what the checkpoint holds, what this shardax builds, and the two ways on."""
    import dataclasses

    from shardax.errors import UsageError
    from shardax.lm import job
    from shardax.lm.config import resolve
    from shardax.lm.settings import TrainConfig

    run = resolve(TrainConfig.of(data=["corpus"]))
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=320))
    old = {**dataclasses.asdict(run.model), "norm": "layer", "mlp": "gelu", "d_ff": 512, "vocab_size": 256}
    config = TrainConfig.of(checkpoint_dir="runs/old/checkpoints", resume=True)
    with pytest.raises(UsageError) as refused:
        job._check_same_model({"model": old}, run, 500, config)
    assert str(refused.value) == (
        "the checkpoint at step 500 in runs/old/checkpoints holds a model with vocab_size 256, d_ff 512, "
        "norm layer, mlp gelu, where this shardax builds vocab_size 320, d_ff 344, norm rms, mlp swiglu "
        "(since 0.2 every preset is Llama-shaped, and byte-level runs embed the end-of-document token); "
        "start a new run (without --resume), or resume this one with the shardax that wrote it (0.1)")
    # may change
    job._check_same_model({"model": {**dataclasses.asdict(run.model), "remat": "full"}}, run, 500, config)
