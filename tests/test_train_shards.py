"""``shardax train`` on token shards: BPE end to end, resume and two processes reading the same batches."""

import shutil

import numpy as np
import pytest
from cli_helpers import QUICK, read_metrics, shardax

from shardax.trainer.checkpoint import saved_arrays, saved_steps

pytestmark = pytest.mark.xdist_group("test_train_shards")

RUN = (*QUICK, "--steps", 4, "--log-every", 1, "--eval-every", 2, "--eval-batches", 2)


@pytest.fixture(scope="module")
def bpe_shards(small_corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe_shards")
    result = shardax("prepare", small_corpus, "--out", folder / "shards", "--tokenizer", "bpe",
                     "--vocab-size", 300)
    assert "bpe (trained, vocabulary 300) tokens (new)" in result.stdout
    return folder / "shards"


@pytest.mark.slow
def test_bpe_run_follows_the_tokenizer_and_resumes_exactly(bpe_shards, tmp_path):
    straight = shardax("train", *RUN, "--data", bpe_shards, "--checkpoint-every", 2, "--checkpoint-dir",
                       tmp_path / "straight", "--metrics", tmp_path / "straight.jsonl")
    assert "bpe (trained, vocabulary 300) tokens" in straight.stdout and "x 32 tokens" in straight.stdout
    assert "sample (temperature 0.7, top-k 10, seed 0" in straight.stdout
    arrays = saved_arrays(tmp_path / "straight", 4)
    embedding = next(value for key, value in arrays.items() if "embedding" in key and "opt" not in key)
    assert embedding.shape[0] == 320  # the tokenizer's 300, padded to a multiple of 64
    evaluated = [r for r in read_metrics(tmp_path / "straight.jsonl") if "val_loss" in r]
    assert len(evaluated) == 2
    for record in evaluated:  # nats per token, and the same in bits per token and per byte of text
        assert record["val_bits_per_token"] == pytest.approx(record["val_loss"] / np.log(2), rel=1e-5)
        assert (0.25 * record["val_bits_per_token"] < record["val_bits_per_byte"]
                < 0.95 * record["val_bits_per_token"])

    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "4")  # as if stopped after the checkpoint of step 2
    assert saved_steps(tmp_path / "cut") == [2]
    resumed = shardax("train", *RUN, "--data", bpe_shards, "--checkpoint-every", 2, "--checkpoint-dir",
                      tmp_path / "cut", "--metrics", tmp_path / "resumed.jsonl", "--resume")
    assert "resumed from step 2" in resumed.stdout
    expected, got = saved_arrays(tmp_path / "straight", 4), saved_arrays(tmp_path / "cut", 4)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight.jsonl") if "loss" in r}
    assert ([r["loss"] for r in read_metrics(tmp_path / "resumed.jsonl") if "loss" in r]
            == [losses[3], losses[4]])


@pytest.mark.slow
def test_two_processes_read_the_batches_of_one(bpe_shards, tmp_path):
    args = (*QUICK, "--steps", 3, "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0, "--data",
            bpe_shards)
    shardax("train", *args, "--metrics", tmp_path / "one.jsonl")
    shardax("launch", "-n", 2, "--devices-per-process", 4, "--", "shardax", "train", *args,
            "--metrics", tmp_path / "two.jsonl")
    one = [r["loss"] for r in read_metrics(tmp_path / "one.jsonl")]
    two = [r["loss"] for r in read_metrics(tmp_path / "two.jsonl")]
    assert len(one) == 3
    np.testing.assert_allclose(two, one, rtol=1e-5)


@pytest.mark.parametrize("tokenizer", [("bytes",), ("bpe", "--vocab-size", "300")], ids=["bytes", "bpe"])
@pytest.mark.slow
def test_train_tokenizes_raw_text_once_into_its_cache(small_corpus, tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("SHARDAX_DATA_CACHE", str(tmp_path / "cache"))
    args = ("train", *QUICK, "--steps", 1, "--eval-every", 0, "--data", small_corpus, "--tokenizer",
            *tokenizer, "--sample-temperature", "1.5", "--sample-top-k", "5")
    first = shardax(*args)
    assert f"{tokenizer[0]}" in first.stdout and "tokens" in first.stdout, first.stdout
    assert "temperature 1.5, top-k 5" in first.stdout, first.stdout
    prepared = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(prepared) == 1 and (prepared[0] / "index.json").is_file()
    written = (prepared[0] / "index.json").stat().st_mtime_ns
    shardax(*args)
    assert (prepared[0] / "index.json").stat().st_mtime_ns == written  # the second run prepared nothing
