"""Hugging Face checkpoints of the Llama family: loaded into shards, checked against Hugging Face
``transformers`` itself (PyTorch on CPU) on tiny random models the tests create."""

import json
import math
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import make_checkpoints

from shardax import hf
from shardax.errors import UsageError
from shardax.models.transformer import next_token_loss
from shardax.sharding.paths import path_to_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("test_hf")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
ARCHITECTURES = {
    # Llama 3: grouped-query attention, RoPE base 500000 with Llama 3's scaling, an untied head
    "llama3": lambda: transformers.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    # Mistral: as Llama, no sliding window
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    # Qwen2: biases on q, k and v; tied embeddings; as many key/value heads as query heads (one fused weight)
    "qwen2": lambda: transformers.Qwen2Config(**{**COMMON, "num_key_value_heads": 4},
                                              tie_word_embeddings=True),
    # Qwen3: RMSNorm on each head's queries and keys; a head size of its own (32, not 64 / 4)
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
}
TOKENS = np.random.default_rng(0).integers(0, 96, (8, 17))
# supervised fine-tuning examples: 6 to 13 of each row's tokens, a loss mask on about half of them
SFT = [(TOKENS[i, :6 + i], (np.random.default_rng(i).random(6 + i) < 0.5).astype(np.int32)) for i in range(8)]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Each architecture as ``transformers`` saves it (random weights, norms and biases moved off
    their initial values), with its logits on ``TOKENS[:, :-1]``."""
    return make_checkpoints(ARCHITECTURES, tmp_path_factory, TOKENS)


def hf_loss(logits):
    """Hugging Face's logits' mean next-token cross-entropy on ``TOKENS``."""
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, TOKENS[:, 1:, None], axis=-1).mean()


def hf_supervised_loss(folder):
    """transformers' loss over the SFT examples with the labels -100 where the mask is 0: each
    example's mean, weighted by how many tokens it learns."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total = count = 0.0
    with torch.no_grad():
        for ids, mask in SFT:
            labels = torch.tensor(np.where(mask > 0, ids, -100))[None]
            learned = float((mask[1:] > 0).sum())
            total += float(model(torch.tensor(ids)[None], labels=labels).loss) * learned
            count += learned
    return total / count


def supervised_batch(pack):
    """The SFT examples in rows of 17 tokens (packed or one a row), padded to 8 rows."""
    from shardax.data.conversations import supervised_rows

    batch, cut = supervised_rows(SFT, 17, pack=pack)
    assert cut == 0 and (len(batch["tokens"]) < 8) == pack  # packing shares rows
    return {key: np.concatenate([rows, np.zeros((8 - len(rows), 17), rows.dtype)])
            for key, rows in batch.items()}


def logits_of(loaded):
    return np.asarray(jax.jit(lambda model, tokens: model(tokens))(loaded.model(), TOKENS[:, :-1]))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_logits_match_transformers(architecture, checkpoints):
    folder, expected = checkpoints[architecture]
    loaded = hf.load(folder, "data=8", "fsdp")
    got = logits_of(loaded)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("strategy, mesh", [("dp", "data=8"), ("tp", "data=4,model=2"),
                                            ("fsdp_tp", "data=4,model=2"),
                                            ("pp_tp", "stage=2,data=2,model=2"), ("dp", "data=2,context=4"),
                                            ("fsdp_tp", "data=2,model=2,context=2")])
def test_every_strategy_loads_the_same_model(strategy, mesh, checkpoints):
    """The same checkpoint under each layout: the logits (outside a step) and the loss of the
    compiled eval step (pipeline stages and split sequences included) are Hugging Face's, and so is
    the loss on assistant tokens alone of supervised fine-tuning examples, packed or not. Under
    pipelines and context axes it is loaded with LoRA adapters, and their train step trains
    those alone."""
    import optax

    from shardax import LoRA

    folder, expected = checkpoints["llama3"]
    lora = LoRA(2, targets="q,o,up") if "stage" in mesh or "context" in mesh else None
    loaded = hf.load(folder, mesh, strategy, tx=optax.adam(1e-2), lora=lora)
    if "stage" not in mesh and "context" not in mesh:
        np.testing.assert_allclose(logits_of(loaded), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    parallel = loaded.parallel
    evaluate = parallel.eval_step(next_token_loss)
    loss = float(evaluate(loaded.state, parallel.place_batch({"tokens": TOKENS}))["loss"])
    np.testing.assert_allclose(loss, hf_loss(expected), rtol=1e-5)
    supervised = hf_supervised_loss(folder)
    for pack in (False, True):
        loss = float(evaluate(loaded.state, parallel.place_batch(supervised_batch(pack)))["loss"])
        np.testing.assert_allclose(loss, supervised, rtol=1e-5, err_msg=f"pack={pack}")
    spec = {path: sharding.spec for path, sharding in
            jax.tree_util.tree_leaves_with_path(parallel.state_shardings.params)}
    placed = {path: leaf.sharding.spec
              for path, leaf in jax.tree_util.tree_leaves_with_path(loaded.state.params)}
    assert placed == spec  # every weight was put straight into its own layout
    if lora is not None:
        before = [np.asarray(leaf) for leaf in jax.tree.leaves(loaded.state.params)]
        state, metrics = parallel.train_step(next_token_loss)(loaded.state,
                                                              parallel.place_batch({"tokens": TOKENS}))
        np.testing.assert_allclose(float(metrics["loss"]), hf_loss(expected), rtol=1e-5)
        changed = [path_to_str(path)
                   for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(state.params), before)
                   if not np.array_equal(np.asarray(new), old)]
        # B starts at zero, so A's first gradient is zero: the first step moves the B adapters alone
        assert sorted(changed) == [f"blocks/layers/lora_{t}_b" for t in ("o", "q", "up")]


