"""The transformer LM: causal, positions, tied head, remat and mixed precision."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from small_models import tiny_transformer_config

from shardax.models.presets import GPT_STYLE, PRESETS, flops_per_token, parameter_count
from shardax.models.transformer import TransformerConfig, TransformerLM, next_token_loss

TOKENS = np.random.default_rng(0).integers(0, 64, size=(4, 17)).astype(np.int32)


def loss_and_grads(**overrides):
    model = TransformerLM(tiny_transformer_config(**overrides), rngs=nnx.Rngs(0))
    return nnx.value_and_grad(next_token_loss)(model, {"tokens": TOKENS})


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal_a_future_token_never_changes_earlier_logits(positions):
    model = TransformerLM(tiny_transformer_config(positions=positions), rngs=nnx.Rngs(0))
    changed = TOKENS.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    before, after = model(TOKENS[:, :16]), model(changed[:, :16])
    np.testing.assert_array_equal(np.asarray(before[:, :10]), np.asarray(after[:, :10]))
    assert not np.allclose(np.asarray(before[:, 10:]), np.asarray(after[:, 10:]))


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_changes_memory_not_results(remat):
    loss, grads = loss_and_grads()
    loss_remat, grads_remat = loss_and_grads(remat=remat)
    np.testing.assert_allclose(float(loss_remat), float(loss), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 grads_remat, grads)


def test_bfloat16_compute_keeps_float32_parameters():
    loss, _ = loss_and_grads()
    loss_bf16, grads_bf16 = loss_and_grads(compute_dtype="bfloat16")
    assert abs(float(loss_bf16) - float(loss)) < 0.02 * float(loss)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads_bf16)} == {jnp.dtype("float32")}


def test_layers_are_stacked_for_scan_and_annotated():
    model = TransformerLM(tiny_transformer_config(n_layers=3), rngs=nnx.Rngs(0))
    assert model.blocks.layers.qkv.shape == (3, 32, 3, 4, 8)
    assert model.blocks.layers.qkv.get_metadata()["out_sharding"] == ("layers", "embed", None, "heads", "kv")
    for _, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            assert variable.get_metadata().get("out_sharding"), "every parameter carries logical axes"


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.slow
def test_a_loop_of_blocks_computes_what_the_scan_does(remat):
    scanned = TransformerLM(tiny_transformer_config(remat=remat), rngs=nnx.Rngs(0))
    looped = TransformerLM(tiny_transformer_config(remat=remat, scan_layers=False), rngs=nnx.Rngs(1))
    assert (len(looped.blocks.layers) == 2
            and looped.blocks.layers[0].qkv.shape == scanned.blocks.layers.qkv.shape[1:])
    # no "layers"
    assert looped.blocks.layers[1].qkv.get_metadata()["out_sharding"] == ("embed", None, "heads", "kv")
    stacked = {path: variable for path, variable in nnx.iter_graph(scanned)
               if isinstance(variable, nnx.Param)}
    for path, variable in nnx.iter_graph(looped):  # the scan's weights, layer by layer
        if isinstance(variable, nnx.Param):
            if path[0] == "blocks":  # ("blocks", "layers", i, ...) -> ("blocks", "layers", ...)[i]
                variable[...] = stacked[("blocks", "layers", *path[3:])][...][path[2]]
            else:
                variable[...] = stacked[path][...]
    (loss, grads), (loop_loss, loop_grads) = (nnx.value_and_grad(next_token_loss)(m, {"tokens": TOKENS})
                                              for m in (scanned, looped))
    np.testing.assert_allclose(float(loop_loss), float(loss), rtol=1e-6)
    for i in range(2):
        pairs = zip(jax.tree.leaves(grads["blocks"]), jax.tree.leaves(loop_grads["blocks"]["layers"][i]),
                    strict=True)
        for stacked_grad, layer_grad in pairs:
            np.testing.assert_allclose(np.asarray(stacked_grad)[i], np.asarray(layer_grad), rtol=1e-4,
                                       atol=1e-6)


def test_tied_and_untied_heads():
    tied = TransformerLM(tiny_transformer_config(), rngs=nnx.Rngs(0))
    untied = TransformerLM(tiny_transformer_config(tie_embeddings=False), rngs=nnx.Rngs(0))
    assert not hasattr(tied, "head") and untied.head.shape == (32, 64)
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert count(untied) - count(tied) == 32 * 64
    assert count(tied) == parameter_count(tiny_transformer_config())


def test_presets_span_seconds_to_a_billion_parameters():
    assert parameter_count(PRESETS["tiny"].config()) < 1e6
    assert 0.9e9 < parameter_count(PRESETS["1b"].config()) < 1.2e9
    notebook = GPT_STYLE.config()
    assert (notebook.vocab_size, notebook.seq_len, notebook.d_model, notebook.n_heads, notebook.n_layers,
            notebook.d_ff, GPT_STYLE.batch_size) == (512, 64, 256, 8, 4, 1024, 32)
    for preset in PRESETS.values():  # one model family: each exports as a Hugging Face Llama
        assert ((preset.model["positions"], preset.model["norm"], preset.model["mlp"])
                == ("rotary", "rms", "swiglu"))


def test_bad_model_settings():
    with pytest.raises(ValueError, match="d_model=30 must divide by n_heads=4"):
        tiny_transformer_config(d_model=30)
    with pytest.raises(ValueError, match="remat='some'; use one of none, full"):
        tiny_transformer_config(remat="some")
    with pytest.raises(ValueError, match="param_dtype='float16'; use one of float32, bfloat16"):
        tiny_transformer_config(param_dtype="float16")


def test_training_16_bit_weights_is_warned_of_and_a_frozen_16_bit_base_is_not():
    """An optimizer's update well below a bfloat16 weight's spacing rounds to nothing: a step
    builder that trains such weights says so; LoRA adapters over a bfloat16 base, and a frozen
    bfloat16 part beside a trained one, train as well as in float32 and are not warned of."""
    import warnings

    import optax

    from shardax import Part, Trainer, parallelize

    def lm(**changes):
        config = tiny_transformer_config(param_dtype="bfloat16", **changes)
        return lambda rngs: TransformerLM(config, rngs=rngs)

    full = parallelize(lm(), optax.adam(1e-3), "data=8", "fsdp")
    warned = (r"^\d+ trained parameters are bfloat16 \(the first: blocks/.*\): updates much smaller than a "
              r"weight round away .* keep trained weights float32")
    with pytest.warns(UserWarning, match=warned):
        full.train_step(next_token_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapted = lm(lora_rank=2, lora_targets=("q", "o"))
        parallelize(adapted, optax.adam(1e-3), "data=8", "fsdp").train_step(next_token_loss)
        parts = {"policy": Part(adapted, optax.adam(1e-3)), "reference": Part(lm())}
        Trainer(parts=parts, step=lambda parts, batch: {}, strategy="fsdp").train_step()
    with pytest.warns(UserWarning, match=r"trained parameters of part 'policy' are bfloat16"):
        Trainer(parts={"policy": Part(lm(), optax.adam(1e-3))}, step=lambda parts, batch: {},
                strategy="fsdp").train_step()


def test_layer_norm_gradient_matches_autodiff_and_keeps_only_its_input():
    from shardax.models.ops import layer_norm

    def reference(x, scale, bias):
        mean = x.mean(-1, keepdims=True)
        variance = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(variance + 1e-5) * scale + bias

    keys = jax.random.split(jax.random.key(3), 4)
    x = 3.0 * jax.random.normal(keys[0], (2, 5, 48)) + 1.5
    scale, bias = 1 + jax.random.normal(keys[1], (48,)), jax.random.normal(keys[2], (48,))
    cotangent = jax.random.normal(keys[3], x.shape)
    ours, vjp = jax.vjp(layer_norm, x, scale, bias)
    expected, reference_vjp = jax.vjp(reference, x, scale, bias)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp(cotangent), reference_vjp(cotangent)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    residuals = jax.tree.leaves(jax.linearize(layer_norm, x, scale, bias)[1])  # what the backward pass keeps
    assert sum(leaf.size for leaf in residuals if hasattr(leaf, "size")) <= x.size + scale.size


def test_rms_norm_and_swiglu_gradients_match_autodiff_and_keep_only_their_inputs():
    """The Llama family's RMSNorm and SwiGLU with backward passes of their own: the same values and
    gradients as the plain formulas, keeping their inputs alone for the backward pass."""
    from shardax.models.ops import rms_norm, swiglu

    keys = jax.random.split(jax.random.key(5), 5)
    x = 3.0 * jax.random.normal(keys[0], (2, 5, 48)) + 1.5
    scale, cotangent = 1 + jax.random.normal(keys[1], (48,)), jax.random.normal(keys[2], x.shape)
    plain_rms = lambda x, scale: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale  # noqa: E731
    plain_swiglu = lambda gate, up: jax.nn.silu(gate) * up  # noqa: E731
    up = jax.random.normal(keys[3], x.shape)
    for ours_fn, plain_fn, args in ((lambda x, scale: rms_norm(x, scale, 1e-6), plain_rms, (x, scale)),
                                    (swiglu, plain_swiglu, (x, up))):
        ours, vjp = jax.vjp(ours_fn, *args)
        expected, reference_vjp = jax.vjp(plain_fn, *args)
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
        for got, want in zip(vjp(cotangent), reference_vjp(cotangent)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        residuals = jax.tree.leaves(jax.linearize(ours_fn, *args)[1])  # what the backward pass keeps
        assert sum(leaf.size for leaf in residuals if hasattr(leaf, "size")) <= sum(arg.size for arg in args)


def test_gelu_keeps_only_its_input_and_matches_autodiff():
    from shardax.models.ops import gelu

    x = jnp.linspace(-6.0, 6.0, 1001)
    cotangent = jnp.cos(x)
    ours, vjp = jax.vjp(gelu, x)
    reference, reference_vjp = jax.vjp(jax.nn.gelu, x)
    np.testing.assert_array_equal(ours, reference)
    np.testing.assert_allclose(vjp(cotangent)[0], reference_vjp(cotangent)[0], rtol=1e-6, atol=1e-7)
    residuals = jax.tree.leaves(jax.linearize(gelu, x)[1])  # what the backward pass keeps
    assert sum(leaf.size for leaf in residuals if hasattr(leaf, "size")) <= x.size


def recomputed_ops(config, attention=None):
    """{HLO opcode: count} of what the compiled backward pass of ``config``'s model recomputes
    (instructions XLA tags as the rematted computation), with ``attention`` in place of
    ``jax.nn.dot_product_attention`` when given."""
    import shardax.models.transformer as transformer

    model = TransformerLM(config, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)

    def loss(state):
        return next_token_loss(nnx.merge(graph, state), {"tokens": jnp.asarray(TOKENS)})

    original = transformer.jax.nn.dot_product_attention
    if attention is not None:
        transformer.jax.nn.dot_product_attention = attention
    try:
        text = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    finally:
        transformer.jax.nn.dot_product_attention = original
    counts = collections.Counter()
    for line in text.splitlines():
        found = re.search(r"= \S+ ([\w-]+)\(.*op_name=\"([^\"]*)\"", line)
        if found and "rematted_computation" in found.group(2):
            counts[found.group(1)] += 1
    return counts


def fused_attention_stand_in(query, key, value, mask=None, is_causal=False, implementation=None):
    """XLA's attention behind a custom VJP, as cuDNN's fused kernel is: one opaque primitive."""
    attend = functools.partial(ORIGINAL_ATTENTION, mask=mask, is_causal=is_causal)

    @jax.custom_vjp
    def attention(query, key, value):
        return attend(query, key, value)

    def forward(query, key, value):
        return attention(query, key, value), (query, key, value)

    def backward(saved, cotangent):
        return jax.vjp(attend, *saved)[1](cotangent)

    attention.defvjp(forward, backward)
    return attention(query, key, value)


ORIGINAL_ATTENTION = jax.nn.dot_product_attention


@pytest.mark.slow
def test_dots_saveable_recomputes_no_matmul_and_no_custom_vjp_in_the_backward_pass():
    """Remat by name: the policy refuses only gathered weights and reduced-precision copies, so
    under ``dots_saveable`` no matmul (attention's included) and no custom VJP (a stand-in for
    cuDNN's fused attention: its softmax's exponential) is run again in the backward pass, and
    ``--remat none`` recomputes nothing at all. Full remat, counted the same way, does."""
    dots = recomputed_ops(tiny_transformer_config(remat="dots_saveable"), fused_attention_stand_in)
    assert dots["dot"] == 0 and dots["exponential"] == 0, dict(dots)
    assert recomputed_ops(tiny_transformer_config(remat="dots_saveable"))["dot"] == 0
    assert not recomputed_ops(tiny_transformer_config(remat="none"), fused_attention_stand_in)
    full = recomputed_ops(tiny_transformer_config(remat="full"), fused_attention_stand_in)
    assert full["dot"] >= 4 and full["exponential"] >= 1, dict(full)


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_flops_per_token_is_what_xla_counts_in_the_step(lora_rank):
    """MFU's numerator (6 N + 12 L d T per token; under LoRA 4 per frozen weight and 6 per
    adapter parameter) against XLA's own count of the compiled step's FLOPs, differentiated as
    training does (LoRA: by the adapters alone): layers in a loop, since XLA's count does not
    multiply a scan's body by its length."""
    config = PRESETS["tiny"].config(seq_len=64, scan_layers=False, lora_rank=lora_rank)
    model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    graphdef, trained, frozen = nnx.split(model, nnx.LoRAParam if lora_rank else nnx.Param, ...)

    def loss(trained, frozen, tokens):
        return next_token_loss(nnx.merge(graphdef, trained, frozen), {"tokens": tokens})

    tokens = jax.ShapeDtypeStruct((8, config.seq_len + 1), jnp.int32)
    cost = jax.jit(jax.grad(loss)).lower(trained, frozen, tokens).compile().cost_analysis()
    counted = (cost[0] if isinstance(cost, list) else cost)["flops"]
    # the formula counts matmuls only; layer norms, GELU, softmax and the loss add a little
    assert 1.0 < counted / (flops_per_token(config) * 8 * config.seq_len) < 1.05


