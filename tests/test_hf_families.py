"""Sliding windows, the Gemma family and mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), checked
against Hugging Face ``transformers`` (PyTorch on CPU) on tiny random checkpoints the tests create: logits
under every layout, the loss of compiled eval steps under a pipeline and a context axis, save read back
by transformers, greedy decoding, LoRA read by peft, and one-line refusals of what shardax does not
compute."""

import dataclasses
import json
import math
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from hf_checkpoints import make_checkpoints
from safetensors.numpy import load_file

from shardax import hf
from shardax.errors import UsageError
from shardax.models.presets import parameter_count
from shardax.models.transformer import LoRA, TransformerLM, next_token_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("test_hf_families")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
GEMMA = dict(COMMON, head_dim=16)
# windows of 5 tokens on sequences of 16: every query past the fifth sees less than full attention would
FAMILIES = {
    # Mistral: every layer slides
    "mistral-window": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
    # Qwen2: layers from max_window_layers on slide (here the second)
    "qwen2-window": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5,
                                                     max_window_layers=1),
    # Mixtral: a mixture of 4 experts, 2 per token, their weights renormalised
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    # Qwen3-MoE: 6 experts of their own width, 3 per token, weights as the router gives them; q/k norms
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=3,
                                                     moe_intermediate_size=40, head_dim=16),
    # Qwen2-MoE: q/k/v biases, a shared expert gated by a sigmoid beside 6 experts, 2 per token, renormalised
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                                     moe_intermediate_size=40,
                                                     shared_expert_intermediate_size=56, norm_topk_prob=True),
    # Gemma: GeGLU, (1 + w) RMSNorm, scaled embeddings, tied head, a head size of its own
    "gemma": lambda: transformers.GemmaConfig(**GEMMA),
    # Gemma 2: norms after attention and MLP, local/global layers, soft-capped scores and logits, its query
    # scale
    "gemma2": lambda: transformers.Gemma2Config(**GEMMA, sliding_window=5, query_pre_attn_scalar=24,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # Gemma 3: q/k norms, a local RoPE base, linear RoPE scaling on the global layers
    "gemma3": lambda: transformers.Gemma3TextConfig(**GEMMA, sliding_window=5, sliding_window_pattern=2,
                                                    rope_scaling={"rope_type": "linear", "factor": 4.0}),
}
# a batch on which no mixture's router has a near tie between the last expert it picks and the next
# (every gap >= 5e-4 in probability): a nearer tie lets rounding (1e-6) pick another expert, and the
# logits then differ by far more than any tolerance here (seed 0 had gaps of 2e-5)
TOKENS = np.random.default_rng(61).integers(0, 96, (8, 17))


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """Each family as transformers saves it (random weights moved off their initial values), with
    its logits on ``TOKENS[:, :-1]``."""
    return make_checkpoints(FAMILIES, tmp_path_factory, TOKENS, attn_implementation="eager")


def logits_of(loaded):
    return np.asarray(jax.jit(lambda model, tokens: model(tokens))(loaded.model(), TOKENS[:, :-1]))


def hf_loss(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, TOKENS[:, 1:, None], axis=-1).mean()


def close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_each_family_computes_what_transformers_computes_under_every_layout(family, made):
    """Logits under dp, fsdp, tp and fsdp_tp; the compiled eval step's loss under a pipeline
    (pp_tp) and with the sequence split over a context axis (ring attention; Gemma 2's capped
    scores all-gather); the windows differ from full attention by far more than the tolerance."""
    folder, expected = made[family]
    for strategy, mesh in [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2"),
                           ("fsdp_tp", "data=4,model=2")]:
        close(logits_of(hf.load(folder, mesh, strategy)), expected)
    variant = "all-gather" if family == "gemma2" else "ring"
    config = hf.read_config(folder)
    for strategy, mesh in [("pp_tp", "stage=2,data=2,model=2"), ("fsdp_tp", "data=2,model=2,context=2")]:
        loaded = hf.load(folder, mesh, strategy)  # experts dropless, under the pipeline too
        attention = variant if "context" in mesh else "all-gather"
        parallel = loaded.parallel.with_settings(context_attention=attention)
        evaluate = parallel.eval_step(next_token_loss)
        loss = float(evaluate(loaded.state, loaded.parallel.place_batch({"tokens": TOKENS}))["loss"])
        np.testing.assert_allclose(loss, hf_loss(expected), rtol=1e-5)
    if config.sliding_window:  # the same weights without the window compute something else
        unwindowed = TransformerLM(dataclasses.replace(config, sliding_window=0, sliding_layers=None),
                                   rngs=nnx.Rngs(0))
        nnx.update(unwindowed, nnx.state(hf.load(folder, "data=8", "dp").model(), nnx.Param))
        full = np.asarray(unwindowed(TOKENS[:, :-1]))
        assert np.abs(full - expected).max() > 100 * 1e-4 * np.abs(expected).max()


def test_each_family_reads_its_features_from_config_json(made):
    windows = {name: hf.read_config(made[name][0]).layer_windows for name in FAMILIES}
    assert windows == {"mistral-window": (5, 5), "qwen2-window": (0, 5), "gemma": (0, 0), "gemma2": (5, 0),
                       "gemma3": (5, 0), "mixtral": (0, 0), "qwen3-moe": (0, 0), "qwen2-moe": (0, 0)}
    mixtral, qwen3 = hf.read_config(made["mixtral"][0]), hf.read_config(made["qwen3-moe"][0])
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.ff_width, mixtral.normalize_top_k) == (
        4, 2, 96, True)
    assert (qwen3.n_experts, qwen3.experts_per_token, qwen3.ff_width, qwen3.normalize_top_k,
            qwen3.qk_norm) == (6, 3, 40, False, True)
    qwen2 = hf.read_config(made["qwen2-moe"][0])
    assert (qwen2.shared_expert_d_ff, qwen2.qkv_bias, qwen2.normalize_top_k) == (56, True, True)
    gemma2, gemma3 = hf.read_config(made["gemma2"][0]), hf.read_config(made["gemma3"][0])
    assert (gemma2.norm, gemma2.mlp, gemma2.post_norms, gemma2.scale_embeddings, gemma2.tie_embeddings) == (
        "rms_plus_one", "geglu", True, True, True)
    assert (gemma2.attention_softcap, gemma2.logits_softcap, gemma2.attention_scale) == (2.0, 3.0, 24 ** -0.5)
    assert (gemma3.qk_norm, gemma3.rope_local_theta, gemma3.rope_theta, gemma3.rope_linear_factor,
            gemma3.attention_scale) == (True, 10000.0, 1e6, 4.0, 256 ** -0.5)  # Gemma 3's default scalar
    assert hf.read_config(made["gemma"][0]).post_norms is False
    for name in FAMILIES:  # the parameters counted from the config are those transformers saved
        saved = sum(math.prod(t.shape) for t in load_file(made[name][0] / "model.safetensors").values())
        assert parameter_count(hf.read_config(made[name][0])) == saved, name


@pytest.mark.parametrize("family", ["mixtral", "gemma2"])
@pytest.mark.slow
def test_plan_init_from_plans_the_model_the_checkpoint_loads_as(family, made, tmp_path):
    """``shardax plan --init-from`` (config.json only) plans what ``hf.load`` builds, full and with
    LoRA adapters (their optimizer state a small part of the full one's; from a bfloat16 copy of
    the checkpoint, the frozen base held as stored, in half the bytes)."""
    from cli_helpers import shardax

    from shardax.analysis.plan import plan_strategy

    folder = made[family][0]
    config = dataclasses.replace(hf.load(folder, "data=8", "fsdp").config, seq_len=16)
    flags = ("--init-from", folder, "--strategy", "fsdp", "--mesh", "data=8", "--batch-size", 8,
             "--seq-len", 16)
    full: dict = {}  # the full plan, which the LoRA one is set against
    for lora in ((), ("--lora-rank", 4)):
        (planned,) = json.loads(shardax("plan", *flags, *lora, "--json").stdout)
        model = LoRA(4, None, ",".join(config.adaptable)).applied(config) if lora else config
        expected = plan_strategy(model, "fsdp", "data=8", batch_size=8).to_json()
        for key in ("predicted", "compiled", "collective_bytes", "theoretical_collective_bytes"):
            assert planned[key] == expected[key], (lora, key)
        if lora:
            # the adapters alone have gradients and optimizer state
            assert planned["predicted"]["optimizer"] < 0.2 * full["predicted"]["optimizer"]
            assert planned["predicted"]["gradients"] < 0.2 * full["predicted"]["gradients"]
        full = planned
    half = hf.load(folder, "data=8", "fsdp").save(tmp_path / "bf16", dtype="bfloat16")
    (stored,) = json.loads(shardax("plan", "--init-from", half, *flags[2:], "--lora-rank", 4,
                                   "--json").stdout)
    assert 0.45 < stored["predicted"]["params"] / full["predicted"]["params"] < 0.55
    assert stored["predicted"]["optimizer"] == full["predicted"]["optimizer"]
    table = shardax("plan", *flags, "--lora-rank", 4).stdout
    assert f"shardax plan: {folder} (config.json) (" in table and "LoRA rank 4 on q,k,v,o" in table