def test_each_device_slice_is_read_once_and_replicas_share_it(checkpoints, monkeypatch):
    """Each slice is read once whatever the layout; each device holds memory of its own (a CPU
    device keeps the host memory its slice was arranged in, and the replicas copy it), and the
    path for devices that copy every slice from reused host memory (accelerators) puts the same
    values on each device."""
    import sys

    folder, _ = checkpoints["llama3"]
    total = sum(np.prod(shape) * 4 for shape in (hf.SafeTensors(folder).shape(n) for n in hf.hf_names(
        hf.read_config(folder))))
    layouts = [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2")]
    kept = [hf.load(folder, mesh, strategy) for strategy, mesh in layouts]
    monkeypatch.setattr(sys.modules["shardax.hf.load"], "_kept", lambda devices: False)
    for loaded, (strategy, mesh) in zip(kept, layouts):
        assert loaded.bytes_read == total  # float32 files: bytes read = bytes held
        shards = [shard for leaf in jax.tree.leaves(loaded.state.params) for shard in leaf.addressable_shards]
        assert len({shard.data.unsafe_buffer_pointer() for shard in shards}) == len(shards)
        copied = hf.load(folder, mesh, strategy)
        assert copied.bytes_read == total
        for got, expected in zip(jax.tree.leaves(copied.state.params), jax.tree.leaves(loaded.state.params)):
            assert got.sharding == expected.sharding
            for shard, same in zip(got.addressable_shards, expected.addressable_shards):
                np.testing.assert_array_equal(shard.data, same.data)


def test_config_maps_each_family_feature(checkpoints):
    llama = hf.read_config(checkpoints["llama3"][0])
    assert (llama.n_kv_heads, llama.rope_theta, llama.rope_scaling, llama.tie_embeddings) == (
        2, 500000.0, (8.0, 1.0, 4.0, 16), False)
    qwen2, qwen3 = hf.read_config(checkpoints["qwen2"][0]), hf.read_config(checkpoints["qwen3"][0])
    assert (qwen2.qkv_bias, qwen2.tie_embeddings, qwen2.qk_norm) == (True, True, False)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.qkv_bias) == (True, 32, False)
    assert hf.read_config(checkpoints["mistral"][0], seq_len=32).seq_len == 32


def _copy(folder, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    return target


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _retype(file, name, dtype):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(file)
    tensors[name] = tensors[name].astype(dtype)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("rows, columns, dtype", [(33, 257, "bfloat16"), (1, 1, "float32"),
                                                  (700, 70, "bfloat16"), (64, 512, "float32")])
def test_tiled_transpose_equals_numpys(rows, columns, dtype):
    """The loader's transpose, tile by tile, cast on the way (bfloat16 files into float32
    parameters), of a slice of a wider tensor (its rows strided, as a column slice of a file's
    tensor is), on shapes that no tile divides."""
    from shardax.hf.names import transpose_into

    wide = np.random.default_rng(0).standard_normal((rows, columns + 5)).astype(jax.numpy.dtype(dtype))
    block = wide[:, 3:3 + columns]
    out = np.empty((columns, rows), np.float32)
    transpose_into(out, block)
    np.testing.assert_array_equal(out, block.T.astype(np.float32))


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "model.safetensors").unlink(),
     "holds neither model.safetensors nor model.safetensors.index.json"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x08" + bytes(40)),
     "is not a readable safetensors file"),
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: _edit_config(f, hidden_size=48),
     "model.embed_tokens.weight has shape [96, 64] but config.json implies [96, 48]"),
    (lambda f: _edit_config(f, num_hidden_layers=1), "tensor model.layers.1."),
    (lambda f: _edit_config(f, num_hidden_layers=3), "lacks the tensor model.layers.2."),
    (lambda f: _edit_config(f, model_type="gemma3"),
     'model_type="gemma3" is not supported (the text model of gemma3'),
    (lambda f: _edit_config(f, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling="),
    (lambda f: _edit_config(f, hidden_act="gelu"), 'hidden_act="gelu" is not supported'),
    (lambda f: _edit_config(f, attention_bias=True), "attention_bias=true is not supported"),
    (lambda f: _edit_config(f, num_local_experts=8),
     "num_local_experts=8 is not supported (of mixtures of experts only mixtral"),
    (lambda f: _retype(f / "model.safetensors", "model.norm.weight", np.int32),
     "tensor model.norm.weight is of dtype I32; shardax reads F64, F32, F16, BF16 weights"),
], ids=["no-weights", "corrupt", "no-config", "shape", "unknown-tensor", "missing-tensor", "model-type",
        "rope-scaling", "activation", "output-bias", "experts", "integer-weights"])
def test_bad_checkpoints_are_one_line(damage, message, checkpoints, tmp_path):
    folder = _copy(checkpoints["llama3"][0], tmp_path)
    damage(folder)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UsageError) as error:
        hf.load(folder, "data=8", "dp")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written


def test_a_sharded_checkpoint_and_its_index(checkpoints, tmp_path):
    """A checkpoint saved in several files, as large models are: the index says where each tensor is."""
    folder, expected = checkpoints["qwen3"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    got = logits_of(hf.load(tmp_path / "sharded", "data=4,model=2", "fsdp_tp"))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    moved = next(name for name in index["weight_map"] if name.startswith("model.layers.1."))
    index["weight_map"][moved] = (
        sorted(set(index["weight_map"].values()))[0]
        if index["weight_map"][moved] != sorted(set(index["weight_map"].values()))[0]
        else sorted(set(index["weight_map"].values()))[-1])
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UsageError, match=f"lacks {moved}, which the index places there"):
        hf.load(tmp_path / "sharded", "data=8", "dp")


