"""Language-model data at scale: ``prepare`` writes token shards, training reads them lazily and packs
documents, attention never crosses a document, the order is a function of (data, seed, step)."""

import json
import os
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardax.data import documents
from shardax.data.prepare import is_validation, prepare
from shardax.data.shards import PackedBatches, PreparedData, TokenStream, packed, validation_rows
from shardax.data.tokenizer import ByteTokenizer, load_tokenizer
from shardax.errors import UsageError
from shardax.lm.config import resolve
from shardax.lm.job import loop_note
from shardax.lm.sampling import sample_tokens, vocabulary, word_share
from shardax.lm.settings import TrainConfig
from shardax.models.transformer import TransformerConfig, TransformerLM, token_losses
from shardax.trainer.trainer import Trainer


def documents_of(seed: int, count: int) -> list[str]:
    """Documents of every length, with non-ASCII text, that a hash splits both ways."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "délta", "εψιλον", "zeta", "η", "theta", "\n", "    ", "()", "=="]
    return [" ".join(rng.choice(words, rng.integers(1, 60))) + f" #{seed}-{i}" for i in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text files (a document each), JSON lines and Parquet (a document per line / row)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    root = tmp_path_factory.mktemp("lm_corpus")
    texts = documents_of(0, 30)
    for i, text in enumerate(texts[:10]):
        (root / f"file{i:02d}.txt").write_text(text)
    with open(root / "lines.jsonl", "w") as handle:
        for i, text in enumerate(texts[10:20]):
            handle.write(json.dumps({"id": i, "text": text}) + "\n")
    pq.write_table(pa.table({"text": texts[20:], "n": list(range(10))}), root / "rows.parquet",
                   row_group_size=4)
    return root, texts


def split_documents(data: PreparedData, split: str) -> list[str]:
    """Every document of a split, decoded from its shards through the index's offsets."""
    found = []
    for shard in data.index["splits"][split]["shards"]:
        tokens = np.fromfile(data.root / f"{shard['name']}.tokens", data.index["dtype"])
        offsets = np.load(data.root / f"{shard['name']}.docs.npy")
        assert len(offsets) == shard["documents"] + 1 and offsets[-1] == tokens.size == shard["tokens"]
        for start, end in zip(offsets[:-1], offsets[1:]):
            assert tokens[start] == data.eod_id
            found.append(data.tokenizer.decode(tokens[start + 1 : end]))
    return found


def test_prepare_writes_every_document_once_split_by_a_hash_of_its_text(corpus, tmp_path):
    root, texts = corpus
    done = prepare([root], tmp_path / "shards", show_progress=False)
    data = PreparedData(done.root)
    train, validation = split_documents(data, "train"), split_documents(data, "validation")
    assert sorted(train + validation) == sorted(texts)
    assert validation and all(is_validation(t, 0.05) for t in validation)
    assert not set(train) & set(validation)
    counts = done.index["splits"]
    assert counts["train"]["bytes"] + counts["validation"]["bytes"] == sum(len(t.encode()) + 1 for t in texts)
    assert data.tokenizer.vocab_size == 257 and data.eod_id == 256


