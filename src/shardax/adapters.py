"""LoRA adapters on any Flax NNX model, chosen by module path (as qwix's LoRA provider chooses them).

    model = add_lora(MyUNet(rngs=rngs), rank=8, alpha=16, targets=r".*attention.*|.*conv.*", rngs=rngs)

Each matching ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum`` or ``nnx.Conv`` keeps its
weight ``W`` and gains ``lora_a`` (its inputs x rank, random) and ``lora_b`` (rank x its outputs,
zeros: the model starts as it was), ``nnx.LoRAParam``s, and computes with ``W + (alpha / rank)
lora_a lora_b``. For a linear layer that is ``x W + s (x A) B``, computed so; for a convolution,
A is a convolution of the layer's window to ``rank`` channels and B a 1x1 one to its outputs
(PEFT's LoRA for convolutions). A model holding ``nnx.LoRAParam``s trains them alone (the base
weights frozen: no gradient, no optimizer state), and ``save_adapters`` writes them in PEFT's
layout. The layers keep their paths: ``conv1/kernel`` stays where it was, beside
``conv1/lora_a`` and ``conv1/lora_b``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardax.errors import UsageError
from shardax.vocabulary import LORA_TARGETS

ADAPTABLE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv)



@dataclasses.dataclass(frozen=True)
class LoRA:
    """LoRA adapters for fine-tuning (``Trainer(..., lora=LoRA(16))``): ``rank``, ``alpha`` (the
    adapters' term is scaled by alpha / rank; default: the rank) and ``targets``: on a
    ``TransformerLM`` the projections adapted by their Hugging Face names (``"q,v"`` or a tuple;
    default all seven), on any other model regular expressions over its layers' paths (default
    every ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum`` and ``nnx.Conv``)."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] | str = LORA_TARGETS

    def layer_patterns(self) -> str | tuple[str, ...]:
        """``targets`` for a model other than ``TransformerLM``: regular expressions over layer
        paths (``shardax.adapters``); the default, every adaptable layer."""
        return ".*" if self.targets == LORA_TARGETS else self.targets

    def applied(self, config: Any) -> Any:
        """``config`` (a ``TransformerConfig``: its ``adaptable`` projections and ``lora_*`` fields)
        with these adapters (checked there)."""
        targets = self.targets.split(",") if isinstance(self.targets, str) else self.targets
        if self.targets == LORA_TARGETS:  # the default: every projection this model has
            targets = config.adaptable
        if self.rank < 1:
            raise UsageError(f"LoRA rank {self.rank} must be at least 1")
        return dataclasses.replace(config, lora_rank=self.rank, lora_alpha=self.alpha,
                                   lora_targets=tuple(t.strip() for t in targets))


def _split(layer: nnx.Module) -> int:
    """How many leading dimensions of the layer's kernel are its inputs (A's rows)."""
    kernel = layer.kernel
    if isinstance(layer, nnx.Linear):
        return 1
    if isinstance(layer, nnx.Conv):
        return kernel.ndim - 1  # the window and the input channels
    if isinstance(layer, nnx.LinearGeneral):
        return len(layer.in_features)
    inputs, output = layer.einsum_str.replace(" ", "").split("->")
    kernel_letters = inputs.split(",")[1]
    contracted = [letter not in output for letter in kernel_letters]
    if contracted != sorted(contracted, reverse=True):
        raise UsageError(f"LoRA on nnx.Einsum {layer.einsum_str!r}: its kernel's contracted dimensions must "
                         "come before its output ones (as in 'bti,ihd->bthd'); leave this layer out of the "
                         "targets")
    return sum(contracted)


def _delta(layer: nnx.Module) -> jax.Array:
    """``(alpha / rank) A B`` shaped as the layer's kernel."""
    a, b = layer.lora_a[...], layer.lora_b[...]
    rows, rank = math.prod(a.shape[:-1]), a.shape[-1]
    product = (a.reshape(rows, rank) @ b.reshape(rank, -1)).reshape(layer.kernel.shape)
    return (layer.lora_scale * product).astype(layer.kernel.dtype)


_ADAPTED: dict[type, type] = {}


