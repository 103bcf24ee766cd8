"""Hugging Face families as plug-ins: a family defined outside shardax (``tiny_twist_family``)
loads, computes what transformers computes and saves as itself; the registry's own errors are one
line; Qwen3-MoE's window is Qwen3-MoE's (every layer, as transformers computes it), not Qwen2's
(from ``max_window_layers`` on), and survives a save; Qwen2-MoE's window, which transformers
computes three ways, is refused; and the core of ``shardax.hf`` never names a family."""

import ast
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_checkpoints import make_checkpoints
from safetensors.numpy import load_file, save_file

from shardax import hf
from shardax.errors import UsageError
from shardax.hf.families.llama import Llama
from shardax.models.transformer import TransformerConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("test_hf_family_plugins")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
MODELS = {
    # what tiny_twist computes, as transformers' Llama (RoPE base 500000, tiny_twist's default)
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=500000.0),
    # Qwen3-MoE with a window of 5 (on sequences of 16): transformers slides every layer
    "qwen3-moe-window": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, head_dim=16,
        use_sliding_window=True, sliding_window=5),
}
TOKENS = np.random.default_rng(61).integers(0, 96, (8, 17))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_checkpoints(MODELS, tmp_path_factory, TOKENS, attn_implementation="eager")


def logits_of(loaded):
    return np.asarray(jax.jit(lambda model, tokens: model(tokens))(loaded.model(), TOKENS[:, :-1]))


def close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def transformers_logits(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS[:, :-1])).logits.numpy()


def as_tiny_twist(folder, target):
    """transformers' Llama checkpoint in ``folder`` written as a tiny_twist one in ``target``."""
    from tiny_twist_family import TinyTwist

    target.mkdir()
    raw = json.loads((folder / "config.json").read_text())
    del raw["rope_theta"]  # tiny_twist's default
    raw.update(model_type="tiny_twist", architectures=["TinyTwistForCausalLM"])
    (target / "config.json").write_text(json.dumps(raw))
    tensors = load_file(folder / "model.safetensors")
    save_file({TinyTwist().tensor_name(name): array for name, array in tensors.items()},
              target / "model.safetensors")
    return target