def test_parallel_prepare_writes_the_same_shards_as_one_process(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    monkeypatch.setattr(documents, "UNIT_BYTES", 2000)  # several units of work, so two processes share them
    one = prepare([root], tmp_path / "one", workers=1, show_progress=False)
    two = prepare([root], tmp_path / "two", workers=2, show_progress=False)
    assert len(one.index["splits"]["train"]["shards"]) > 2
    assert one.index["splits"] == two.index["splits"]
    for shard in one.index["splits"]["train"]["shards"] + one.index["splits"]["validation"]["shards"]:
        name = f"{shard['name']}.tokens"
        assert (one.root / name).read_bytes() == (two.root / name).read_bytes()


def test_prepare_shows_its_progress_on_the_command_line(corpus, tmp_path, capsys):
    from shardax.cli import main

    root, _ = corpus
    assert main(["prepare", str(root), "--out", str(tmp_path / "shards"), "--workers", "1"]) == 0
    out = capsys.readouterr()
    bar = [line for line in (out.out + out.err).splitlines() if line.startswith("tokenizing")]
    done, total = re.search(r"([\d.]+)/([\d.]+) (?:bytes|kB|MB)", bar[-1]).groups()
    assert done == total, bar[-1]  # the bar ran to its end


def test_prepare_again_does_nothing_and_notices_a_changed_input(corpus, tmp_path):
    root, _ = corpus
    copy = tmp_path / "inputs"
    copy.mkdir()
    for path in root.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    first = prepare([copy], tmp_path / "shards", show_progress=False)
    written = {p.name: p.stat().st_mtime_ns for p in first.root.iterdir()}
    again = prepare([copy], tmp_path / "shards", show_progress=False)
    assert not again.built and {p.name: p.stat().st_mtime_ns for p in first.root.iterdir()} == written
    (copy / "file03.txt").write_text("a new third document")
    changed = prepare([copy], tmp_path / "shards", show_progress=False)
    assert changed.built and "1 modified" in changed.reason
    assert "a new third document" in split_documents(PreparedData(changed.root), "train") + split_documents(
        PreparedData(changed.root), "validation")


def test_bpe_trained_on_the_corpus_and_loaded_from_its_file(corpus, tmp_path):
    root, texts = corpus
    done = prepare([root], tmp_path / "bpe", tokenizer="bpe", vocab_size=300, show_progress=False)
    data = PreparedData(done.root)
    assert data.tokenizer.vocab_size == 300 and done.index["vocab_size"] == 300
    assert sorted(split_documents(data, "train") + split_documents(data, "validation")) == sorted(texts)
    # it compresses
    assert done.index["splits"]["train"]["tokens"] < done.index["splits"]["train"]["bytes"] * 0.8
    lengths = data.tokenizer.token_bytes()  # bytes per token, exact for byte-level BPE
    for text in texts[:5]:
        ids = data.tokenizer.encode_batch([text])[0]
        assert lengths[ids].sum() == len(text.encode())
    reused = prepare([root], tmp_path / "reused", tokenizer=str(done.root / "tokenizer.json"),
                     show_progress=False)
    assert load_tokenizer(reused.root / "tokenizer.json").fingerprint == data.tokenizer.fingerprint
    assert reused.index["splits"] == done.index["splits"]


def test_the_stream_reads_across_shards_without_loading_them(tmp_path):
    parts = [np.arange(start, start + n, dtype=np.uint16) for start, n in ((0, 10), (10, 1), (11, 25))]
    shards = []
    for i, part in enumerate(parts):
        part.tofile(tmp_path / f"train-{i:05d}.tokens")
        shards.append({"name": f"train-{i:05d}", "tokens": part.size})
    stream = TokenStream(tmp_path, shards, "uint16")
    assert stream.length == 36
    for start, count in ((0, 36), (8, 5), (10, 1), (9, 20), (30, 10)):
        np.testing.assert_array_equal(stream.read(start, count), np.arange(start, min(start + count, 36)))
    narrow = TokenStream(tmp_path, shards, "uint16", vocab_size=30)  # ids 30..35 lie beyond its vocabulary
    np.testing.assert_array_equal(narrow.read(0, 30), np.arange(30))
    with pytest.raises(UsageError) as error:
        narrow.read(25, 10)
    assert str(error.value) == (f"{tmp_path / 'train-00002.tokens'} holds token id 30 at token 19, beyond "
                                "the tokenizer's 30 ids: the shard is damaged; run shardax prepare again "
                                f"into {tmp_path}")


def test_packed_windows_number_documents_and_restart_positions():
    eod = 9
    tokens = np.asarray([[3, 4, eod, 5, 6, 7, eod, 1], [eod, 2, 2, eod, eod, 3, 0, 0]])
    valid = np.asarray([[True] * 8, [True] * 6 + [False] * 2])
    batch = packed(tokens, eod, valid)
    np.testing.assert_array_equal(batch["segments"], [[1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 2, 3, 3, 0, 0]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1, 0, 0]])


@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.slow
def test_each_packed_document_computes_as_if_it_were_alone(positions, scan_layers):
    config = TransformerConfig(vocab_size=64, seq_len=40, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                               positions=positions, scan_layers=scan_layers)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    eod, rng = 63, np.random.default_rng(1)
    docs = [rng.integers(0, 63, n) for n in (5, 11, 1, 8)]
    stream = np.concatenate([np.concatenate([[eod], d]) for d in docs] + [[eod]])
    tokens = np.zeros((2, 41), np.int32)
    valid = np.zeros(tokens.shape, bool)
    tokens[0, : stream.size], valid[0, : stream.size] = stream, True
    tokens[0, stream.size :] = rng.integers(0, 63, 41 - stream.size)  # padding: any token, never counted
    tokens[1, :], valid[1, :] = rng.integers(0, 63, 41), True
    batch = {key: jnp.asarray(value) for key, value in packed(tokens, eod, valid).items()}
    losses, weights = token_losses(model, batch)
    segments = np.asarray(batch["segments"][0, :-1])
    for number, doc in enumerate(docs, 1):
        alone = jnp.asarray(np.concatenate([[eod], doc, [eod]])[None], jnp.int32)
        expected, _ = token_losses(model, {"tokens": alone})
        got = np.asarray(losses[0] * weights[0])[segments == number]
        np.testing.assert_allclose(got, np.asarray(expected[0]), rtol=1e-5, atol=1e-6)
    assert float(weights[0].sum()) == stream.size - 1  # padding never counts
    tokens[0, stream.size :] = 0
    again, _ = token_losses(model, {key: jnp.asarray(v) for key, v in packed(tokens, eod, valid).items()})
    np.testing.assert_array_equal(np.asarray(again[0] * weights[0]), np.asarray(losses[0] * weights[0]))