def _adapted_class(base: type) -> type:
    """``base`` computing with its LoRA adapters (one class per adapted layer type)."""
    if base not in _ADAPTED:
        call = base.__call__

        def __call__(self: Any, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
            if isinstance(self, nnx.Linear) and not args and not kwargs:  # x W + s (x A) B
                low = x @ self.lora_a[...].astype(x.dtype)
                return call(self, x) + self.lora_scale * (low @ self.lora_b[...].astype(x.dtype))
            kernel = self.kernel
            self.kernel = nnx.Param(kernel[...] + _delta(self))  # W + s A B, for this call only
            try:
                return call(self, x, *args, **kwargs)
            finally:
                self.kernel = kernel

        _ADAPTED[base] = type(f"LoRA{base.__name__}", (base,), {"__call__": __call__, "__module__": __name__})
    return _ADAPTED[base]


def _path(keys: Sequence[Any]) -> str:
    return "/".join(str(key) for key in keys)


def add_lora(model: nnx.Module, rank: int, alpha: float | None = None, targets: str | Sequence[str] = ".*", *,
             rngs: nnx.Rngs) -> nnx.Module:
    """Add LoRA adapters of ``rank`` (scaled by ``alpha / rank``; default 1) to every adaptable
    layer of ``model`` whose path (``"blocks/0/attention/query"``) fully matches one of the
    regular expressions ``targets``; ``model`` itself, changed in place. Refused in one line when
    nothing matches."""
    if not isinstance(rank, int) or rank < 1:
        raise UsageError(f"LoRA rank {rank!r} must be a whole number of at least 1")
    if alpha is not None and not alpha > 0:
        raise UsageError(f"LoRA alpha {alpha!r} must be positive (the adapters' scale is alpha / rank)")
    patterns = [targets] if isinstance(targets, str) else list(targets)
    try:
        compiled = [re.compile(pattern) for pattern in patterns]
    except re.error as error:
        raise UsageError(f"LoRA targets {patterns!r}: {error}; give regular expressions over module paths "
                         "such as '.*attention.*'") from None
    adapted, seen = [], []
    for keys, layer in list(nnx.iter_graph(model)):
        if not isinstance(layer, ADAPTABLE) or isinstance(layer, tuple(_ADAPTED.values())):
            continue
        path = _path(keys)
        seen.append(path)
        if any(pattern.fullmatch(path) for pattern in compiled):
            _adapt(layer, path, rank, alpha, rngs)
            adapted.append(path)
    if not adapted:
        raise UsageError(f"LoRA targets {patterns!r} match none of the model's {len(seen)} linear, einsum "
                         "and conv layers "
                         f"({', '.join(seen[:6]) or 'none'}{' ...' if len(seen) > 6 else ''}); give regular "
                         "expressions that fully match some of these paths")
    return model


def _adapt(layer: nnx.Module, path: str, rank: int, alpha: float | None, rngs: nnx.Rngs) -> None:
    if isinstance(layer, nnx.Conv) and layer.feature_group_count != 1:
        raise UsageError(f"LoRA on the grouped convolution {path!r} (feature_group_count="
                         f"{layer.feature_group_count}) is not supported; leave it out of the targets")
    split = _split(layer)
    shape = tuple(layer.kernel.shape)
    rows, columns = shape[:split], shape[split:]
    fan_in = math.prod(rows)
    layer.lora_a = nnx.LoRAParam(jax.random.normal(rngs.params(), (*rows, rank),
                                                   jnp.float32) / math.sqrt(fan_in))
    layer.lora_b = nnx.LoRAParam(jnp.zeros((rank, *columns), jnp.float32))
    layer.lora_scale = (alpha or rank) / rank
    layer.__class__ = _adapted_class(type(layer))


def adapted_layers(model: nnx.Module) -> dict[str, nnx.Module]:
    """The layers of ``model`` that ``add_lora`` adapted, by path."""
    return {_path(keys): layer for keys, layer in nnx.iter_graph(model)
            if isinstance(layer, tuple(_ADAPTED.values()))}


def save_adapters(model: nnx.Module, out: str | Path, *, base_model: str | None = None) -> Path:
    """The adapters of a model adapted by ``add_lora``, in PEFT's layout: ``adapter_config.json``
    and ``adapter_model.safetensors`` holding ``base_model.model.<path>.lora_A.weight`` (rank x
    inputs, or a convolution's ``rank x in x window`` kernel) and ``lora_B.weight`` (outputs x
    rank, or ``out x rank x 1 x 1``), PyTorch's orientation. Paths are the model's, dotted."""
    from safetensors.numpy import save_file

    layers = adapted_layers(model)
    if not layers:
        raise UsageError("the model has no LoRA adapters to save; add them with add_lora (Trainer(lora=...))")
    tensors, ranks, alphas = {}, set(), set()
    for path, layer in layers.items():
        a, b = (np.asarray(jax.device_get(layer.lora_a[...]), np.float32),
                np.asarray(jax.device_get(layer.lora_b[...]), np.float32))
        rank = a.shape[-1]
        name = f"base_model.model.{path.replace('/', '.')}"
        if isinstance(layer, nnx.Conv):
            # (window..., in, r) -> (r, in, window...); (r, out) -> (out, r, 1, ...)
            window = a.ndim - 2
            tensors[f"{name}.lora_A.weight"] = np.moveaxis(a, (-1, -2), (0, 1)).copy()
            tensors[f"{name}.lora_B.weight"] = b.T.reshape(b.shape[1], rank, *([1] * window)).copy()
        else:
            tensors[f"{name}.lora_A.weight"] = a.reshape(-1, rank).T.copy()
            tensors[f"{name}.lora_B.weight"] = b.reshape(rank, -1).T.copy()
        ranks.add(rank)
        alphas.add(layer.lora_scale * rank)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": max(ranks), "lora_alpha": max(alphas),
              "base_model_name_or_path": base_model,
              "target_modules": sorted(path.replace("/", ".") for path in layers), "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory
