"""The shape and numerics of shardax's transformer LM (``TransformerConfig``).

Besides shardax's own presets (layer norm, GELU MLP with biases) it describes the model
families Hugging Face defines that ``shardax.hf`` loads: the Llama family (RMSNorm, SwiGLU,
grouped-query attention, RoPE with Llama 3's scaling, Qwen2's q/k/v biases, Qwen3's q/k norms,
Mistral's and Qwen2's sliding windows) and Gemma 1, 2 and 3 (GeGLU, RMSNorm scaled by
``1 + weight``, embeddings scaled by the square root of the width, norms after attention and
the MLP too, soft-capped scores and logits, local layers with a window and a RoPE base of their
own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from shardax.blocks import REMAT_POLICIES
from shardax.errors import UsageError
from shardax.vocabulary import ATTENTION_KERNELS, LORA_TARGETS

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


ATTENTION = ATTENTION_KERNELS


NORMS = ("layer", "rms", "rms_plus_one")


MLPS = ("gelu", "swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape and numerics of the model."""

    vocab_size: int = 256  # bytes
    seq_len: int = 128  # longest context (learned positions are this long)
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    positions: str = "learned"  # "learned" or "rotary"
    tie_embeddings: bool = True
    remat: str = "none"  # a key of REMAT_POLICIES
    compute_dtype: str = "float32"  # "float32" or "bfloat16"
    # The weights' own dtype ("float32" or "bfloat16"; LoRA's adapters stay float32). bfloat16
    # halves their memory and changes nothing for weights that never change, as a checkpoint's
    # bfloat16 weights frozen under LoRA or generated from; trained in bfloat16, an update smaller
    # than 1/256 of its weight is lost.
    param_dtype: str = "float32"
    # False: one module per block in a Python loop, as most hand-written models do. Compile time
    # grows with depth, and FSDP gathers every layer's weights up front instead of one layer at a
    # time; in exchange shallow models skip the scan's stacking buffers (faster on CPU).
    scan_layers: bool = True
    # How attention is computed, through jax.nn.dot_product_attention: "xla" (plain XLA ops),
    # "cudnn" (the fused cuDNN kernel; GPU only) or "auto" (cuDNN where it applies, else XLA;
    # ``attention_implementation`` says which and why).
    attention: str = "auto"
    # The Llama family (defaults: shardax's own blocks)
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads (None: n_heads)
    attention_head_dim: int | None = None  # each head's size (None: d_model // n_heads)
    # "layer" (scale and bias, eps 1e-5), "rms" (x / rms(x) * scale, eps norm_eps) or "rms_plus_one"
    # (x / rms(x) * (1 + scale), Gemma's: the scale starts at zero)
    norm: str = "layer"
    norm_eps: float = 1e-5
    # "gelu" (with biases), "swiglu" (silu(gate) * up, no biases) or "geglu" (gelu(gate) * up,
    # tanh GELU: Gemma)
    mlp: str = "gelu"
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    rope_theta: float = 10000.0
    # Llama 3's RoPE scaling: (factor, low_freq_factor, high_freq_factor, original context length)
    rope_scaling: tuple[float, float, float, int] | None = None
    # Sliding-window attention: a query sees the latest ``sliding_window`` tokens, its own included
    # (0: no window), in the layers ``sliding_layers`` names (None: every layer; Gemma 2 and 3 slide
    # in some, Qwen2 from max_window_layers on); the others attend to the whole sequence.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3; None: rope_theta)
    rope_linear_factor: float = 1.0  # RoPE positions divided by this in the other layers (Gemma 3's "linear")
    # The Gemma family
    scale_embeddings: bool = False  # the embeddings times sqrt(d_model) on the way in (not in the tied head)
    post_norms: bool = False  # a norm after attention and after the MLP too, before each residual add
    attention_scale: float | None = None  # the scores' scale (None: head_dim ** -0.5)
    attention_softcap: float | None = None  # scores capped as cap * tanh(score / cap) (Gemma 2)
    logits_softcap: float | None = None  # the output logits capped the same way (Gemma 2)
    # A mixture of experts in every layer's place of the MLP (0: a dense MLP): each token through the
    # ``experts_per_token`` of ``n_experts`` gated MLPs (``mlp``: swiglu or geglu) of ``expert_d_ff``
    # hidden units (None: d_ff) its router weighs highest, their weights renormalised to sum to 1 with
    # ``normalize_top_k`` (Mixtral; Qwen3-MoE's norm_topk_prob); dropless unless ``capacity_factor``.
    n_experts: int = 0
    experts_per_token: int = 2
    expert_d_ff: int | None = None
    normalize_top_k: bool = True
    capacity_factor: float | None = None
    shared_expert_d_ff: int = 0  # a shared expert every token goes through, gated by sigmoid(x w) (Qwen2-MoE)
    router_aux_loss: float = 0.0  # the load-balancing loss's weight in the training loss (Mixtral: 0.001)
    router_z_loss: float = 0.0  # the router z-loss's weight (ST-MoE: 0.001)
    # LoRA: adapters of this rank on ``lora_targets`` (0: none), scaled by lora_alpha / lora_rank
    lora_rank: int = 0
    lora_alpha: float | None = None  # None: the rank (a scale of 1)
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.attention_head_dim is None and self.d_model % self.n_heads:
            raise UsageError(f"d_model={self.d_model} must divide by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise UsageError(f"n_heads={self.n_heads} must divide by n_kv_heads={self.kv_heads} "
                             "(grouped-query attention shares each key/value head among as many query heads)")
        if self.norm not in NORMS:
            raise UsageError(f"norm={self.norm!r}; use one of {', '.join(NORMS)}")
        if self.mlp not in MLPS:
            raise UsageError(f"mlp={self.mlp!r}; use one of {', '.join(MLPS)}")
        if self.positions not in ("learned", "rotary"):
            raise UsageError(f"positions={self.positions!r}; use 'learned' or 'rotary'")
        if self.remat not in REMAT_POLICIES:
            raise UsageError(f"remat={self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise UsageError(f"compute_dtype={self.compute_dtype!r}; use one of {', '.join(COMPUTE_DTYPES)}")
        if self.param_dtype not in COMPUTE_DTYPES:
            raise UsageError(f"param_dtype={self.param_dtype!r}; use one of {', '.join(COMPUTE_DTYPES)}")
        if self.attention not in ATTENTION:
            raise UsageError(f"attention={self.attention!r}; use one of {', '.join(ATTENTION)}")
        self._check_lora()
        self._check_windows_and_caps()

    def _check_lora(self) -> None:
        if self.lora_rank < 0:
            raise UsageError(f"lora_rank={self.lora_rank} must be at least 0 (0: no LoRA, full fine-tuning)")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or not self.lora_targets or len(set(self.lora_targets)) != len(self.lora_targets):
            raise UsageError(f"lora_targets={','.join(self.lora_targets)!r}: name each projection once, from "
                             f"{','.join(LORA_TARGETS)}")
        if self.lora_rank and self.mlp == "gelu" and "gate" in self.lora_targets and not self.n_experts:
            raise UsageError(f"lora_targets includes 'gate' but this model's {self.mlp} MLP has no gate "
                             "projection; drop gate from the targets")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise UsageError(f"lora_alpha={self.lora_alpha} must be positive (the adapters' scale is alpha / "
                             "rank)")

    def _check_windows_and_caps(self) -> None:
        if self.sliding_window < 0:
            raise UsageError(f"sliding_window={self.sliding_window} must be at least 0 (0: no window)")
        layers = self.sliding_layers
        if layers is not None and (list(layers) != sorted(set(layers)) or any(not 0 <= i < self.n_layers
                                                                                 for i in layers)):
            raise UsageError(f"sliding_layers={list(layers)}: name layers of the {self.n_layers} (0 to "
                             f"{self.n_layers - 1}) once each, in order")
        for name in ("attention_softcap", "logits_softcap", "attention_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UsageError(f"{name}={value} must be positive (None: none)")
        if self.n_experts:
            self._check_experts()
        if not self.rope_linear_factor > 0:
            raise UsageError(f"rope_linear_factor={self.rope_linear_factor} must be positive (1: unscaled)")

    def _check_experts(self) -> None:
        if self.n_experts < 0 or not 1 <= self.experts_per_token <= self.n_experts:
            raise UsageError(f"experts_per_token={self.experts_per_token} must be from 1 to n_experts="
                             f"{self.n_experts}: each token goes through that many of the experts")
        if self.mlp == "gelu":
            raise UsageError("a mixture of experts is of gated MLPs; use mlp='swiglu' or mlp='geglu'")
        if self.router_aux_loss < 0 or self.router_z_loss < 0:
            raise UsageError(f"router_aux_loss={self.router_aux_loss} and router_z_loss={self.router_z_loss} "
                             "are weights of the router's losses; give 0 or more")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise UsageError(f"capacity_factor={self.capacity_factor} must be positive (None: dropless "
                             "routing)")
        adapted = [t for t in ("gate", "up", "down") if t in self.lora_targets]
        if self.lora_rank and adapted:
            raise UsageError(f"lora_targets includes {','.join(adapted)} but this model's MLPs are experts, "
                             "which take no adapters here; adapt q,k,v,o")

    @property
    def adaptable(self) -> tuple[str, ...]:
        """The LoRA targets this model has: every projection but a plain GELU MLP's gate and a
        mixture of experts' MLP."""
        if self.n_experts:
            return ("q", "k", "v", "o")
        return tuple(t for t in LORA_TARGETS if t != "gate" or self.mlp != "gelu")

    @property
    def ff_width(self) -> int:
        return self.expert_d_ff or self.d_ff

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: it attends to the whole sequence)."""
        sliding = range(self.n_layers) if self.sliding_layers is None else self.sliding_layers
        return tuple(self.sliding_window if i in sliding else 0 for i in range(self.n_layers))

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dtype(self) -> Any:
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def lora_scale(self) -> float:
        return (self.lora_alpha or self.lora_rank) / self.lora_rank if self.lora_rank else 0.0

    def lora_shapes(self) -> dict[str,
                                  tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...]]]:
        """Each adapted projection: (input shape, its logical names, output shape, its logical
        names) of its base weight, for the targets this config adapts."""
        d, n, k, h, f = self.d_model, self.n_heads, self.kv_heads, self.head_dim, self.d_ff
        shapes = {"q": ((d,), ("embed",), (n, h), ("heads", "kv")),
                  "k": ((d,), ("embed",), (k, h), ("heads", "kv")),
                  "v": ((d,), ("embed",), (k, h), ("heads", "kv")),
                  "o": ((n, h), ("heads", "kv"), (d,), ("embed",)),
                  "gate": ((d,), ("embed",), (f,), ("mlp",)), "up": ((d,), ("embed",), (f,), ("mlp",)),
                  "down": ((f,), ("mlp",), (d,), ("embed",))}
        return {t: shapes[t] for t in self.lora_targets} if self.lora_rank else {}
