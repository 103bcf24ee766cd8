"""``shardax.generate``: a key/value cache decoder, token for token the full forward's argmax.

Each strategy's model is the same (same seed); greedy decoding of a batch of prompts of
different lengths must equal the argmax of the whole model re-run over the growing sequence
(no cache), each prompt decoded alone, and seeded sampling the same tokens on every mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from small_models import tiny_transformer_config

import shardax
from shardax import DeviceMeshManager, parallelize
from shardax.blocks import Attention, init_cache
from shardax.decoding import DecodeSpec
from shardax.errors import UsageError
from shardax.generation import cache_layout
from shardax.models.transformer import TransformerLM

pytestmark = pytest.mark.xdist_group("test_generation")

# grouped-query attention (2 key/value heads), RoPE, and a learned-position model beside it
CONFIGS = {
    "llama": tiny_transformer_config(seq_len=64, n_kv_heads=2, positions="rotary", norm="rms", mlp="swiglu",
                                     tie_embeddings=False, d_ff=48),
    "gpt": tiny_transformer_config(seq_len=64),
    # every layer windowed (Mistral's way): the cache is a ring of 32 positions (the prompts' bucket)
    "mistral": tiny_transformer_config(seq_len=64, n_kv_heads=2, positions="rotary", norm="rms", mlp="swiglu",
                                       sliding_window=8, d_ff=40),
    # a windowed layer beside a full one (Gemma 2's way; Qwen2's max_window_layers in a Python loop of
    # layers): the windowed layer's ring stays at 32 positions while the full layer's cache grows to 64
    "gemma2": tiny_transformer_config(seq_len=64, n_kv_heads=2, positions="rotary", norm="rms", mlp="swiglu",
                                      sliding_window=8, sliding_layers=(0,), d_ff=40),
    "qwen2-loop": tiny_transformer_config(seq_len=64, n_kv_heads=2, positions="rotary", norm="rms",
                                          mlp="swiglu", sliding_window=8, sliding_layers=(1,), d_ff=40,
                                          scan_layers=False),
}
RINGED = {"gemma2", "qwen2-loop"}
PROMPTS = [[1, 5, 9, 3, 7], [2, 4], [9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 30  # the cache grows once: 32 positions (the prompts' bucket), then 64
STRATEGIES = [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2"), ("fsdp_tp", "data=4,model=2")]
_SEEN: dict = {}


def model_on(name, strategy, mesh):
    config = CONFIGS[name]
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.identity(),
                           DeviceMeshManager().create_device_mesh(mesh), strategy)
    return parallel.merge(parallel.init(3))


def full_forward_greedy(model, prompt, new, window=None):
    """The argmax of the whole model over the growing sequence, no cache: one compiled forward
    over a fixed window (default: the model's ``seq_len``), read at the last real token."""
    window = window or model.config.seq_len
    forward = jax.jit(lambda model, tokens: model(tokens))
    tokens = list(prompt)
    for _ in range(new):
        padded = np.zeros((1, window), np.int32)
        padded[0, :len(tokens)] = tokens
        tokens.append(int(jnp.argmax(forward(model, padded)[0, len(tokens) - 1])))
    return tokens[len(prompt):]


# each model on two strategies (its seeded draws compared across them), each strategy with two or
# three models: every model and every strategy decode, without the whole product of the two
PAIRED = [("llama", "dp"), ("llama", "fsdp_tp"), ("gpt", "fsdp"), ("gpt", "tp"), ("mistral", "tp"),
          ("mistral", "dp"), ("gemma2", "fsdp_tp"), ("gemma2", "fsdp"), ("qwen2-loop", "dp"),
          ("qwen2-loop", "tp")]


@pytest.mark.parametrize("strategy, mesh, name", [(strategy, dict(STRATEGIES)[strategy], name)
                                                  for name, strategy in PAIRED],
                         ids=[f"{strategy}-{name}" for name, strategy in PAIRED])
def test_greedy_decoding_is_the_full_forward_argmax_on_every_strategy(strategy, mesh, name):
    model = model_on(name, strategy, mesh)
    greedy = shardax.generate(model, PROMPTS, max_new_tokens=NEW)
    assert greedy == [full_forward_greedy(model, prompt, NEW) for prompt in PROMPTS]
    stats = greedy.stats  # how fast: every row's tokens counted, one decode step per token after the first
    assert (stats.rows, stats.new_tokens, stats.prompt_tokens) == (len(PROMPTS), NEW * len(PROMPTS),
                                                                   sum(map(len, PROMPTS)))
    assert stats.decode_steps == NEW - 1 and 0 < stats.decode_step_s and stats.tokens_per_s > 0
    assert 0 < stats.time_to_first_token_s < stats.total_s
    assert stats.describe().startswith(f"{NEW * len(PROMPTS)} new tokens for {len(PROMPTS)} prompts")
    assert [shardax.generate(model, [prompt], max_new_tokens=NEW)[0] for prompt in PROMPTS] == greedy
    sampled = shardax.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.9, top_k=20, top_p=0.9,
                               seed=5)
    assert _SEEN.setdefault((name, "sampled"), sampled) == sampled  # the same draws on every mesh
    assert sampled != greedy and all(len(row) == NEW for row in sampled)
    layout = cache_layout(model, len(PROMPTS), max(map(len, PROMPTS)), NEW)
    data = 4 if "model" in mesh else 8
    assert layout.lengths == ((32,) if name == "mistral" else (32, 64)) and layout.prompt_length == 32
    assert layout.ring == (32 if name in RINGED else None)
    # what the decoder held at the end is what the layout says: a windowed layer beside a full one
    # holds 32 positions where the full one holds 64 (3/4 of a cache that grew whole)
    assert stats.cache_bytes_per_device == layout.bytes_per_device(model.config)
    if name in RINGED:
        grown_whole = dataclasses.replace(layout, ring=None).bytes_per_device(model.config)
        assert stats.cache_bytes_per_device * 4 == grown_whole * 3
    assert layout.batch == data and layout.spec == (("data",), "model" if "model" in mesh else None, None,
                                                    None)
    if name == "llama":  # 2 layers x keys and values x rows x 64 positions x 2 heads x 8 dims x 4 bytes,
        # split
        assert layout.bytes_per_device(model.config) == 2 * 2 * data * 64 * 2 * 8 * 4 // 8


