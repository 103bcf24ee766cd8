"""Which procedure a ``Trainer`` runs, checked in one line: one model, one optimizer and a loss,
or named parts and the user's step over them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardax.errors import UsageError
from shardax.parts import Part, check_parts

_PARTS_EXAMPLE = ("parts={'generator': Part(make_generator, optax.adam(2e-4)), 'discriminator': "
                  "Part(make_discriminator, optax.adam(2e-4))}, step=gan_step")


def check_procedure(model: Any, optimizer: Any, loss_fn: Any, parts: Any, step: Any, eval_fn: Any,
                    eval_loss_fn: Any, init_from: Any, lora: Any, grad_accum: int) -> dict[str, Part] | None:
    """The parts of a run of parts (None for one model), or a one-line refusal of a mix of the two."""
    if parts is None:
        _check_one_model(model, optimizer, loss_fn, step, eval_fn)
        return None
    given = [name for name, value in (("model", model), ("optimizer", optimizer), ("loss_fn", loss_fn),
                                      ("eval_loss_fn", eval_loss_fn), ("init_from", init_from),
                                      ("lora", lora))
             if value is not None]
    if given:
        raise UsageError(f"Trainer(parts=...) was also given {', '.join(given)}; with parts, each Part holds "
                         "its model and optimizer and step(parts, batch) computes the losses: drop "
                         f"{', '.join(given)}")
    if step is None or not callable(step):
        raise UsageError("Trainer(parts=...) needs step=your_step(parts, batch) -> {'name': scalar, ...}, "
                         "which updates each trained part with parts.update(name, "
                         "nnx.grad(loss)(parts[name]))")
    if eval_fn is not None and not callable(eval_fn):
        raise UsageError(f"eval_fn is a {type(eval_fn).__name__}; give a function (parts, batch) -> "
                         "{'name': scalar, ...}")
    if grad_accum != 1:
        raise UsageError(f"grad_accum={grad_accum} with parts: a step of parts is the user's own, so it "
                         "accumulates as it likes; use grad_accum=1")
    return check_parts(parts)


def _check_one_model(model: Any, optimizer: Any, loss_fn: Any, step: Any, eval_fn: Any) -> None:
    if step is not None or eval_fn is not None:
        raise UsageError("step= and eval_fn= are the steps of a run of parts; give parts={'name': "
                         "Part(model, optimizer), ...} with them, or train one model with Trainer(model, "
                         "optimizer, loss_fn)")
    # (optax's are tuples)
    several = isinstance(optimizer, (tuple, list, Mapping)) and not _is_optax(optimizer)
    if isinstance(model, Mapping) or several:
        count = len(optimizer) if several else len(model)
        raise UsageError(f"Trainer was given {count} "
                         f"{'optimizers' if not isinstance(model, Mapping) else 'models'}; one model trains "
                         "with one optax transformation: for several models, each with its own optimizer, "
                         f"give named parts and your step: Trainer({_PARTS_EXAMPLE})")
    if not _is_optax(optimizer):
        raise UsageError(f"optimizer is {type(optimizer).__name__}; give an optax transformation such as "
                         "optax.adamw(1e-3)")
    if loss_fn is None or not callable(loss_fn):
        raise UsageError(f"loss_fn is {type(loss_fn).__name__}; give loss_fn(model, batch) -> mean loss, or "
                         f"(loss, {{'name': scalar}}); for a procedure of your own over several models: "
                         f"Trainer({_PARTS_EXAMPLE})")


def _is_optax(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a gradient transformation (anything with optax's ``init`` and ``update``)."""
    return hasattr(optimizer, "init") and hasattr(optimizer, "update")
