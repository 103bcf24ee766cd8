"""The names a user may give, in one place: strategies, remat policies, attention kernels,
context attentions, what to do with a non-finite step, compute precisions. JAX-free, so that the
command line's parsers, the configurations and the library check against the same tuples (each a
``Literal`` type for annotations and its tuple of values). What ``--data`` holds is a data
format's, named by the formats' registry (``shardax.data.registry``).

The strategies themselves live in ``shardax.sharding.strategies``; a test keeps their names and
``STRATEGY_NAMES`` the same.
"""

from __future__ import annotations

from typing import Literal, get_args

StrategyName = Literal["dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "hsdp", "pp", "pp_fsdp", "pp_tp",
                       "ep", "fsdp_ep", "ep_tp"]
RematPolicy = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
AttentionKernel = Literal["auto", "xla", "cudnn"]
ContextAttention = Literal["all-gather", "ring"]
NonFinite = Literal["stop", "skip"]
Precision = Literal["float32", "bfloat16"]

STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)
REMAT_POLICIES: tuple[str, ...] = get_args(RematPolicy)
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)
CONTEXT_ATTENTIONS: tuple[str, ...] = get_args(ContextAttention)
NONFINITE_MODES: tuple[str, ...] = get_args(NonFinite)
PRECISIONS: tuple[str, ...] = get_args(Precision)

# the projections LoRA adapts, by their Hugging Face names (q_proj, ..., down_proj)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

# mesh axis names the library shares, and the name of a stack's layer dimension
DATA, MODEL, STAGE, CONTEXT, EXPERT, REPLICA = "data", "model", "stage", "context", "expert", "replica"
LAYERS = "layers"