def test_bfloat16_weight_copies_are_cast_again_in_the_backward_pass_not_kept():
    """Mixed precision casts each layer's weights to bfloat16; autodiff keeps activations in
    bfloat16 but no bfloat16 copy of a weight (it would cost half the parameters' bytes)."""
    model = TransformerLM(tiny_transformer_config(compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return next_token_loss(nnx.merge(graphdef, params, rest), {"tokens": TOKENS})

    kept = jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params))
    weight_shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(params)}
    bfloat16 = [tuple(leaf.shape) for leaf in kept if leaf.dtype == jnp.bfloat16]
    assert bfloat16 and not weight_shapes & set(bfloat16)


def reference_attention(q, k, v, segments=None):
    """softmax(q k^T / sqrt(h)) v, causal and (with segments) within each document, written out."""
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1])
    allowed = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))[None, None]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    weights = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights, v)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.slow
def test_attention_kernel_matches_attention_written_out(packed, monkeypatch):
    """Outputs and gradients of the model's attention (auto, which is XLA on CPU) equal the formula."""
    import shardax.models.transformer as transformer

    config = TransformerConfig(vocab_size=64, seq_len=24, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 24), 0, 64)
    segments = jnp.asarray(np.repeat(np.arange(1, 5), 6)[None].repeat(3, 0)) if packed else None

    def loss(model):
        return (model(tokens, segments) ** 2).mean()

    expected_loss, expected_grads = nnx.value_and_grad(loss)(model)

    def written_out(q, k, v, mask=None, is_causal=True, implementation=None):
        return reference_attention(q, k, v, segments)

    monkeypatch.setattr(transformer.jax.nn, "dot_product_attention", written_out)
    got_loss, got_grads = nnx.value_and_grad(loss)(model)
    np.testing.assert_allclose(got_loss, expected_loss, rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(expected_grads)),
                                 nnx.to_flat_state(nnx.state(got_grads))):
        np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), rtol=1e-4, atol=1e-6,
                                   err_msg=str(path))