@pytest.mark.parametrize("name, strategy, mesh", [("gemma2", "fsdp_tp", "data=4,model=2"),
                                                  ("qwen2-loop", "tp", "data=4,model=2")])
# the fast tier decodes through a cache in test_greedy_decoding_is_the_full_forward_argmax_on_every_strategy
@pytest.mark.slow
def test_a_16_bit_cache_decodes_as_the_same_values_held_in_float32(name, strategy, mesh):
    """A bfloat16 model's cache (held as the floats' bits: shardax.runtime.kv_cache.BITS) decodes
    the tokens that a float32 cache of the same keys and values does, in half the bytes, through a
    scanned stack with a ring beside the full layers and through a Python loop of layers; a
    float32 model's cache held in bfloat16 (``cache_dtype``) takes half the bytes too."""
    config = dataclasses.replace(CONFIGS[name], compute_dtype="bfloat16")
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.identity(),
                           DeviceMeshManager().create_device_mesh(mesh), strategy)
    model = parallel.merge(parallel.init(3))
    held = shardax.generate(model, PROMPTS, max_new_tokens=NEW)
    wide = shardax.generate(model, PROMPTS, max_new_tokens=NEW, cache_dtype="float32")
    assert held == wide
    layout = cache_layout(model, len(PROMPTS), max(map(len, PROMPTS)), NEW)
    assert layout.dtype == "bfloat16" and held.stats.cache_bytes_per_device == layout.bytes_per_device(config)
    assert 2 * held.stats.cache_bytes_per_device == wide.stats.cache_bytes_per_device
    narrow = shardax.generate(model_on(name, strategy, mesh), PROMPTS, max_new_tokens=NEW,
                              cache_dtype="bfloat16")
    assert 2 * narrow.stats.cache_bytes_per_device == wide.stats.cache_bytes_per_device
    assert all(len(row) == NEW for row in narrow)
    # a model given a bfloat16 cache, then a float32 one in its place (init_cache is public), reads
    # the float32 one as floats: the prompt's logits are a fresh float32 cache's
    alone, tokens = TransformerLM(CONFIGS[name], rngs=nnx.Rngs(0)), jnp.asarray([PROMPTS[0]])
    alone.eval()
    logits = []
    for dtypes in ((jnp.float32,), (jnp.bfloat16, jnp.float32)):
        for dtype in dtypes:
            init_cache(alone, 1, 32, CONFIGS[name].kv_heads, CONFIGS[name].head_dim, dtype)
        logits.append(alone(tokens, positions=jnp.arange(tokens.shape[1])[None]))
    np.testing.assert_array_equal(logits[0], logits[1])


