"""Preference tuning: DPO's loss on pairs of completions, against a frozen reference.

    trainer = Trainer(None, optax.adamw(1e-6), dpo_loss(beta=0.1), init_from="my-llama", lora=LoRA(16))
    trainer = Trainer(parts={"policy": Part(factory, optax.adamw(1e-6), init_from=sft_model),
                             "reference": Part(factory, init_from=sft_model)}, step=dpo_step(beta=0.1))

A batch holds each pair's two sequences, prompt and completion, as rows of the same length:
``chosen`` and ``rejected`` (token ids), ``chosen_mask`` and ``rejected_mask`` (1 on the
completion's tokens: a sequence's log-probability is the sum over them). The reference's
log-probabilities come either with the batch (``reference_chosen``, ``reference_rejected``:
computed once beforehand, ``sequence_logprobs`` of the reference model) or, for a model with
LoRA adapters and none given, from the same model with its adapters left out (the base weights
are the reference: no second copy of them), or, in a run of parts, from a frozen reference
model in the same step (``dpo_step``). Sigmoid DPO (Rafailov et al.), with conservative
label smoothing ``label_smoothing`` as TRL has it; the metrics are the implicit rewards
``beta (policy - reference)`` of each side, their margin and how often the chosen one wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.errors import UsageError
from shardax.models.transformer import token_losses

PAIR_KEYS = ("chosen", "rejected", "chosen_mask", "rejected_mask")


def sequence_logprobs(model: Any, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Each row's log-probability of its tokens that ``mask`` marks (each predicted from those before it)."""
    losses, weights = token_losses(model, {"tokens": tokens, "mask": mask})
    return -(losses * weights).sum(axis=1)


def without_adapters(model: Any) -> Any:
    """``model`` with every LoRA adapter at zero: its base weights alone (the same arrays)."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, adapters), rest)


def _check_pairs(model: Any, batch: dict[str, Any]) -> bool:
    """Whether the batch brings the reference's log-probabilities (else the model must hold LoRA
    adapters); a batch that is not pairs is one line."""
    missing = [key for key in PAIR_KEYS if key not in batch]
    if missing:
        raise UsageError(f"dpo_loss reads pairs: the batch lacks {', '.join(missing)} (it has "
                         f"{', '.join(batch) or 'nothing'}); give chosen and rejected rows with their masks")
    given = "reference_chosen" in batch and "reference_rejected" in batch
    if not given and not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise UsageError("dpo_loss needs the reference's log-probabilities (reference_chosen, "
                         "reference_rejected in the batch) or a model with LoRA adapters (the base weights "
                         "are the reference)")
    return given


def dpo_loss(beta: float = 0.1, label_smoothing: float = 0.0) -> Callable[[Any, dict[str, Any]], Any]:
    """The DPO loss for a ``Trainer`` or a step: ``loss_fn(model, batch) -> (loss, metrics)``."""
    if beta <= 0 or not 0 <= label_smoothing < 0.5:
        raise UsageError(f"dpo_loss(beta={beta}, label_smoothing={label_smoothing}): beta must be positive "
                         "and label_smoothing in [0, 0.5)")

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        given = _check_pairs(model, batch)
        tokens = jnp.concatenate([batch["chosen"], batch["rejected"]])
        mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
        policy = sequence_logprobs(model, tokens, mask)
        if given:
            reference = jnp.concatenate([batch["reference_chosen"], batch["reference_rejected"]])
        else:
            reference = jax.lax.stop_gradient(sequence_logprobs(without_adapters(model), tokens, mask))
        rewards = beta * (policy - reference).reshape(2, -1)  # (chosen, rejected) x pairs
        margin = rewards[0] - rewards[1]
        losses = (-(1 - label_smoothing) * jax.nn.log_sigmoid(margin)
                  - label_smoothing * jax.nn.log_sigmoid(-margin))
        metrics = {"chosen_reward": rewards[0].mean(), "rejected_reward": rewards[1].mean(),
                   "reward_margin": margin.mean(), "reward_accuracy": (margin > 0).astype(jnp.float32).mean()}
        return losses.mean(), metrics

    return loss_fn


def with_reference(reference: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with the ``reference`` model's log-probabilities of its pairs (no gradient to it)."""
    return {**batch, **{f"reference_{side}": jax.lax.stop_gradient(
        sequence_logprobs(reference, batch[side], batch[f"{side}_mask"])) for side in ("chosen", "rejected")}}


def dpo_step(beta: float = 0.1, label_smoothing: float = 0.0, *, policy: str = "policy",
             reference: str = "reference") -> Callable[[Any, dict[str, Any]], dict[str, jax.Array]]:
    """A step over parts (``Trainer(parts=..., step=dpo_step())``): DPO of the ``policy`` part
    against a frozen ``reference`` part (``Part(model, init_from=...)``, no optimizer), the
    reference's log-probabilities computed in the step, for full fine-tuning or a reference that
    is another model."""
    loss_fn = dpo_loss(beta, label_smoothing)

    def step(parts: Any, batch: dict[str, Any]) -> dict[str, jax.Array]:
        given = with_reference(parts[reference], batch)
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(parts[policy], given)
        parts.update(policy, grads)
        return {"loss": loss, **metrics}

    return step


def dpo_eval_step(beta: float = 0.1, label_smoothing: float = 0.0, *, policy: str = "policy",
                  reference: str = "reference") -> Callable[[Any, dict[str, Any]], dict[str, jax.Array]]:
    """What ``dpo_step``'s run evaluates (``Trainer(eval_fn=...)``): its loss and rewards."""
    loss_fn = dpo_loss(beta, label_smoothing)

    def evaluate(parts: Any, batch: dict[str, Any]) -> dict[str, jax.Array]:
        loss, metrics = loss_fn(parts[policy], with_reference(parts[reference], batch))
        return {"loss": loss, **metrics}

    return evaluate