def test_save_round_trips_bit_exact_and_transformers_reads_it(checkpoints, tmp_path):
    """Saved from a sharded state (fsdp_tp, in several files): loads back bit for bit, and
    ``transformers`` reads it with the logits it had."""
    for architecture in ("llama3", "qwen2"):  # untied head, and a tied one with biases
        folder, expected = checkpoints[architecture]
        loaded = hf.load(folder, "data=4,model=2", "fsdp_tp", scan_layers=architecture == "qwen2")
        out = loaded.save(tmp_path / architecture, max_shard_bytes=100_000)
        assert (len(list(out.glob("*.safetensors"))) > 1
                and not (tmp_path / f"{architecture}.partial").exists())
        again = hf.load(out, "data=8", "dp", scan_layers=architecture == "qwen2")
        for ours, theirs in zip(jax.tree.leaves(loaded.state.params), jax.tree.leaves(again.state.params)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
        reread = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            logits = reread(torch.tensor(TOKENS[:, :-1])).logits.numpy()
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    half = loaded.save(tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = hf.load(half, "data=8", "dp")
    for ours, theirs in zip(jax.tree.leaves(loaded.state.params), jax.tree.leaves(rounded.state.params)):
        np.testing.assert_array_equal(np.asarray(ours).astype(jax.numpy.bfloat16).astype(np.float32),
                                      np.asarray(theirs))
    # kept as stored (param_dtype="bfloat16", what a LoRA run from it keeps): each frozen weight is
    # the file's bits in half the bytes on each device, and logits and a LoRA step are float32's
    import optax

    from shardax import LoRA

    lora = LoRA(2, targets="o,up")
    assert (hf.stored_dtype(half), hf.stored_dtype(folder)) == ("bfloat16", "float32")
    assert hf.factory(half, lora).config.param_dtype == "bfloat16"
    wide, narrow = (hf.load(half, "data=4,model=2", "fsdp_tp", tx=optax.adam(1e-2), lora=lora,
                            param_dtype=dtype) for dtype in ("float32", "bfloat16"))
    for (path, ours), theirs in zip(jax.tree_util.tree_leaves_with_path(wide.state.params),
                                    jax.tree.leaves(narrow.state.params)):
        adapter = hf.is_adapter(path_to_str(path))
        assert theirs.dtype == (np.float32 if adapter else jax.numpy.bfloat16)
        assert theirs.sharding == ours.sharding
        assert [s.data.nbytes * (1 if adapter else 2) for s in theirs.addressable_shards] == [
            s.data.nbytes for s in ours.addressable_shards]
        np.testing.assert_array_equal(np.asarray(theirs).astype(np.float32), np.asarray(ours))
    np.testing.assert_array_equal(logits_of(narrow), logits_of(wide))
    import shardax  # decoding from the cache too (what `shardax generate --hf` does with such a checkpoint)

    prompts = [list(TOKENS[0, :5]), list(TOKENS[1, :2])]
    assert shardax.generate(narrow.model(), prompts, max_new_tokens=6) == shardax.generate(
        wide.model(), prompts, max_new_tokens=6)
    stepped = [run.parallel.train_step(next_token_loss)(run.state,
                                                        run.parallel.place_batch({"tokens": TOKENS}))
               for run in (wide, narrow)]
    assert float(stepped[0][1]["loss"]) == float(stepped[1][1]["loss"])
    for ours, theirs in zip(jax.tree.leaves(stepped[0][0].params), jax.tree.leaves(stepped[1][0].params)):
        np.testing.assert_allclose(np.asarray(theirs).astype(np.float32), np.asarray(ours), rtol=1e-6,
                                   atol=1e-7)


def test_saving_where_it_cannot_is_one_line(checkpoints, tmp_path):
    loaded = hf.load(checkpoints["qwen3"][0], "data=8", "dp")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="taken already exists and is not an empty directory"):
        loaded.save(tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    from shardax.models.presets import GPT_STYLE

    with pytest.raises(UsageError, match=r"only the Llama and Gemma families .* have a Hugging Face layout "
                                         r"to save in \(shardax 0.1's presets had layer norms and GELU MLPs: "
                                         r"a new run of a preset exports\)"):
        hf.save(tmp_path / "preset", loaded.state.params, GPT_STYLE.config())
    assert not (tmp_path / "preset").exists()


@pytest.mark.parametrize("lora", [None, "q,k,v,o,gate,up,down"])
@pytest.mark.slow
def test_the_trainer_fine_tunes_from_a_checkpoint(lora, checkpoints, tmp_path):
    """``Trainer(None, ..., init_from=dir)``, with all weights or LoRA adapters: its first loss is
    Hugging Face's on the same batch, training lowers it, and a checkpoint of the run resumes bit
    for bit."""
    import optax

    from shardax import LoRA, Trainer
    from shardax.models.transformer import TransformerConfig, TransformerLM

    folder, expected = checkpoints["qwen3"]
    batches = [{"tokens": TOKENS}] * 6

    def trainer(init_from=folder):
        return Trainer(None, optax.adam(3e-3 if lora is None else 2e-2), next_token_loss, strategy="fsdp_tp",
                       mesh="data=4,model=2", init_from=init_from, lora=lora and LoRA(4, targets=lora))

    def resumes_bit_for_bit(straight, init_from, checkpoints):
        trainer(init_from).fit(batches, steps=3, log_every=1, checkpoint_dir=checkpoints)
        resumed = trainer(init_from)
        resumed.fit(batches, steps=6, log_every=1, checkpoint_dir=checkpoints, resume=True)
        for ours, theirs in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    straight = trainer().fit(batches, steps=6, log_every=1)
    losses = [record["loss"] for record in straight.history]
    np.testing.assert_allclose(losses[0], hf_loss(expected), rtol=1e-5)
    assert losses[-1] < losses[0] - 0.1
    resumes_bit_for_bit(straight, folder, tmp_path / "ckpt")
    if lora is not None:
        # from a bfloat16 copy the frozen base stays bfloat16, and the run resumes as exactly
        half = hf.load(folder, "data=8", "dp").save(tmp_path / "bf16", dtype="bfloat16")
        kept = trainer(half).fit(batches, steps=6, log_every=1)
        assert {str(leaf.dtype) for leaf in jax.tree.leaves(kept.state.params)} == {"bfloat16", "float32"}
        resumes_bit_for_bit(kept, half, tmp_path / "ckpt-bf16")
        # another model's layers are adapted by path (shardax.models.adapters); these names match none of its
        adapted = Trainer(lambda rngs: nnx.Linear(4, 4, rngs=rngs), optax.adam(1e-3), next_token_loss,
                          lora=LoRA(4))
        assert [leaf.shape for leaf in jax.tree.leaves(adapted.init().opt_state[0].mu)] == [(4, 4), (4, 4)]
        with pytest.raises(UsageError, match=r"LoRA targets \['q,v'\] match none of the model's 1 linear"):
            Trainer(lambda rngs: nnx.Linear(4, 4, rngs=rngs), optax.adam(1e-3), next_token_loss,
                    lora=LoRA(4, targets="q,v"))
        return
    other = TransformerConfig(vocab_size=96, d_model=64, n_heads=4, n_layers=2, d_ff=96, positions="rotary")
    with pytest.raises(UsageError, match="the model's .* but the checkpoint's config.json gives"):
        Trainer(lambda rngs: TransformerLM(other, rngs=rngs), optax.adam(1e-3), next_token_loss,
                init_from=folder).init()


@pytest.mark.slow
def test_two_processes_each_read_only_their_own_slices(checkpoints, tmp_path):
    """2 processes x 4 devices load under fsdp: each reads the slices its devices hold (about
    half the model), the logits are transformers', and the checkpoint they save is the same."""
    from multiprocess import run_workers

    folder, expected = checkpoints["llama3"]
    np.save(tmp_path / "expected.npy", expected)
    outputs = run_workers("hf_load.py",
                          args=(str(folder), str(tmp_path / "expected.npy"), str(tmp_path / "out")))
    figures = [dict(zip(line.split()[2::2], map(int, line.split()[3::2])))
               for out in outputs for line in out.splitlines() if line.startswith("process ")]
    assert len(figures) == 2, outputs
    for figure in figures:
        assert figure["read"] == figure["own"] < 0.6 * figure["total"], figures
    single = hf.load(tmp_path / "out", "data=8", "dp")
    original = hf.load(folder, "data=8", "dp")
    for ours, theirs in zip(jax.tree.leaves(single.state.params), jax.tree.leaves(original.state.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.fixture(scope="session")
def with_tokenizer(tmp_path_factory, small_corpus):
    """A tiny Llama 3 with its own byte-level BPE tokenizer (300 tokens, documents end with
    ``</s>``, as its tokenizer_config.json says), as a Hugging Face directory holds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf-with-tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        [p.read_text() for p in sorted(small_corpus.glob("*.py"))], trainers.BpeTrainer(
            vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 320}, rope_theta=500000.0,
                                      rope_scaling=LLAMA3_ROPE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_shardax_train_fine_tunes_a_hugging_face_checkpoint(with_tokenizer, small_corpus, tmp_path):
    from cli_helpers import read_metrics, shardax

    run = ("train", "--init-from", with_tokenizer, "--data", small_corpus, "--strategy", "fsdp_tp", "--mesh",
           "data=4,model=2", "--seq-len", 32, "--batch-size", 8, "--eval-every", 0, "--log-every", 1,
           "--sample-bytes", 8, "--checkpoint-dir", tmp_path / "ckpt", "--metrics", tmp_path / "m.jsonl")
    first = shardax(*run, "--steps", 4, "--checkpoint-every", 1, "--keep-checkpoints", 5)
    from safetensors.numpy import load_file

    from shardax.trainer.checkpoint import saved_arrays

    # the warmup's first learning rate is 0: the weights as loaded
    at_step_1 = saved_arrays(tmp_path / "ckpt", 1)
    np.testing.assert_array_equal(at_step_1["params.embedding"],
                                  load_file(with_tokenizer / "model.safetensors")[
                                      "model.embed_tokens.weight"])
    assert f"model: fine-tuning the Hugging Face checkpoint {with_tokenizer} (2 layers" in first.stdout
    assert "bpe (vocabulary 300, tokenizer.json)" in first.stdout and "sample" in first.stdout
    losses = [record["loss"] for record in read_metrics(tmp_path / "m.jsonl")]
    # a trained-from-random model starts near log(V)
    assert len(losses) == 4 and losses[0] < np.log(320) + 1.0
    resumed = shardax(*run, "--resume", "--extend-to", 5)
    assert "resumed from step 4" in resumed.stdout
    exported = shardax("export", tmp_path / "ckpt", "--hf", tmp_path / "export")
    assert f"wrote step 5 of {tmp_path / 'ckpt'} to {tmp_path / 'export'}" in exported.stdout
    assert "with tokenizer.json, tokenizer_config.json" in exported.stdout
    trained = saved_arrays(tmp_path / "ckpt", 5)
    written = load_file(tmp_path / "export" / "model.safetensors")
    np.testing.assert_array_equal(written["model.embed_tokens.weight"], trained["params.embedding"])
    np.testing.assert_array_equal(written["lm_head.weight"], trained["params.head"].T)
    again = shardax("export", tmp_path / "ckpt", "--hf", tmp_path / "export", check=False)
    assert again.returncode == 2 and "already exists and is not an empty directory" in again.stderr
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # transformers reads it
    assert reread.config.rope_scaling["rope_type"] == "llama3"
    refused = shardax("train", "--init-from", with_tokenizer, "--preset", "tiny", check=False)
    assert refused.returncode == 2 and "--preset tiny and --init-from" in refused.stderr
    (tmp_path / "big").mkdir()
    shutil.copy(with_tokenizer / "config.json", tmp_path / "big")
    shutil.copy(with_tokenizer / "model.safetensors", tmp_path / "big")
    big = shardax("train", "--init-from", tmp_path / "big", "--data", small_corpus, check=False)
    assert (big.returncode == 2
            and "has no tokenizer.json; give the one the model was trained with" in big.stderr)


@pytest.fixture(scope="session")
def chat_model(with_tokenizer, tmp_path_factory):
    """The tiny Llama with a chat template in its tokenizer_config.json (ChatML's style)."""
    folder = tmp_path_factory.mktemp("hf-chat") / "chat-model"
    shutil.copytree(with_tokenizer, folder)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                              "chat_template": template}))
    return folder


@pytest.mark.slow
def test_shardax_train_fine_tunes_on_conversations_with_the_checkpoints_template(chat_model, tmp_path):
    """``shardax train --init-from DIR --data chats.jsonl``: the conversations render with the
    checkpoint's own template, and the first step's loss (LoRA: the model as loaded) is
    transformers' with labels -100 outside the assistant's tokens, on the examples that step's
    rows hold, under fsdp_tp."""
    import torch
    import transformers
    from cli_helpers import read_metrics, shardax

    from shardax.data.examples import ExampleRows
    from shardax.data.python_chats import conversations
    from shardax.lm.data import open_data

    folder = chat_model
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(chat) + "\n" for chat in conversations()[:48]))
    done = shardax("train", "--init-from", folder, "--data", chats, "--lora-rank", 4, "--strategy", "fsdp_tp",
                   "--mesh", "data=4,model=2", "--seq-len", 64, "--batch-size", 8, "--steps", 2,
                   "--log-every", 1, "--eval-every", 0, "--sample-bytes", 4,
                   "--metrics", tmp_path / "m.jsonl", "--checkpoint-dir", tmp_path / "ckpt")
    assert (f"rendered with the chat template of {folder}" in done.stdout
            and "tokens learned (the assistant's)" in done.stdout)
    data = open_data([str(chats)], str(folder / "tokenizer.json"), None, None, 64)  # the run's own cache
    rows = ExampleRows(data.train, 64, 8, seed=0)
    examples = [data.train.example(i, 65) for n in range(8) for i in rows.plan[int(rows.order[n])]]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total = count = 0.0
    with torch.no_grad():
        for ids, mask in examples:
            labels = torch.tensor(np.where(mask > 0, ids, -100).astype(np.int64))
            labels[0] = -100  # an example's first token is predicted from nothing of its own
            learned = float((labels[1:] != -100).sum())
            if learned:
                total += float(model(torch.tensor(ids.astype(np.int64))[None],
                                     labels=labels[None]).loss) * learned
                count += learned
    metrics = read_metrics(tmp_path / "m.jsonl")
    np.testing.assert_allclose(metrics[0]["loss"], total / count, rtol=1e-5)
    assert math.isfinite(next(r for r in metrics if "val_loss" in r)["val_loss"])
    question = "What does `json.dumps` do?"  # generate --chat: the template's prompt, greedy as transformers'
    said = shardax("generate", "--hf", folder, "--chat", "--prompt", question, "--temperature", 0,
                   "--max-new-tokens", 6)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                              add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=6, do_sample=False,
                                eos_token_id=hf_tokenizer.eos_token_id)
    assert said.stdout.strip() == hf_tokenizer.decode(greedy[0, prompt.shape[1]:],
                                                      skip_special_tokens=True).strip()