def test_the_batch_of_a_step_depends_only_on_data_seed_and_step(corpus, tmp_path):
    root, _ = corpus
    data = PreparedData(prepare([root], tmp_path / "shards", show_progress=False).root)
    sampler = PackedBatches(data.train, 16, 8, seed=3, eod_id=data.eod_id)
    again = PackedBatches(PreparedData(data.root).train, 16, 8, seed=3, eod_id=data.eod_id)
    other = PackedBatches(data.train, 16, 8, seed=4, eod_id=data.eod_id)
    for step in (0, 1, 7, sampler.windows // 8 + 2):  # the last one is in a later epoch
        np.testing.assert_array_equal(sampler.window_ids(step), again.window_ids(step))
    assert not np.array_equal(sampler.window_ids(0), other.window_ids(0))
    epoch = np.concatenate([sampler.window_ids(s) for s in range(sampler.windows // 8)])
    assert len(set(epoch.tolist())) == len(epoch)  # no window twice within an epoch
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    batch = sampler.global_batch(5, NamedSharding(mesh, PartitionSpec("data")))
    rows = sampler.rows(sampler.window_ids(5))
    for key in ("tokens", "segments", "positions"):
        for shard in batch[key].addressable_shards:  # each device holds its own rows, read for it
            np.testing.assert_array_equal(np.asarray(shard.data), rows[key][shard.index])
    stream = data.train.read(0, data.train.length)
    for row, window in zip(rows["tokens"], sampler.window_ids(5)):
        np.testing.assert_array_equal(row, stream[window * 16 : window * 16 + 17])


def test_validation_counts_bits_per_byte_of_the_text_predicted(corpus, tmp_path):
    root, _ = corpus
    data = PreparedData(prepare([root], tmp_path / "bpe", tokenizer="bpe", vocab_size=300,
                                show_progress=False).root)
    lengths = data.tokenizer.token_bytes()
    batches = validation_rows(data.validation, 16, 4, 100, data.eod_id, lengths)
    total = sum(int(batch["target_bytes"].sum()) for batch in batches)
    stream = data.validation.read(0, data.validation.length)
    assert total == lengths[stream[1:]].sum()  # every target once, padding never
    assert batches[-1]["segments"].min() == 0 or data.validation.length % 16 == 1


@pytest.mark.slow
def test_seeded_sampling_repeats_and_greedy_takes_the_most_likely_token():
    config = TransformerConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=1, d_ff=64)
    trainer = Trainer(lambda rngs: TransformerLM(config, rngs=rngs), optax.sgd(0.1),
                      lambda model, batch: jnp.zeros(()), mesh=jax.make_mesh((8,), ("data",)), strategy="dp")
    state = trainer.init()
    prompt = [1, 2, 3]
    first = sample_tokens(trainer.parallel, state, prompt, 12, 16, vocab=50, seed=7)
    assert first == sample_tokens(trainer.parallel, state, prompt, 12, 16, vocab=50, seed=7)
    assert first != sample_tokens(trainer.parallel, state, prompt, 12, 16, vocab=50, seed=8)
    assert all(0 <= t < 50 for t in first)  # never a padding row of the vocabulary
    greedy = sample_tokens(trainer.parallel, state, prompt, 4, 16, vocab=50, temperature=0)
    assert greedy == sample_tokens(trainer.parallel, state, prompt, 4, 16, vocab=50, top_k=1, seed=3)
    model = trainer.model(state)
    logits = model(jnp.asarray([prompt + [0] * 13]))
    assert greedy[0] == int(jnp.argmax(logits[0, 2, :50]))


def test_bytes_tokenizer_round_trips_any_text():
    tokenizer = ByteTokenizer()
    text = "naïve — 漢字 😀 \x7f"
    assert tokenizer.decode(tokenizer.encode_batch([text])[0]) == text


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "empty.txt").write_text(""), "empty.txt is empty; remove it"),
    (lambda d: (d / "latin1.txt").write_bytes("café".encode("latin-1")),
     "latin1.txt is not UTF-8 text (byte 3"),
    (lambda d: (d / "x.jsonl").write_text('{"body": "hi"}\n'),
     "x.jsonl line 1 has no field 'text' (it has body)"),
    (lambda d: (d / "x.jsonl").write_text('{"text": "ok"}\nnot json\n'), "x.jsonl line 2 is not JSON"),
    (lambda d: __import__("pyarrow.parquet").parquet.write_table(
        __import__("pyarrow").table({"body": ["a"]}), d / "x.parquet"),
     "x.parquet has no column 'text' (it has body); pass --field NAME"),
])
def test_bad_inputs_stop_prepare_with_one_line_and_write_nothing(make, message, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "good.txt").write_text("some good text")
    make(inputs)
    given = [inputs / name for name in sorted(p.name for p in inputs.iterdir())]
    with pytest.raises(UsageError) as error:
        prepare(given, tmp_path / "out", show_progress=False)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def _as_it_is(folder: Path) -> dict[Path, tuple[bytes | None, int]]:
    """Every path under ``folder`` with its bytes (files) and modification time."""
    return {p: (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("out", ["missing/folders/out", "prepared", "killed"])
def test_a_refused_prepare_leaves_the_output_folder_as_it_was(out, corpus, tmp_path):
    """A bad input found while tokenizing: a new output (and the folders above it) is not created, a
    prepared one and the .building/ a killed prepare left keep every file and time, however often it
    is refused."""
    root, _ = corpus
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latin1.txt").write_bytes("café".encode("latin-1"))
    work = tmp_path / "work"
    work.mkdir()
    if out == "prepared":
        prepare([root], work / out, show_progress=False)
    if out == "killed":
        (work / out / ".building").mkdir(parents=True)
        (work / out / ".building" / "train-00000.tokens").write_bytes(b"half")
    before = _as_it_is(work)
    for _ in range(2):  # the second refusal finds what the first left
        with pytest.raises(UsageError, match="latin1.txt is not UTF-8 text"):
            prepare([root, tmp_path / "bad"], work / out, show_progress=False)
        assert _as_it_is(work) == before


def test_prepare_refuses_to_replace_shards_of_another_tokenizer(corpus, tmp_path):
    root, _ = corpus
    done = prepare([root], tmp_path / "shards", show_progress=False)
    before = {p.name: p.read_bytes() for p in done.root.iterdir()}
    with pytest.raises(UsageError, match="holds shards made with tokenizer bytes, not 'bpe'; .* --overwrite"):
        prepare([root], tmp_path / "shards", tokenizer="bpe", vocab_size=300, show_progress=False)
    assert {p.name: p.read_bytes() for p in done.root.iterdir()} == before
    with pytest.raises(UsageError, match="is not a prepared data directory"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep me")
        prepare([root], tmp_path / "mine", show_progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert Path(tmp_path / "mine").exists()


def test_a_killed_prepare_is_built_again_and_an_edited_index_is_one_line(corpus, tmp_path):
    root, _ = corpus
    left = tmp_path / "killed"
    (left / ".building").mkdir(parents=True)  # what a prepare killed mid-way leaves
    (left / ".building" / "train-00000.bin").write_bytes(b"half")
    abandoned = tmp_path / ".killed.building-0badc0de"  # where this version builds, a minute ago
    abandoned.mkdir()
    os.utime(abandoned, (time.time() - 120, time.time() - 120))
    done = prepare([root], left, show_progress=False)
    assert not (left / ".building").exists() and PreparedData(done.root).train is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed"]
    shard = left / f"{done.index['splits']['train']['shards'][0]['name']}.tokens"
    original = shard.read_bytes()
    shard.write_bytes(bytes(reversed(original)))  # same size, other bytes
    stream = PreparedData(left).train  # opening reads no shard; the first read checks it
    with pytest.raises(UsageError, match=re.escape(f"{shard} does not match the checksum its index records")):
        stream.read(0, 4)
    shard.write_bytes(original)
    index = json.loads((left / "index.json").read_text())
    del index["dtype"], index["splits"]["validation"]["tokens"]
    (left / "index.json").write_text(json.dumps(index))
    with pytest.raises(UsageError) as error:
        PreparedData(left)
    assert str(error.value) == (f"{left / 'index.json'} lacks dtype; it was not written whole by shardax "
                                f"prepare: run shardax prepare again into {left}")


@pytest.mark.parametrize("count", [1, 3])
def test_a_corpus_too_small_for_the_hash_split_still_holds_out_text(count, tmp_path):
    """One document: its last tenth is held out; a few that all hash to training: the last one."""
    texts = [f"document {i}: " + "words and more words " * 40 for i in range(count)]
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    done = prepare([tmp_path / f"doc{i}.txt" for i in range(count)], tmp_path / "shards",
                   validation_fraction=1e-9, show_progress=False)
    data = PreparedData(done.root)
    train, validation = split_documents(data, "train"), split_documents(data, "validation")
    if count == 1:
        assert len(train) == len(validation) == 1 and train[0] + validation[0] == texts[0]
        assert 0.05 < len(validation[0]) / len(texts[0]) < 0.15
    else:
        assert train == texts[:-1] and validation == texts[-1:]
    counts = done.index["splits"]
    assert counts["train"]["documents"] == len(train) and counts["validation"]["documents"] == 1


def test_word_share_is_the_share_of_sampled_words_found_in_the_corpus():
    known = vocabulary(["def read_file(path):\n    return open(path).read()  # 2x"])
    assert known == {"def", "read", "file", "path", "return", "open"}  # runs of 2+ letters: not "x"
    assert word_share("def read_fiel(Path): retrun", known) == (3 / 5, 5)
    assert word_share("  ( ) 7", known) == (0.0, 0)


def test_a_new_run_loops_its_blocks_on_gpus_where_benchmark_24_timed_it_faster():
    """On GPUs, under strategies that keep weights and gradients whole per data-parallel device,
    a new run's blocks go in a Python loop unless told; elsewhere they are scanned; a resumed
    run keeps the layout its checkpoint records, and the header says when the default chose."""
    for strategy, looped in [("dp", True), ("zero1", True), ("tp", True), ("zero2", False), ("fsdp", False),
                             ("hsdp", False), ("fsdp_tp", False), ("pp", False), ("pp_tp", False)]:
        config = TrainConfig.of(strategy=strategy)
        assert resolve(config, platform="gpu").model.scan_layers is not looped, strategy
        assert resolve(config, platform="tpu").model.scan_layers and resolve(config).model.scan_layers
    assert resolve(TrainConfig.of(scan_layers=True), platform="gpu").model.scan_layers
    assert not resolve(TrainConfig.of(scan_layers=False, strategy="fsdp"), platform="cpu").model.scan_layers
    new = resolve(TrainConfig(), platform="gpu")
    assert loop_note(TrainConfig(), None, new.model) == [
        "blocks: in a Python loop, the default on GPUs under dp (steps 1.14-1.27x faster than scanned on an "
        "H100, benchmark 24); --scan-layers scans them, compiling in time flat in depth"]
    assert loop_note(TrainConfig.of(scan_layers=False), None, new.model) == []  # asked for: nothing to say
    resumed = resolve(TrainConfig.of(strategy="fsdp"), saved=new.record(), platform="cpu")
    assert not resumed.model.scan_layers
    with pytest.raises(UsageError,
                       match="--scan-layers True contradicts the checkpoint's --scan-layers False"):
        resolve(TrainConfig.of(scan_layers=True), saved=new.record(), platform="gpu")


def test_the_default_run_is_the_one_measured_in_the_readme():
    """Benchmark 20 measured the default run's sample (its figure is in the README): the default
    settings are still the ones it ran with."""
    run = resolve(TrainConfig())
    assert ((run.preset, run.tokenizer, run.vocab_size, run.batch_size, run.steps)
            == ("tiny", "bpe", 1024, 32, 500))
    assert run.model.seq_len == 64
    assert (TrainConfig().run.sample_temperature, TrainConfig().run.sample_top_k) == (0.7, 10)
    rows = json.loads((Path(__file__).parents[1] / "benchmarks/results/default_sample.json").read_text())
    after = next(row for row in rows if row["label"] == "after")
    measured = {key: after[key] for key in ("tokenizer", "batch_size", "steps", "temperature", "top_k")}
    assert measured == {"tokenizer": run.tokenizer, "batch_size": run.batch_size, "steps": run.steps,
                        "temperature": TrainConfig().run.sample_temperature,
                        "top_k": TrainConfig().run.sample_top_k}
    assert 0 < after["word_share"] <= 1 and after["words"] > 200
