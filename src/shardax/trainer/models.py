"""The model a ``Trainer`` lays out: its factory, where its first weights come from, its LoRA adapters."""

from __future__ import annotations

from typing import Any

from flax import nnx

from shardax.adapters import LoRA, add_lora
from shardax.errors import UsageError
from shardax.model_parallel import ModelFactory


def first_weights(init_from: Any) -> Any:
    """Where a run's first weights come from: None (the seed), an object with
    ``initial_state(parallel, seed)`` (and a model factory, as ``shardax.hf.factory(path)``
    makes), or a Hugging Face checkpoint directory, read through that."""
    if init_from is None or callable(getattr(init_from, "initial_state", None)):
        return init_from
    from shardax.hf import factory  # a directory: the one source of weights shardax reads by path

    return factory(init_from)


def model_factory(model: ModelFactory | None, weights: Any, lora: LoRA | None) -> ModelFactory:
    """The model to lay out: ``model``, or the weights' own; with ``lora``'s adapters."""
    if model is None:
        if weights is None:
            raise UsageError("Trainer(model=None) needs init_from=<a Hugging Face checkpoint directory>; "
                             "otherwise give the model: lambda rngs: MyModel(..., rngs=rngs)")
        model = weights
    return model if lora is None else _with_lora(model, lora)


def _with_lora(factory: ModelFactory, lora: LoRA) -> ModelFactory:
    """``factory``'s model with ``lora``'s adapters: the model's own ``lora_factory`` where it
    has one (``TransformerLM``: its projections by their Hugging Face names), else on its layers
    by path (``shardax.models.adapters``); a checkpoint's factory (``shardax.hf.factory``) its own."""
    if callable(getattr(factory, "lora_factory", None)):
        return factory.lora_factory(lora)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    if callable(getattr(model, "lora_factory", None)):
        return model.lora_factory(lora)
    targets = lora.layer_patterns()
    with nnx.use_eager_sharding(False):  # refused now, in one line, if the targets match nothing
        nnx.eval_shape(lambda: add_lora(factory(nnx.Rngs(0)), lora.rank, lora.alpha, targets,
                                        rngs=nnx.Rngs(1)))
    return lambda rngs: add_lora(factory(rngs), lora.rank, lora.alpha, targets, rngs=rngs)