@pytest.mark.slow
def test_shardax_train_tunes_preference_pairs_with_dpo_against_the_base_weights(chat_model, tmp_path):
    """``shardax train --init-from DIR --data pairs.jsonl --lora-rank R``: DPO with the base
    weights as the reference. The first step's loss is log 2 with zero rewards (B starts at
    zero: the policy is the reference), the rewards move after it, and the validation pairs are
    scored; DPO without LoRA, and DPO's flags without pairs, are one line each."""
    from cli_helpers import read_metrics, shardax

    from shardax.data.python_chats import preference_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in preference_pairs()[:40]))
    run = ("train", "--init-from", chat_model, "--data", pairs, "--strategy", "fsdp_tp",
           "--mesh", "data=4,model=2", "--seq-len", 64, "--batch-size", 8, "--log-every", 1,
           "--eval-every", 0, "--sample-bytes", 0)
    done = shardax(*run, "--lora-rank", 4, "--steps", 4, "--dpo-beta", 0.5, "--metrics", tmp_path / "m.jsonl",
                   "--checkpoint-dir", tmp_path / "ckpt")
    assert ("preference pairs" in done.stdout
            and f"rendered with the chat template of {chat_model}" in done.stdout)
    # the summary sets the loss beside DPO's own baseline (log 2), not a unigram entropy
    assert (re.search(r"policy = reference baseline +│ 0\.6931 nats/pair", done.stdout)
            and "unigram" not in done.stdout)
    metrics = read_metrics(tmp_path / "m.jsonl")
    first, last = metrics[0], [r for r in metrics if "loss" in r][-1]
    assert (first["loss"] == pytest.approx(math.log(2), abs=1e-6)
            and first["reward_margin"] == pytest.approx(0, abs=1e-6))
    assert last["chosen_reward"] != 0 and last["rejected_reward"] != 0  # the adapters moved the policy
    evaluated = next(r for r in metrics if "val_loss" in r)
    assert math.isfinite(evaluated["val_loss"]) and 0 <= evaluated["val_reward_accuracy"] <= 1
    full = shardax(*run, "--steps", 1, check=False)
    assert (full.returncode == 2
            and "DPO from shardax train takes the model's base weights as its reference" in full.stderr)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "2 + 2 =", "completion": " 4"}) + "\n"
                     + json.dumps({"prompt": "3 + 3 =", "completion": " 6"}) + "\n")
    wrong = shardax("train", "--init-from", chat_model, "--data", chats, "--dpo-beta", 0.2, check=False)
    assert (wrong.returncode == 2
            and "--dpo-beta tunes DPO, and --data holds no preference pairs" in wrong.stderr)


