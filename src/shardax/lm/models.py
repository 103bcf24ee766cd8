"""``shardax train --model pkg.module:factory``: a language model of the user's own in the LM job.

The factory is imported (its module from the current directory or ``PYTHONPATH``) and called
``factory(vocab_size=V, seq_len=T, rngs=nnx.Rngs)``; it returns an ``nnx.Module`` whose
``__call__(tokens)`` takes ``(B, T)`` int32 tokens and returns ``(B, T, V)`` logits. ``V`` is the
data's model vocabulary (the tokenizer's, rounded up to a multiple of 64), ``T`` the run's
``--seq-len``. Everything else of the job is the same: data, strategies, checkpoints, resume.

Packed rows (token shards hold several documents a row, with ``segments`` and ``positions``):
a model whose ``__call__`` takes three positional arguments gets ``(tokens, segments,
positions)``, as shardax's transformer does; any other gets the tokens alone and sees a packed
row as one sequence: a document's tokens attend to the documents before it in the row (each
still opens with the end-of-document token, and padding never counts in the loss). That choice
is made once, here (``takes_segments``).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.errors import UsageError
from shardax.models.transformer import TransformerLM
from shardax.plugins import import_named, said

# what shapes shardax's transformer alone, refused beside --model (the flag and whether it was given)
TRANSFORMER_ONLY = (("init_from", lambda v: v is not None), ("lora_rank", bool),
                    ("lora_alpha", lambda v: v is not None), ("lora_targets", lambda v: v is not None),
                    ("scan_layers", lambda v: v is not None), ("remat", lambda v: v is not None),
                    ("precision", lambda v: v != "float32"), ("attention", lambda v: v != "auto"))


def check_flags(settings: dict[str, Any]) -> None:
    """``--model`` beside a flag that shapes or computes shardax's transformer: refused in one line."""
    spec = settings.get("model")
    if spec is None:
        return
    given = [name for name, set_ in TRANSFORMER_ONLY if set_(settings.get(name))]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} {_shown(settings[given[0]])} shapes shardax's transformer, and --model "
                         f"{spec} trains your own model; drop {flag} (your factory decides its model's "
                         "layers, precision and attention)")


def _shown(value: Any) -> str:
    return "" if value is True else str(value)


def load_factory(spec: str) -> Callable[..., Any]:
    """The function ``spec`` (``pkg.module:function``) names, imported; one line where it cannot be."""
    factory, module_name, name = import_named(spec, "--model", "function", "my_lm:build")
    if not callable(factory):
        what = "" if factory is None else f" (its {name} is a {type(factory).__name__})"
        where = getattr(sys.modules[module_name], "__file__", "?")
        raise UsageError(f"--model {spec}: {module_name} ({where}) has no function {name}{what}")
    return factory


def takes_segments(model: Any) -> bool:
    """Whether ``model`` is called ``model(tokens, segments, positions)`` on packed rows (its
    ``__call__`` takes three positional arguments), else ``model(tokens)``."""
    try:
        inspect.signature(model).bind(0, 0, 0)
    except TypeError:
        return False
    return True


class TokensOnly(nnx.Module):
    """``model`` as a loss calls a model of packed rows, ``(tokens, segments, positions)``: the
    tokens alone reach it."""

    def __init__(self, model: nnx.Module) -> None:
        self.model = model

    def __call__(self, tokens: jax.Array, segments: Any = None, positions: Any = None) -> jax.Array:
        return self.model(tokens)


