"""Named model sizes, from seconds on a laptop CPU to about a billion parameters.

Each preset is a model shape plus the training settings it is meant to run with; flags
override any of them. Parameter counts are for the byte vocabulary (256) unless stated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardax.errors import UsageError
from shardax.models.transformer import TransformerConfig
from shardax.sharding.strategies import STRATEGIES


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model shape and the run settings that suit it."""

    model: dict[str, Any]
    steps: int
    batch_size: int
    lr: float
    description: str

    def config(self, **overrides: Any) -> TransformerConfig:
        return TransformerConfig(**{**self.model, **overrides})


# Every preset is Llama-shaped (rotary positions, RMSNorm, a SwiGLU MLP of about 8/3 the width,
# no biases), so that any run exports as a Hugging Face Llama checkpoint (``shardax export
# --hf``), loads in transformers and fine-tunes with ``--init-from``. Each SwiGLU width keeps
# the parameter count of the GELU MLP (4x the width) the presets had before.
LLAMA = dict(positions="rotary", norm="rms", mlp="swiglu")

PRESETS: dict[str, Preset] = {
    "tiny": Preset(dict(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4, d_ff=344, **LLAMA),
                   steps=500, batch_size=32, lr=3e-3,
                   description="0.8M parameters: the default run, about a minute and a half on a 2-core CPU"),
    "small": Preset(dict(vocab_size=256, seq_len=256, d_model=384, n_heads=6, n_layers=6, d_ff=1024, **LLAMA),
                    steps=2000, batch_size=64, lr=1e-3, description="11M parameters"),
    "medium": Preset(dict(vocab_size=256, seq_len=512, d_model=768, n_heads=12, n_layers=12, d_ff=2048,
                          **LLAMA),
                     steps=5000, batch_size=64, lr=6e-4, description="85M parameters (GPT-2 small's body)"),
    "large": Preset(dict(vocab_size=256, seq_len=1024, d_model=1024, n_heads=16, n_layers=24, d_ff=2752,
                         **LLAMA),
                    steps=10000, batch_size=64, lr=3e-4, description="302M parameters"),
    "1b": Preset(dict(vocab_size=256, seq_len=1024, d_model=2048, n_heads=16, n_layers=20, d_ff=5504,
                      remat="dots_saveable", **LLAMA), steps=10000, batch_size=64, lr=2e-4,
                 description="1.0B parameters (remat on by default)"),
}

# A GPT-2-style model (learned positions, layer norms, a GELU MLP with biases), the shape of the
# data-parallel notebook's that shardax's benchmarks compare with; it is not a preset of
# ``shardax train`` (it has no Hugging Face form to export to).
GPT_STYLE = Preset(dict(vocab_size=512, seq_len=64, d_model=256, n_heads=8, n_layers=4, d_ff=1024,
                        positions="learned", tie_embeddings=False), steps=50, batch_size=32, lr=3e-4,
                   description="GPT-2-style: vocab 512, seq 64, d 256, 8 heads, 4 layers, learned positions")


# The presets as shardax 0.1 had them (layer norms, GELU MLPs with biases, 4x the width), on
# which ``shardax plan``'s working-set factors were fitted (``benchmarks/plan_fit.py``): what
# reproduces that fit and what the tests that keep it from drifting compile.
PRESETS_0_1: dict[str, Preset] = {
    name: dataclasses.replace(preset, model={**{k: v for k, v in preset.model.items() if k not in LLAMA},
                                             "positions": "rotary", "d_ff": 4 * preset.model["d_model"]})
    for name, preset in PRESETS.items()} | {"gpt-style": GPT_STYLE}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UsageError(f"unknown `preset={name!r}`; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def parameter_count(config: TransformerConfig) -> int:
    """Parameters of a ``TransformerLM`` with this config, from its shapes."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    n, k, h = config.n_heads, config.kv_heads, config.head_dim
    norm = 2 * d if config.norm == "layer" else d
    attention = d * (n + 2 * k) * h + n * h * d + ((n + 2 * k) * h if config.qkv_bias else 0)
    attention += 2 * h if config.qk_norm else 0
    mlp = 3 * d * f if config.mlp in ("swiglu", "geglu") else 2 * d * f + f + d  # GELU's with its biases
    if config.n_experts:  # router, each expert's gated MLP, and a gated shared expert
        e, shared = config.n_experts, config.shared_expert_d_ff or 0
        mlp = d * e + e * 3 * d * config.ff_width + (3 * d * shared + d if shared else 0)
    per_layer = attention + mlp + (4 if config.post_norms else 2) * norm
    tables = v * d * (1 if config.tie_embeddings else 2)
    positions = config.seq_len * d if config.positions == "learned" else 0
    return config.n_layers * per_layer + tables + positions + norm


def adapter_count(config: TransformerConfig) -> int:
    """LoRA adapter parameters of a ``TransformerLM`` with this config (0 without LoRA); not
    counted by ``parameter_count``, which counts the base model."""
    return config.n_layers * sum(config.lora_rank * (math.prod(inputs) + math.prod(outputs))
                                 for inputs, _, outputs, _ in config.lora_shapes().values())


def flops_per_token(config: TransformerConfig) -> int:
    """Model FLOPs of one training token (forward and backward), the numerator of MFU.

    6 N + 12 L d T: every parameter takes part in one multiply-add per token forward and two
    backward (6 N with N = ``parameter_count``), and attention's two matmuls (Q K^T and the
    weighted sum of V) cost 4 d T per token and layer forward, 12 d T with the backward pass,
    counted over the whole T x T square as PaLM's appendix B does (causal masking halves the
    useful work but not what dense kernels compute). Recomputation under remat is not counted:
    MFU measures useful work. A mixture of experts counts the experts a token goes through (k
    of E). Under LoRA a frozen weight costs 4 per token (forward, and the gradient through it;
    it has none of its own) and each adapter parameter 6.
    """
    active = parameter_count(config)
    if config.n_experts:
        active -= (config.n_layers * (config.n_experts - config.experts_per_token) * 3 * config.d_model
                   * config.ff_width)
    attention = 12 * config.n_layers * config.d_model * config.seq_len
    if config.lora_rank:
        return 4 * active + 6 * adapter_count(config) + attention
    return 6 * active + attention


def blocks_in_a_loop(platform: str, strategy: str) -> bool:
    """Whether ``shardax train`` (and ``shardax plan`` for a GPU target) lays a new run's blocks in
    a Python loop when ``--scan-layers`` is not given (else it scans them): on GPUs, under the
    strategies that keep each weight and its gradient whole on a data-parallel device and have no
    pipeline (dp, zero1, tp).

    On an H100 the loop's step is faster than the scan's in about the same memory. XLA:TPU's
    compile of ``small`` holds less with the loop under those strategies, but more where gradients
    or weights are sharded (zero2, fsdp, hsdp, fsdp_tp), so those scan everywhere (benchmark 24 in
    docs/benchmarks.md). TPUs and CPUs scan: no TPU has timed it, and the scan's compile time stays
    flat in depth.
    """
    chosen = STRATEGIES.get(strategy)
    return (platform == "gpu" and chosen is not None and chosen.fsdp_axis is None
            and not chosen.shard_gradients and chosen.pipeline_axis is None)
