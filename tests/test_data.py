"""The byte corpus and its deterministic, resumable batches."""

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.data.batches import WindowSampler, validation_batches
from shardax.data.corpus import default_sources, load_corpus


def test_default_corpus_is_the_standard_library(tmp_path):
    sources = default_sources()
    assert len(sources) > 300 and all(p.suffix == ".py" for p in sources)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in sources)


def test_split_is_by_file_and_stable(small_corpus):
    first, second = load_corpus([small_corpus]), load_corpus([str(small_corpus)])
    assert np.array_equal(first.train, second.train) and np.array_equal(first.validation, second.validation)
    assert first.train.dtype == np.uint8 and first.validation.size > 0
    assert 2.0 < first.unigram_entropy() < np.log(256)


def test_one_file_holds_out_its_tail(tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("abcdefghij" * 100)
    corpus = load_corpus([text])
    assert corpus.train.size + corpus.validation.size >= 1000 and corpus.validation.size >= 100


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(10_000) % 251
    sampler = WindowSampler(tokens.astype(np.uint8), seq_len=16, batch_size=8, seed=3)
    again = WindowSampler(tokens.astype(np.uint8), seq_len=16, batch_size=8, seed=3)
    other = WindowSampler(tokens.astype(np.uint8), seq_len=16, batch_size=8, seed=4)
    assert np.array_equal(sampler.window_ids(57), again.window_ids(57))
    assert not np.array_equal(sampler.window_ids(0), other.window_ids(0))
    per_epoch = sampler.windows // 8
    seen = np.concatenate([sampler.window_ids(step) for step in range(per_epoch)])
    assert len(set(seen.tolist())) == len(seen)  # an epoch visits each window at most once
    rows = sampler.rows(sampler.window_ids(5))
    assert rows.shape == (8, 17) and rows.dtype == np.int32
    for row, window in zip(rows, sampler.window_ids(5)):
        np.testing.assert_array_equal(row, tokens[window * 16 : window * 16 + 17])


def test_global_batch_rows_land_on_their_devices(mesh8):
    tokens = (np.arange(5_000) % 256).astype(np.uint8)
    sampler = WindowSampler(tokens, seq_len=8, batch_size=16, seed=0)
    batch = sampler.global_batch(2, NamedSharding(mesh8, P("data")))["tokens"]
    expected = sampler.rows(sampler.window_ids(2))
    for shard in batch.addressable_shards:
        assert shard.data.shape == (2, 9)
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


def test_too_little_text_for_one_window():
    with pytest.raises(ValueError, match="shorter than one window of `seq_len=64`"):
        WindowSampler(np.zeros(30, np.uint8), seq_len=64, batch_size=4, seed=0)


def test_validation_batches_are_fixed():
    tokens = (np.arange(3_000) % 256).astype(np.uint8)
    first, second = validation_batches(tokens, 16, 4, 3), validation_batches(tokens, 16, 4, 3)
    assert len(first) == 3 and all(np.array_equal(a, b) for a, b in zip(first, second))