@dataclasses.dataclass(frozen=True)
class UserModel:
    """The model of ``--model spec``, checked: how to build it, and how the losses call it."""

    spec: str
    factory: Callable[..., Any]
    vocab_size: int
    seq_len: int
    segments: bool  # called with segments and positions (``takes_segments``)
    kind: str  # its class's name

    def build(self, rngs: nnx.Rngs) -> nnx.Module:
        return self.factory(vocab_size=self.vocab_size, seq_len=self.seq_len, rngs=rngs)

    def adapted(self, loss: Callable[..., Any]) -> Callable[..., Any]:
        """``loss(model, batch)`` calling this model as it takes its inputs."""
        if self.segments:
            return loss

        def tokens_only(model: nnx.Module, batch: Any) -> Any:
            return loss(TokensOnly(model), batch)

        return tokens_only

    def describe(self, packed: bool) -> list[str]:
        """The run header's line on the model."""
        rows = ("; it reads packed rows with their documents apart (segments, positions)" if self.segments
                else "; it takes tokens alone, so a packed row is one sequence to it (its documents "
                     "attend to the earlier ones in the row)") if packed else ""
        return [f"model: yours, {self.kind} from {self.spec}(vocab_size={self.vocab_size}, "
                f"seq_len={self.seq_len}){rows}"]


def user_model(spec: str, vocab_size: int, seq_len: int, batch_size: int, packed: bool) -> UserModel:
    """The model of ``--model spec``, built and called abstractly (nothing is allocated) on a batch
    of ``batch_size`` rows of ``seq_len`` tokens: refused in one line if the factory fails, returns
    no ``nnx.Module``, or its logits are not ``(batch_size, seq_len, vocab_size)``."""
    factory = load_factory(spec)
    call = f"--model {spec}: {spec.partition(':')[2]}(vocab_size={vocab_size}, seq_len={seq_len}, rngs=...)"
    found: dict[str, Any] = {}

    def forward(tokens: jax.Array) -> jax.Array:
        try:
            model = factory(vocab_size=vocab_size, seq_len=seq_len, rngs=nnx.Rngs(0))
        except Exception as error:  # the user's code: said in one line
            raise UsageError(f"{call} failed: {said(error)}") from None
        if not isinstance(model, nnx.Module):
            raise UsageError(f"{call} returned a {type(model).__name__}; return an nnx.Module whose "
                             "__call__(tokens) gives logits")
        found.update(segments=takes_segments(model), kind=type(model).__name__)
        try:
            if found["segments"] and packed:
                positions = jnp.broadcast_to(jnp.arange(seq_len), tokens.shape)
                return model(tokens, jnp.ones_like(tokens), positions)
            return model(tokens)
        except Exception as error:
            raise UsageError(f"--model {spec}: its {type(model).__name__} failed on tokens of shape "
                             f"{tuple(tokens.shape)} (int32): {said(error)}") from None

    with nnx.use_eager_sharding(False):
        logits = jax.eval_shape(forward, jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32))
    wanted = (batch_size, seq_len, vocab_size)
    shape = getattr(logits, "shape", None)
    if shape != wanted or not jnp.issubdtype(logits.dtype, jnp.floating):
        got = type(logits).__name__ if shape is None else f"{logits.dtype} logits of shape {tuple(shape)}"
        raise UsageError(f"--model {spec}: its {found['kind']} gave {got} for tokens of shape "
                         f"{wanted[:2]}; it must give float logits (batch, seq_len, vocab_size) = {wanted}")
    return UserModel(spec, factory, vocab_size, seq_len, found["segments"], found["kind"])


def lm_model(run: Any, data: Any) -> tuple[Callable[[nnx.Rngs], nnx.Module], Callable[[Any], Any], list[str]]:
    """For the LM job's run (a ``RunDefinition``) on ``data``: how to build its model, how its
    losses call it (``adapt(loss)``) and the header's lines on it: shardax's transformer, or the
    model of ``--model``, checked here."""
    if run.factory is None:
        return (lambda rngs: TransformerLM(run.model, rngs=rngs)), (lambda loss: loss), []
    packed = "segments" in data.batch_keys
    user = user_model(run.factory, run.model.vocab_size, run.model.seq_len, run.batch_size, packed)
    return user.build, user.adapted, user.describe(packed)
