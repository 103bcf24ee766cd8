"""Benchmark 22: what XLA:CPU decided, measured on XLA:TPU's compile (no TPU needed).

    python benchmarks/tpu_decisions.py                        # small and medium on tpu-v5p-8
    python benchmarks/tpu_decisions.py --preset large --target tpu-v5e-16

Two choices in the train step were made by measuring XLA:CPU: the layer norm and GELU with
custom VJPs that keep only their input for the backward pass (``shardax.models.transformer``),
and a ``lax.cond`` rather than a select around the optimizer update (``shardax.step.train``:
the update is computed only when it is applied). Each is compiled by XLA:TPU both ways (the
step as shipped, and with the choice undone while tracing) for dp over the slice, in bfloat16
compute as an accelerator runs it, and compared by XLA:TPU's compiled peak per chip, its FLOPs
and HBM bytes (``step_cost``), and the roofline step time. Needs ``pip install
"shardax[tpu-plan]"``. Rows go to ``benchmarks/results/tpu_decisions.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from shardax.analysis.plan import _parallel, compile_step, compiled_memory, step_cost  # noqa: E402
from shardax.analysis.targets import parse_target, roofline  # noqa: E402
from shardax.models import transformer  # noqa: E402
from shardax.models.presets import flops_per_token, get_preset  # noqa: E402
from shardax.sharding.strategies import get_strategy  # noqa: E402
from shardax.step import train  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "tpu_decisions.json"


@contextlib.contextmanager
def plain_autodiff():
    """Layer norm and GELU differentiated by JAX itself (what the custom VJPs replace)."""
    saved = transformer.layer_norm, transformer.gelu
    transformer.layer_norm = lambda x, scale, bias: transformer._normalized(x)[0] * scale + bias
    transformer.gelu = jax.nn.gelu
    try:
        yield
    finally:
        transformer.layer_norm, transformer.gelu = saved


class _SelectLax:
    """``jax.lax`` as the train step sees it, with ``cond`` computing both branches and selecting."""

    def __getattr__(self, name):
        return getattr(jax.lax, name)

    @staticmethod
    def cond(predicate, true_fun, false_fun, *operands):
        taken, other = true_fun(*operands), false_fun(*operands)
        return jax.tree.map(lambda a, b: jnp.where(predicate, a, b), taken, other)


class _Jax:
    def __getattr__(self, name):
        return _SelectLax() if name == "lax" else getattr(jax, name)


@contextlib.contextmanager
def select_update():
    saved = train.jax
    train.jax = _Jax()
    try:
        yield
    finally:
        train.jax = saved


def measure(target, preset: str, variant) -> dict:
    config = get_preset(preset).config(compute_dtype="bfloat16")
    batch = get_preset(preset).batch_size
    strategy = get_strategy("dp")
    with variant():
        compiled = compile_step(_parallel(config, strategy, None, None, target), batch, config.seq_len)
        flops, hbm = step_cost(config, strategy, None, None, target, batch, 1, compiled)
    model_flops = flops_per_token(config) * batch * config.seq_len / len(target.devices())
    bound = roofline(target, flops, hbm, 0.0, model_flops)  # dp's gradient all-reduce is the same both ways
    return {"peak_bytes": compiled_memory(compiled)["peak"], "flops": flops, "hbm_bytes": hbm,
            "compute_ms": bound.compute_s * 1e3, "memory_ms": bound.memory_s * 1e3, "step_ms": bound.step_s * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu-v5p-8")
    parser.add_argument("--preset", action="append", help="default: small, medium")
    args = parser.parse_args()
    target = parse_target(args.target)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    decisions = {"custom VJPs (layer norm, GELU)": plain_autodiff, "cond around the update": select_update}
    for preset in args.preset or ["small", "medium"]:
        shipped = measure(target, preset, contextlib.nullcontext)
        rows = {"as shipped": shipped}
        for decision, undo in decisions.items():
            rows[f"without {decision}"] = undone = measure(target, preset, undo)
            print(f"{args.target} {preset:<7} {decision:<32} peak {shipped['peak_bytes'] / 1e9:.3f} GB vs "
                  f"{undone['peak_bytes'] / 1e9:.3f} GB without; FLOPs {shipped['flops'] / 1e9:.1f} G vs "
                  f"{undone['flops'] / 1e9:.1f} G; HBM bytes {shipped['hbm_bytes'] / 1e9:.2f} GB vs "
                  f"{undone['hbm_bytes'] / 1e9:.2f} GB; roofline {shipped['step_ms']:.3f} ms vs "
                  f"{undone['step_ms']:.3f} ms", flush=True)
        results[f"{args.target} {preset}"] = rows
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