@pytest.mark.slow
def test_lora_trains_adapters_alone_and_exports_merged_and_for_peft(checkpoints, tmp_path):
    """LoRA on a loaded checkpoint under fsdp_tp: it starts as the checkpoint (B is zero), only
    the adapters train and hold optimizer state, each split like its base weight; the merged
    export gives transformers the trained model's logits, and the adapters alone give peft's."""
    import optax

    from shardax import LoRA
    from shardax.models.presets import adapter_count

    folder, expected = checkpoints["llama3"]
    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp", tx=optax.adam(1e-2),
                     lora=LoRA(4, 8, "q,v,o,gate,down"))
    np.testing.assert_allclose(logits_of(loaded), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    parallel, state = loaded.parallel, loaded.state
    specs = {path_to_str(path)[len("blocks/layers/"):]: leaf.sharding.spec
             for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
             if "lora_" in path_to_str(path)}
    assert specs["lora_q_b"][2] == "model" and specs["lora_q_a"][1] == "data"  # heads on model, embed on data
    assert specs["lora_o_a"][1] == "model"  # o contracts the heads: split like them
    assert (specs["lora_down_a"][1] == "model"
            and specs["lora_gate_b"][2] == "model")  # the MLP's hidden on model
    moments = sum(leaf.size for leaf in jax.tree.leaves(state.opt_state)) - 1  # adam's mu and nu, and a count
    assert moments == 2 * adapter_count(loaded.config) and adapter_count(loaded.config) == 2 * (
        4 * (64 + 64) + 4 * (64 + 32) + 4 * (64 + 64) + 4 * (64 + 96) + 4 * (96 + 64))
    step = parallel.train_step(next_token_loss)
    batch = parallel.place_batch({"tokens": TOKENS})
    before = {path_to_str(p): np.asarray(leaf)
              for p, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
    trained, losses = state, []
    for _ in range(4):
        trained, metrics = step(trained, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05
    after = {path_to_str(p): np.asarray(leaf)
             for p, leaf in jax.tree_util.tree_leaves_with_path(trained.params)}
    assert sorted(name for name in after if not np.array_equal(after[name], before[name])) == sorted(
        name for name in after if "lora_" in name)
    ours = np.asarray(jax.jit(lambda model, tokens: model(tokens))(parallel.merge(trained), TOKENS[:, :-1]))
    with pytest.raises(UsageError,
                       match=r"carries LoRA adapters \(rank 4 on q,v,o,gate,down\): save\(..., merge=True\)"):
        hf.save(tmp_path / "unmerged", trained.params, loaded.config)
    merged = hf.save(tmp_path / "merged", trained.params, loaded.config, hf_config=loaded.hf_config,
                     merge=True)
    with torch.no_grad():
        logits = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(
            torch.tensor(TOKENS[:, :-1])).logits
    np.testing.assert_allclose(logits.numpy(), ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())
    adapters = hf.save_adapters(tmp_path / "adapters", trained.params, loaded.config, base_model=str(folder))
    written = json.loads((adapters / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["target_modules"]) == (
        4, 8, ["down_proj", "gate_proj", "o_proj", "q_proj", "v_proj"])
    from safetensors.numpy import load_file

    tensors = load_file(adapters / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = peft.PeftModel.from_pretrained(base, adapters).eval()(torch.tensor(TOKENS[:, :-1])).logits
    np.testing.assert_allclose(logits.numpy(), ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_lora_under_fsdp_runs_to_the_end_on_few_simulated_devices(devices, with_tokenizer, small_corpus,
                                                                  tmp_path):
    """The fine-tuning guide's LoRA run at its batch of 32, well past step 2, on 2 and 4 devices
    (it aborted after step 1 in XLA:CPU's collectives, see shardax.cpu_devices)."""
    from cli_helpers import read_metrics, shardax

    done = shardax("train", "--init-from", with_tokenizer, "--data", small_corpus, "--lora-rank", 8,
                   "--lora-targets", "q,k,v,o", "--strategy", "fsdp", "--devices", devices, "--steps", 30,
                   "--seq-len", 32, "--log-every", 1, "--eval-every", 0, "--sample-bytes", 0,
                   "--metrics", tmp_path / "m.jsonl", "--checkpoint-dir", tmp_path / "ckpt")
    assert f"({devices} cpu devices, {devices} simulated here on" in done.stdout
    losses = [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert len(losses) == 30 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_shardax_train_fine_tunes_with_lora_and_exports_adapters_or_merged(with_tokenizer, small_corpus,
                                                                           tmp_path):
    from cli_helpers import shardax
    from safetensors.numpy import load_file

    from shardax.trainer.checkpoint import saved_arrays

    run = ("train", "--init-from", with_tokenizer, "--data", small_corpus, "--strategy", "fsdp",
           "--seq-len", 32, "--batch-size", 8, "--eval-every", 0, "--sample-bytes", 0,
           "--checkpoint-dir", tmp_path / "ckpt", "--steps", 3, "--lr", 1e-2)
    first = shardax(*run, "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", "q,v,down")
    assert ("LoRA: rank 4, alpha 8 on q,v,down: 3,072 adapter parameters train, the model's 102,720 "
            "stay frozen" in first.stdout)
    trained, loaded = saved_arrays(tmp_path / "ckpt", 3), load_file(with_tokenizer / "model.safetensors")
    np.testing.assert_array_equal(trained["params.embedding"], loaded["model.embed_tokens.weight"])  # frozen
    assert np.abs(trained["params.blocks.layers.lora_q_b"]).max() > 0  # trained from zero
    assert not any(".mu." in name and "lora" not in name
                   for name in trained)  # no optimizer state for the base
    contradicts = shardax(*run, "--lora-rank", 8, "--resume", "--extend-to", 4, check=False)
    assert (contradicts.returncode == 2
            and "--lora-rank 8 contradicts the checkpoint's --lora-rank 4" in contradicts.stderr)
    adapters = shardax("export", tmp_path / "ckpt", "--hf", tmp_path / "adapters")
    assert "as LoRA adapters in PEFT's layout (rank 4)" in adapters.stdout
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["target_modules"] == [
        "down_proj", "q_proj", "v_proj"]
    merged = shardax("export", tmp_path / "ckpt", "--hf", tmp_path / "merged", "--merge")
    assert "(LoRA adapters merged)" in merged.stdout
    written = load_file(tmp_path / "merged" / "model.safetensors")
    layer = trained["params.blocks.layers.q"][1].reshape(64, -1)
    delta = (2.0 * trained["params.blocks.layers.lora_q_a"][1]
             @ trained["params.blocks.layers.lora_q_b"][1].reshape(4, -1))
    np.testing.assert_allclose(written["model.layers.1.self_attn.q_proj.weight"], (layer + delta).T,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(written["model.layers.1.self_attn.k_proj.weight"],
                                  loaded["model.layers.1.self_attn.k_proj.weight"])
    said = shardax("generate", "--checkpoint", tmp_path / "ckpt", "--prompt", "import json",
                   "--max-new-tokens", 6, "--temperature", 0)
    assert said.stdout.startswith("import json") and len(said.stdout) > len("import json\n")
    assert re.search(r"\d new tokens for 1 prompt \(\d+ tokens\) in [\d.]+ s: first token after [\d.]+ s"
                     r"(, then [\d.]+ tokens/s)?$", said.stderr.strip()), said.stderr
    both = shardax("generate", "--hf", with_tokenizer, "--prompt", "def", "--prompt", "class",
                   "--max-new-tokens", 4)
    assert both.stdout.startswith("def") and "\nclass" in both.stdout
    long = shardax("generate", "--hf", with_tokenizer, "--prompt", "x", "--max-new-tokens", 1000, check=False)
    assert long.returncode == 2 and "more than the model's 64; shorten the prompt" in long.stderr
    assert long.stdout == ""  # said before the prompt is echoed, on a line of its own
    lonely = shardax("train", "--init-from", with_tokenizer, "--lora-alpha", 8, check=False)
    assert (lonely.returncode == 2
            and "--lora-alpha shapes LoRA adapters, and there are none without --lora-rank" in lonely.stderr)
    wrong = shardax("train", "--init-from", with_tokenizer, "--lora-rank", 4, "--lora-targets", "q,attn",
                    check=False)
    assert wrong.returncode == 2 and "--lora-targets q,attn: name each projection once" in wrong.stderr


def test_greedy_generation_matches_transformers_generate(checkpoints):
    """A loaded checkpoint, sharded fsdp_tp, decodes greedily from its key/value cache the tokens
    Hugging Face's ``generate`` gives (do_sample=False) for the same prompts."""
    import shardax

    folder, _ = checkpoints["llama3"]
    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp", seq_len=48)
    prompts = [list(TOKENS[0, :7]), list(TOKENS[1, :3])]
    ours = shardax.generate(loaded.model(), prompts, max_new_tokens=12)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert tokens == theirs[0, len(prompt):].tolist()


# preference pairs from the SFT examples: chosen and rejected completions in rows of 17 tokens
PAIRS = [(SFT[2 * p], SFT[2 * p + 1]) for p in range(4)]


def pair_batch():
    def rows(side, part):
        return np.stack([np.pad(pair[side][part], (0, 17 - len(pair[side][part])))
                         for pair in PAIRS]).astype(np.int32)

    return {"chosen": rows(0, 0), "chosen_mask": rows(0, 1), "rejected": rows(1, 0),
            "rejected_mask": rows(1, 1)}


def hf_sequence_logprobs(folder, batch):
    """transformers' log-probability of each row's marked tokens, chosen rows then rejected."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    for side in ("chosen", "rejected"):
        tokens, mask = batch[side], batch[side + "_mask"]
        with torch.no_grad():
            logits = model(torch.tensor(tokens[:, :-1])).logits.double().numpy()
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        out.append((np.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0] * mask[:, 1:]).sum(1))
    return out


def params_grad(loss, model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return jax.jit(jax.grad(lambda params: loss(nnx.merge(graphdef, params, rest))))(params)


@pytest.mark.slow
def test_dpo_loss_and_gradient_from_transformers_log_probabilities(checkpoints):
    """DPO of a Llama 3 checkpoint against a Qwen3 one as the reference (log-probabilities given with
    the batch): the loss and rewards equal the formula on transformers' log-probabilities of the
    same pairs, and its gradient is the formula's: the sum over pairs of each pair's weight times
    the gradient of (chosen - rejected) log-probability."""
    from shardax.models.preference import dpo_loss, sequence_logprobs

    beta, smoothing = 0.5, 0.1
    batch = pair_batch()
    policy = hf_sequence_logprobs(checkpoints["llama3"][0], batch)
    reference = hf_sequence_logprobs(checkpoints["qwen3"][0], batch)
    batch |= {"reference_chosen": reference[0].astype(np.float32),
              "reference_rejected": reference[1].astype(np.float32)}
    margin = beta * ((policy[0] - reference[0]) - (policy[1] - reference[1]))
    log_sigmoid = lambda x: -np.log1p(np.exp(-x))  # noqa: E731
    expected = (-(1 - smoothing) * log_sigmoid(margin) - smoothing * log_sigmoid(-margin)).mean()
    model = hf.load(checkpoints["llama3"][0], "data=8", "fsdp").model()
    loss_fn = dpo_loss(beta, smoothing)
    loss, metrics = jax.jit(loss_fn)(model, batch)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margin.mean(), rtol=1e-5, atol=1e-6)
    assert float(metrics["reward_accuracy"]) == (margin > 0).mean()
    sigmoid = 1 / (1 + np.exp(-margin))
    weights = (-beta * ((1 - smoothing) * (1 - sigmoid) - smoothing * sigmoid)
               / len(PAIRS)).astype(np.float32)
    got = params_grad(lambda m: loss_fn(m, batch)[0], model)
    want = params_grad(lambda m: (weights * (sequence_logprobs(m, batch["chosen"], batch["chosen_mask"])
                                             - sequence_logprobs(m, batch["rejected"],
                                                                 batch["rejected_mask"]))).sum(),
                       model)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                                   atol=1e-4 * np.abs(np.asarray(w)).max(), err_msg=path_to_str(path))
    # the same in a run of parts, the reference a frozen model whose log-probabilities the step computes
    import optax

    from shardax import Part, Trainer
    from shardax.models.preference import dpo_step
    from shardax.models.transformer import TransformerLM

    reference_model = hf.load(checkpoints["qwen3"][0], "data=8", "fsdp").model()
    parts = {name: Part(lambda rngs, config=module.config: TransformerLM(config, rngs=rngs),
                        optax.sgd(1.0) if name == "policy" else None, init_from=module)
             for name, module in (("policy", model), ("reference", reference_model))}
    trainer = Trainer(parts=parts, step=dpo_step(beta, smoothing), strategy="fsdp_tp", mesh="data=4,model=2",
                      example_batch=pair_batch())
    result = trainer.fit([pair_batch()], steps=1, log_every=1, summary=False)
    np.testing.assert_allclose(result.history[0]["loss"], expected, rtol=1e-5)
    moved = nnx.state(trainer.part("policy"), nnx.Param)
    for (path, new), old, w in zip(jax.tree_util.tree_leaves_with_path(moved),
                                   jax.tree.leaves(nnx.state(model, nnx.Param)),
                                   jax.tree.leaves(want)):  # SGD at 1: the step is minus the gradient
        np.testing.assert_allclose(np.asarray(old) - np.asarray(new), np.asarray(w), rtol=1e-3,
                                   atol=1e-3 * np.abs(np.asarray(w)).max(), err_msg=path_to_str(path))


@pytest.mark.slow
def test_lora_dpo_with_the_base_as_reference_equals_an_explicit_frozen_copy(checkpoints):
    """A LoRA model with no reference given uses its base weights (adapters left out) as the
    reference: the loss, rewards and the adapters' gradients equal those with the reference's
    log-probabilities computed beforehand by the checkpoint loaded without adapters."""
    from shardax import LoRA
    from shardax.models.preference import dpo_loss, sequence_logprobs

    folder = checkpoints["llama3"][0]
    model = hf.load(folder, "data=4,model=2", "fsdp_tp", lora=LoRA(2, targets="q,v,up")).model()
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape),
                            adapters)  # B no longer 0
    model = nnx.merge(graphdef, adapters, rest)
    base = hf.load(folder, "data=4,model=2", "fsdp_tp").model()
    batch = pair_batch()
    given = batch | {"reference_chosen": sequence_logprobs(base, batch["chosen"], batch["chosen_mask"]),
                     "reference_rejected": sequence_logprobs(base, batch["rejected"], batch["rejected_mask"])}
    loss_fn = dpo_loss(0.2)
    (implicit, metrics), (explicit, expected) = loss_fn(model, batch), loss_fn(model, given)
    np.testing.assert_allclose(float(implicit), float(explicit), rtol=1e-5)
    assert float(metrics["reward_margin"]) != 0 and float(implicit) != pytest.approx(np.log(2))
    for name in metrics:
        np.testing.assert_allclose(float(metrics[name]), float(expected[name]), rtol=1e-5, atol=1e-6)

    def adapter_grad(batch):
        return nnx.jit(nnx.grad(lambda m: loss_fn(m, batch)[0],
                                argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7),
                 adapter_grad(batch), adapter_grad(given))
    # in a compiled train step: the adapters start at B = 0, so the policy is its reference (loss log 2)
    import optax

    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp", tx=optax.sgd(1.0), lora=LoRA(2, targets="q,v,up"))
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(loaded.state.params)]
    state, stepped = loaded.parallel.train_step(loss_fn)(loaded.state, loaded.parallel.place_batch(batch))
    np.testing.assert_allclose(float(stepped["loss"]), np.log(2), rtol=1e-6)
    moved = [path_to_str(p)
             for (p, new), old in zip(jax.tree_util.tree_leaves_with_path(state.params), before)
             if not np.array_equal(np.asarray(new), old)]
    assert sorted(moved) == [f"blocks/layers/lora_{t}_b" for t in ("q", "up", "v")]
    with pytest.raises(UsageError, match="dpo_loss reads pairs: the batch lacks chosen, rejected"):
        loss_fn(model, {"tokens": TOKENS})
    with pytest.raises(UsageError, match="dpo_loss needs the reference's log-probabilities"):
        loss_fn(base, batch)