def test_stop_tokens_and_bad_requests():
    model = model_on("llama", "dp", "data=8")
    greedy = shardax.generate(model, PROMPTS, max_new_tokens=NEW)
    stop = greedy[0][3]
    stopped = shardax.generate(model, PROMPTS, max_new_tokens=NEW, stop=stop)
    for row, full in zip(stopped, greedy):
        end = full.index(stop) + 1 if stop in full else NEW
        assert row == full[:end]
    pair = tuple(greedy[1][2:4])  # a stop of two tokens (a chat template's end of turn may take several)
    stopped = shardax.generate(model, PROMPTS, max_new_tokens=NEW, stop=[pair, 10**6])
    for row, full in zip(stopped, greedy):
        end = next((i + 2 for i in range(NEW - 1) if tuple(full[i:i + 2]) == pair), NEW)
        assert row == full[:end]
    with pytest.raises(UsageError, match="a prompt of 19 tokens and 60 new ones need 79 positions, "
                                         "more than the model's 64"):
        shardax.generate(model, PROMPTS, max_new_tokens=60)
    with pytest.raises(UsageError, match="prompt 1 holds token id 64, outside the model's vocabulary of 64"):
        shardax.generate(model, [[1], [64]])
    with pytest.raises(UsageError, match="decodes a model that implements shardax.decoding.CachedDecoder"):
        shardax.generate(object(), PROMPTS)
    with pytest.raises(UsageError, match="temperature >= 0, top_k >= 0 and 0 < top_p <= 1"):
        shardax.generate(model, PROMPTS, top_p=0)
    for wrong in ("int8", "float8"):
        with pytest.raises(UsageError, match=f"cache_dtype='{wrong}' is not a dtype the key/value "
                                             "cache holds; use one of float32, bfloat16, float16 "
                                             "\\(None: the model's compute dtype, float32\\)"):
            shardax.generate(model, PROMPTS, cache_dtype=wrong)


class TinyDecoder(nnx.Module):
    """A user's language model of one attention layer, built from shardax's public blocks, that
    implements ``shardax.decoding.CachedDecoder``: learned positions, ``shardax.blocks.Attention``
    (which reads and writes the cache ``shardax.blocks.init_cache`` gives it), a tied head."""

    VOCAB, LENGTH, HEADS, HEAD = 32, 48, 2, 4

    def __init__(self, rngs):
        width = self.HEADS * self.HEAD
        self.embed = nnx.Embed(self.VOCAB, width, rngs=rngs)
        self.position = nnx.Embed(self.LENGTH, width, rngs=rngs)
        self.qkv = nnx.LinearGeneral(width, (3, self.HEADS, self.HEAD), rngs=rngs)
        self.attention = Attention()
        self.out = nnx.LinearGeneral((self.HEADS, self.HEAD), width, axis=(-2, -1), rngs=rngs)

    def decode_spec(self):
        return DecodeSpec(self.VOCAB, self.LENGTH, self.HEADS, self.HEAD, "float32", layer_windows=(0,))

    def init_cache(self, batch, length, dtype, sharding=None, *, ring=None):
        init_cache(self, batch, length, self.HEADS, self.HEAD, dtype, sharding, ring=ring)

    def __call__(self, tokens, positions=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens) + self.position(positions)
        q, k, v = jnp.moveaxis(self.qkv(x), 2, 0)  # each (B, T, heads, head)
        x = x + self.out(self.attention(q, k, v, positions=positions))
        return self.embed.attend(x)


@pytest.mark.parametrize("mesh", [None, "data=8"])
def test_a_users_model_that_implements_the_protocol_generates(mesh):
    """generate() decodes any CachedDecoder, not only shardax's TransformerLM: a user's model of
    shardax's blocks, alone and placed on a mesh, gives the full forward's argmax token for token;
    a model that lacks the protocol is refused in one line naming what it lacks."""
    if mesh is None:
        model = TinyDecoder(nnx.Rngs(0))
    else:
        parallel = parallelize(TinyDecoder, optax.identity(), mesh, "dp")
        model = parallel.merge(parallel.init(0))
    prompts = [[p % TinyDecoder.VOCAB for p in prompt] for prompt in PROMPTS]
    greedy = shardax.generate(model, prompts, max_new_tokens=20)
    assert greedy == [full_forward_greedy(model, prompt, 20, TinyDecoder.LENGTH) for prompt in prompts]
    assert greedy.stats.cache_bytes_per_device == cache_layout(model, 3, 19, 20).bytes_per_device(
        model.decode_spec())

    class Plain(nnx.Module):  # a model, but not a CachedDecoder
        def __call__(self, tokens, positions=None):
            return jax.nn.one_hot(tokens, 8)

    with pytest.raises(UsageError) as error:
        shardax.generate(Plain(), [[1, 2]])
    assert str(error.value) == ("generate() decodes a model that implements shardax.decoding.CachedDecoder "
                                "(decode_spec() and init_cache(), as shardax's TransformerLM does); "
                                "this Plain has no decode_spec() and has no init_cache()")
