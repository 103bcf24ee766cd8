"""Fine-tuning and post-training from Hugging Face checkpoints: the Trainer and `shardax train`
from a checkpoint (all weights or LoRA), conversations with its template, DPO against its base
weights, LoRA exported merged and for PEFT, each checked against ``transformers`` itself."""

import json
import math
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import COMMON, LLAMA3_ROPE, SFT, TOKENS, hf_loss, logits_of

from shardax import hf
from shardax.errors import UsageError
from shardax.models.transformer import next_token_loss
from shardax.sharding.paths import path_to_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("test_hf")  # one worker makes the checkpoints for both files


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
    scored. Without LoRA (full DPO) the policy and its frozen reference both start as the
    checkpoint, read into each; DPO's flags without pairs are one line."""
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
    full = shardax(*run, "--steps", 1, "--metrics", tmp_path / "full.jsonl",
                   "--checkpoint-dir", tmp_path / "full")
    assert "parts: policy (TransformerLM), reference (TransformerLM, frozen)" in full.stdout
    assert read_metrics(tmp_path / "full.jsonl")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    from safetensors.numpy import load_file

    from shardax.trainer.checkpoint import saved_arrays

    loaded = load_file(chat_model / "model.safetensors")["model.embed_tokens.weight"]
    at_step_1 = saved_arrays(tmp_path / "full", 1)
    for part in ("policy", "reference"):  # the warmup's first learning rate is 0: both as loaded
        np.testing.assert_array_equal(at_step_1[f"params.{part}.embedding"], loaded)
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