@pytest.mark.parametrize("attention, precision, heads, platform, expected", [
    ("auto", "bfloat16", 4, "gpu", ("cudnn", "fused cuDNN kernel")),
    ("auto", "bfloat16", 4, "cpu", ("xla", "cuDNN does not apply: it needs a GPU (this is cpu)")),
    ("auto", "float32", 4, "gpu", ("xla", "it needs bfloat16 compute (or float16; this is float32)")),
    ("auto", "bfloat16", 3, "gpu", ("xla", "multiple of 8 and at most 256 (this is 20)")),
    ("xla", "bfloat16", 4, "gpu", ("xla", "asked for")),
    ("cudnn", "bfloat16", 4, "gpu", ("cudnn", "fused cuDNN kernel")),
])
def test_attention_auto_says_which_kernel_and_why(attention, precision, heads, platform, expected):
    from shardax.models.transformer import attention_implementation

    config = TransformerConfig(d_model=60 if heads == 3 else 256, n_heads=heads, compute_dtype=precision,
                               attention=attention)
    kernel, why = attention_implementation(config, platform)
    assert kernel == expected[0] and expected[1] in why


def test_cudnn_attention_where_it_cannot_run_is_a_one_line_error():
    from shardax.errors import UsageError
    from shardax.models.transformer import attention_implementation

    with pytest.raises(UsageError,
                       match=r"`attention='cudnn'`: it needs a GPU \(this is cpu\); it needs bfloat16"):
        attention_implementation(TransformerConfig(attention="cudnn"), "cpu")
