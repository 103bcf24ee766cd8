"""Hugging Face checkpoints of the Llama family: loaded into shards, checked against Hugging Face
``transformers`` itself (PyTorch on CPU) on tiny random models the tests create; saved back; decoded.
Fine-tuning and post-training from them: test_hf_fine_tuning.py."""

import json
import shutil

import jax
import numpy as np
import pytest
from hf_checkpoints import ARCHITECTURES, SFT, TOKENS, hf_loss, logits_of

from shardax import hf
from shardax.errors import UsageError
from shardax.models.transformer import next_token_loss
from shardax.sharding.paths import path_to_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("test_hf")  # one worker makes the checkpoints for both files


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