@pytest.mark.parametrize("flags, message", [
    (("--init-from", "{empty}"), "has no config.json; give a Hugging Face model directory"),
    (("--init-from", "{mixtral}", "--preset", "small"), "--preset small and --init-from"),
    (("--init-from", "{mixtral}", "--lora-alpha", 8),
     "--lora-alpha shapes LoRA adapters, and there are none"),
    (("--init-from", "{edited}"), "router_jitter_noise=0.1 is not supported")])
def test_plan_init_from_refuses_bad_input_in_one_line(flags, message, made, tmp_path):
    from cli_helpers import shardax

    places = {"empty": tmp_path, "mixtral": made["mixtral"][0],
              "edited": _edited(made["mixtral"][0], tmp_path, router_jitter_noise=0.1)}
    result = shardax("plan", *(str(f).format(**places) for f in flags), check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert any(message in line for line in result.stderr.splitlines()), result.stderr  # said in one line


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_is_read_back_by_transformers_and_by_shardax_bit_exact(family, made, tmp_path):
    folder, expected = made[family]
    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp")
    out = loaded.save(tmp_path / "saved")
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        close(again(torch.tensor(TOKENS[:, :-1])).logits.numpy(), expected)
    assert same(hf.read_config(out), loaded.config)
    reloaded = hf.load(out, "data=8", "dp")
    for a, b in zip(jax.tree.leaves(loaded.state.params), jax.tree.leaves(reloaded.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # saved from a config alone (no config.json to keep fields of), it still loads as itself
    assert same(hf.read_config(hf.save(tmp_path / "bare", loaded.state.params, loaded.config)), loaded.config)


def same(a, b):
    """Configs equal but for how the head size is given (config.json's ``head_dim`` null or written)."""
    return (dataclasses.replace(a, attention_head_dim=a.head_dim)
            == dataclasses.replace(b, attention_head_dim=b.head_dim))


@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window", "gemma2", "gemma3", "mixtral"])
def test_greedy_generation_past_the_window_equals_transformers(family, made):
    """Decoding from the key/value cache (fsdp_tp) attends within each layer's window as
    transformers' generate does, well past the window of 5: a windowed layer beside full ones
    (Qwen2, Gemma 2 and 3) keeps a ring of 16 positions, which 21 positions wrap."""
    import shardax
    from shardax.generation import cache_layout

    folder, _ = made[family]
    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp", seq_len=48)
    prompts = [list(TOKENS[0, :7]), list(TOKENS[1, :3])]
    ours = shardax.generate(loaded.model(), prompts, max_new_tokens=14)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert tokens == theirs[0, len(prompt):].tolist()
    layout = cache_layout(loaded.model(), len(prompts), 7, 14)
    assert layout.ring == (16 if family in ("qwen2-window", "gemma2", "gemma3") else None)
    assert ours.stats.cache_bytes_per_device == layout.bytes_per_device(loaded.config)


@pytest.mark.parametrize("family, targets", [("gemma2", "q,k,o,gate,down"), ("qwen3-moe", None)])
@pytest.mark.slow
def test_lora_trains_and_peft_reads_its_adapters(family, targets, made, tmp_path):
    """On a mixture of experts the default targets are the attention's projections (the experts
    take none)."""
    import optax

    from shardax import LoRA

    folder, expected = made[family]
    lora = LoRA(4, 8) if targets is None else LoRA(4, 8, targets)
    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp", tx=optax.adam(1e-2), lora=lora)
    if targets is None:
        assert loaded.config.lora_targets == ("q", "k", "v", "o")
    close(logits_of(loaded), expected)
    step = loaded.parallel.train_step(next_token_loss)
    batch = loaded.parallel.place_batch({"tokens": TOKENS})
    state, losses = loaded.state, []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    ours = np.asarray(jax.jit(lambda model, tokens: model(tokens))(loaded.parallel.merge(state),
                                                                   TOKENS[:, :-1]))
    adapters = hf.save_adapters(tmp_path / "adapters", state.params, loaded.config, base_model=str(folder))
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        close(peft.PeftModel.from_pretrained(base, adapters).eval()(
            torch.tensor(TOKENS[:, :-1])).logits.numpy(), ours)


def _edited(folder, tmp_path, **changes):
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("family, changes, message", [
    ("gemma2", {"hidden_activation": "gelu"},
     'hidden_activation="gelu" is not supported (this family\'s MLP is computed with gelu_pytorch_tanh)'),
    ("gemma3", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types="),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ("gemma3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only Llama 3's and linear are"),
    ("gemma3", {"model_type": "gemma3"}, "the text model of gemma3 is gemma3_text"),
    ("qwen3-moe", {"mlp_only_layers": [1]},
     "mlp_only_layers=[1] is not supported (every layer of a stack is a mixture of experts here)"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ("mixtral", {"num_experts_per_tok": 5}, "experts_per_token=5 must be from 1 to n_experts=4"),
], ids=["activation", "layer-type", "bidirectional", "rope", "multimodal", "dense-layers", "jitter", "top-k"])
def test_what_shardax_does_not_compute_is_refused_in_one_line(family, changes, message, made, tmp_path):
    folder = _edited(made[family][0], tmp_path, **changes)
    with pytest.raises(UsageError) as error:
        hf.load(folder, "data=8", "dp")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_capped_scores_under_ring_attention_and_an_unsaveable_model_are_one_line(made, tmp_path):
    folder, _ = made["gemma2"]
    loaded = hf.load(folder, "data=4,context=2", "dp")
    with pytest.raises(UsageError,
                       match=r"soft-capping .* runs with `context_attention='all-gather'`, not 'ring'"):
        loaded.parallel.with_settings(context_attention="ring").eval_step(next_token_loss)(
            loaded.state, loaded.parallel.place_batch({"tokens": TOKENS}))
    odd = dataclasses.replace(loaded.config, post_norms=False, attention_softcap=None, logits_softcap=None,
                              attention_scale=None, sliding_window=0, sliding_layers=None, norm="rms")
    # the error names the family nearest to it: Gemma's with an RMSNorm of its own
    with pytest.raises(UsageError, match=r"this model's norm='rms' has no place in a gemma config.json \(it "
                                         r"would load as 'rms_plus_one'\)"):
        hf.config_json(odd)


def test_router_losses_are_transformers_aux_loss(made, tmp_path):
    """With output_router_logits, transformers adds router_aux_loss_coef times its load-balancing
    loss to the loss: shardax reads the weight from config.json and computes the same balance term
    over the tokens it routes (every one but each row's last) and so the same loss (under ep, the
    experts split over two devices), on a batch with no near tie in the router (see ``TOKENS``)."""
    folder = _edited(made["mixtral"][0], tmp_path, output_router_logits=True, router_aux_loss_coef=0.5)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor(TOKENS[:, :-1]))
    ranked = [np.sort(torch.softmax(logits, -1).numpy(), -1) for logits in out.router_logits]
    assert min((probs[:, -2] - probs[:, -3]).min() for probs in ranked) > 5e-4, "a near tie: another batch"
    log_probs = torch.log_softmax(out.logits, -1).numpy()
    cross_entropy = -np.take_along_axis(log_probs, TOKENS[:, 1:, None], axis=-1).mean()
    loaded = hf.load(folder, "data=4,expert=2", "ep")
    assert loaded.config.router_aux_loss == 0.5
    metrics = loaded.parallel.eval_step(next_token_loss)(loaded.state,
                                                         loaded.parallel.place_batch({"tokens": TOKENS}))
    np.testing.assert_allclose(float(metrics["router_balance"]), float(out.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), cross_entropy + 0.5 * float(out.aux_loss), rtol=1e-5)