def test_a_family_defined_outside_shardax_loads_computes_and_saves_as_itself(made, tmp_path):
    """One file (``tiny_twist_family``) adds the family: its config.json, its defaults and its
    tensor names are read, the model computes transformers' Llama's logits, and a save writes
    tiny_twist's config.json and names, which load back bit for bit."""
    import tiny_twist_family  # noqa: F401  (registers tiny_twist)

    folder, expected = made["llama"]
    twisted = as_tiny_twist(folder, tmp_path / "twisted")
    assert "tiny_twist" in hf.family_names()
    config = hf.read_config(twisted)
    assert config == hf.read_config(folder) and config.rope_theta == 500000.0
    loaded = hf.load(twisted, "data=4,model=2", "fsdp_tp")
    close(logits_of(loaded), expected)

    out = loaded.save(tmp_path / "saved")
    raw = json.loads((out / "config.json").read_text())
    assert (raw["model_type"], raw["architectures"], raw["rope_theta"]) == (
        "tiny_twist", ["TinyTwistForCausalLM"], 500000.0)
    names = set(load_file(out / "model.safetensors"))
    assert names == set(load_file(twisted / "model.safetensors"))
    assert "decoder.embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    assert names == set(hf.hf_names(config, hf.get_family("tiny_twist")))
    reloaded = hf.load(out, "data=8", "dp")
    assert reloaded.config == loaded.config
    for a, b in zip(jax.tree.leaves(loaded.state.params), jax.tree.leaves(reloaded.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # saved from a config alone, the same model is plain Llama (the first family that computes it)
    bare = hf.save(tmp_path / "bare", loaded.state.params, loaded.config)
    assert json.loads((bare / "config.json").read_text())["model_type"] == "llama"
    close(transformers_logits(bare), expected)


def test_a_family_checkpoint_under_another_family_names_is_one_line(made, tmp_path):
    import tiny_twist_family  # noqa: F401

    folder, _ = made["llama"]
    target = tmp_path / "misnamed"
    target.mkdir()
    (target / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    raw = json.loads((folder / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, "model_type": "tiny_twist"}))
    with pytest.raises(UsageError) as error:
        hf.load(target, "data=8", "dp")
    assert "lacks the tensor decoder.embed_tokens.weight" in str(error.value)
    assert "\n" not in str(error.value)


class Unnamed(Llama):
    model_type = ""


@pytest.mark.parametrize("register, message", [
    (lambda: hf.register_family(Llama()), "a family of model_type='llama' is registered already (Llama); "
                                          "give replace=True to replace it"),
    (lambda: hf.register_family(Unnamed()), "a family has a model_type, an architecture, read, write and "
                                            "tensor_name; subclass shardax.hf.Family"),
    (lambda: hf.register_family(object()), "subclass shardax.hf.Family"),
    (lambda: hf.get_family("gpt2"), 'model_type="gpt2" is not supported (another architecture: register a '
                                    "shardax.hf.Family for it)"),
], ids=["twice", "unnamed", "not-a-family", "unknown"])
def test_the_registrys_errors_are_one_line(register, message):
    with pytest.raises(UsageError) as error:
        register()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_replacing_a_family_takes_effect_and_is_undone():
    llama = hf.get_family("llama")

    class Renamed(Llama):
        def tensor_name(self, name):
            return "renamed." + name

    try:
        hf.register_family(Renamed(), replace=True)
        assert hf.get_family("llama").tensor_name("lm_head.weight") == "renamed.lm_head.weight"
    finally:
        hf.register_family(llama, replace=True)
    assert hf.get_family("llama") is llama


def test_qwen3_moe_slides_every_layer_as_transformers_does_and_saving_keeps_the_window(made, tmp_path):
    """transformers' Qwen3-MoE has no max_window_layers: with use_sliding_window every layer
    slides. Its logits equal transformers' (the window changes them far beyond the tolerance);
    a save writes the window back (transformers reads it with the same logits) and loads back
    with it; max_window_layers and layer_types in its config.json change nothing, in transformers
    or here."""
    folder, expected = made["qwen3-moe-window"]
    config = hf.read_config(folder)
    assert config.layer_windows == (5, 5)
    loaded = hf.load(folder, "data=4,model=2", "fsdp_tp")
    close(logits_of(loaded), expected)
    unwindowed = dataclasses.replace(config, sliding_window=0, sliding_layers=None)
    full = np.asarray(jax.jit(lambda model, tokens: model(tokens))(
        hf.load(hf.save(tmp_path / "full", loaded.state.params, unwindowed), "data=8", "dp").model(),
        TOKENS[:, :-1]))
    assert np.abs(full - expected).max() > 100 * 1e-4 * np.abs(expected).max()

    out = loaded.save(tmp_path / "saved")
    raw = json.loads((out / "config.json").read_text())
    assert (raw["model_type"], raw["use_sliding_window"], raw["sliding_window"]) == ("qwen3_moe", True, 5)
    assert hf.read_config(out).layer_windows == (5, 5)
    close(transformers_logits(out), expected)

    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    raw = json.loads((folder / "config.json").read_text())
    raw.update(max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    (edited / "config.json").write_text(json.dumps(raw))
    assert hf.read_config(edited).layer_windows == (5, 5)
    close(transformers_logits(edited), expected)


def test_a_qwen3_moe_windowed_on_some_layers_is_refused_not_saved_without_them(made):
    folder, _ = made["qwen3-moe-window"]
    config = dataclasses.replace(hf.read_config(folder), sliding_layers=(1,))
    with pytest.raises(UsageError, match=r"this model's sliding_layers=\(1,\) has no place in a qwen3_moe "
                                         r"config.json \(it would load as None\)"):
        hf.config_json(config, json.loads((folder / "config.json").read_text()))


PLAIN = TransformerConfig(vocab_size=96, d_model=64, n_heads=4, n_layers=3, d_ff=96, positions="rotary",
                          norm="rms", mlp="swiglu")


@pytest.mark.parametrize("changes, base, family", [
    ({}, None, "llama"),
    ({}, "mistral", "mistral"),  # the family it was loaded as, where that computes it
    ({}, "qwen2", "llama"),  # else the first that does
    ({"sliding_window": 5}, "llama", "mistral"),
    ({"sliding_window": 5, "sliding_layers": (2,), "qkv_bias": True}, None, "qwen2"),
    ({"n_experts": 4, "qk_norm": True, "normalize_top_k": False, "sliding_window": 5}, None, "qwen3_moe"),
])
def test_saving_picks_the_loaded_family_else_the_first_that_computes_the_model(changes, base, family):
    config = dataclasses.replace(PLAIN, **changes)
    raw = hf.config_json(config, None if base is None else {"model_type": base})
    assert (raw["model_type"], raw["architectures"]) == (family, [hf.get_family(family).architecture])


def test_qwen3_moe_without_a_window_field_slides_by_transformers_default(made, tmp_path):
    folder, _ = made["qwen3-moe-window"]
    raw = json.loads((folder / "config.json").read_text())
    del raw["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert hf.read_config(tmp_path).layer_windows == (4096, 4096)  # Qwen3MoeConfig's default


def test_qwen2_moe_with_a_window_is_refused_in_one_line(tmp_path):
    config = transformers.Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=40, shared_expert_intermediate_size=56,
                                         use_sliding_window=True, sliding_window=5)
    config.save_pretrained(tmp_path)
    with pytest.raises(UsageError) as error:
        hf.read_config(tmp_path)
    assert 'use_sliding_window=true is not supported (transformers windows Qwen2-MoE' in str(error.value)
    assert "\n" not in str(error.value)


def test_the_core_never_names_a_family():
    """Outside ``shardax.hf.families``, no string of ``shardax.hf`` is a family's ``model_type``
    or ``architecture``: the core looks families up in the registry."""
    import shardax.hf

    names = {f for kind in hf.family_names() for f in (kind, hf.get_family(kind).architecture)}
    root = Path(shardax.hf.__file__).parent
    found = [f"{path.name}: {node.value!r}" for path in sorted(root.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value in names]
    assert found == []
