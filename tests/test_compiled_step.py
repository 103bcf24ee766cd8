"""What XLA compiled for each strategy: bytes per device and the collectives, against theory.

The theory is written out from the model's shapes, independently of shardax's own specs.
"""

import math

import jax
import optax
import pytest
from small_models import tiny_transformer_config, token_batches

from shardax import DeviceMeshManager
from shardax.analysis.collectives import REDUCE_SCATTER_PATTERN, find_collectives
from shardax.model_parallel import parallelize
from shardax.models.transformer import TransformerLM, next_token_loss
from shardax.sharding.report import report

CONFIG = tiny_transformer_config(tie_embeddings=False)  # V=64, S=16, D=32, F=64, L=2, untied head
BATCH, LENGTH = 16, 17


def theoretical_param_floats(strategy, sizes):
    """Parameter floats each device holds, from the transformer's shapes and the strategy's intent."""
    V, S, D, F, L = CONFIG.vocab_size, CONFIG.seq_len, CONFIG.d_model, CONFIG.d_ff, CONFIG.n_layers
    attention, mlp = 4 * D * D, 2 * D * F  # per layer: (embed, heads|mlp) weights
    hidden_bias, embed_only = F, 4 * D + D  # per layer: the (mlp,) bias; 2 norms and the (embed,) bias
    tables = 2 * V * D  # embedding + untied head, both (vocab, embed)
    everything = tables + S * D + 2 * D + L * (attention + mlp + hidden_bias + embed_only)
    data, model = sizes.get("data", 1), sizes.get("model", 1)
    if strategy in ("dp", "zero1", "zero2"):
        return everything
    if strategy in ("fsdp", "hsdp"):
        return everything / data  # every dimension here divides
    if strategy == "tp":  # heads, MLP hidden and vocab over model; norms, positions, embed biases replicated
        return (tables + L * (attention + mlp + hidden_bias)) / model + S * D + 2 * D + L * embed_only
    if strategy == "fsdp_tp":  # ... and additionally `embed` over data
        return ((tables + L * (attention + mlp)) / (model * data) + L * hidden_bias / model
                + (S * D + 2 * D + L * embed_only) / data)
    raise AssertionError(strategy)


def theoretical_state_bytes(strategy, sizes):
    params = 4 * theoretical_param_floats(strategy, sizes)
    moments = 2 * params  # Adam's mu and nu follow the parameter ...
    if strategy in ("zero1", "zero2"):
        moments /= sizes["data"]  # ... and are split over data for ZeRO
    return params + moments + 8  # + step and Adam's count


CASES = [("dp", "data=8"), ("zero1", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"),
         ("tp", "data=2,model=4"), ("fsdp_tp", "data=2,model=4"), ("fsdp_tp", "data=4,model=2"),
         ("hsdp", "replica=2,data=4")]


def compile_step(strategy, mesh_shape):
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape)
    parallel = parallelize(lambda rngs: TransformerLM(CONFIG, rngs=rngs), optax.adamw(1e-3), mesh, strategy)
    batch = parallel.place_batch(next(token_batches(1, batch_size=BATCH, length=LENGTH)))
    compiled = parallel.train_step(next_token_loss).lower(parallel.abstract_state, batch).compile()
    return parallel, compiled, dict(mesh.shape)


@pytest.mark.parametrize("strategy, mesh_shape", CASES, ids=[f"{s}-{m}" for s, m in CASES])
@pytest.mark.slow
def test_bytes_per_device_match_theory(strategy, mesh_shape):
    parallel, compiled, sizes = compile_step(strategy, mesh_shape)
    expected = theoretical_state_bytes(strategy, sizes)
    # 1. what every device really holds after init
    state = parallel.init()
    per_device = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert len(per_device) == 8
    assert all(held == pytest.approx(expected, rel=0.02)
               for held in per_device.values()), (per_device, expected)
    # 2. what XLA's compiled step takes as arguments per device (state + this device's rows)
    batch_rows = BATCH // (sizes.get("data", 1) * sizes.get("replica", 1))
    arguments = compiled.memory_analysis().argument_size_in_bytes
    assert arguments == pytest.approx(expected + batch_rows * LENGTH * 4, rel=0.02)
    # 3. shardax's own report agrees
    assert report(state).bytes_per_device == pytest.approx(expected, rel=0.02)


@pytest.mark.slow
def test_fsdp_is_one_eighth_and_zero_shards_only_optimizer_state():
    replicated = theoretical_state_bytes("dp", {"data": 8})
    fsdp = compile_step("fsdp", "data=8")[1].memory_analysis().argument_size_in_bytes
    zero1 = compile_step("zero1", "data=8")[1].memory_analysis().argument_size_in_bytes
    batch = BATCH // 8 * LENGTH * 4
    assert (fsdp - batch - 8) == pytest.approx((replicated - 8) / 8, rel=0.02)
    params = replicated / 3
    assert (zero1 - batch - 8) == pytest.approx(params + 2 * params / 8, rel=0.02)


def gradient_bytes():
    return 4 * theoretical_param_floats("dp", {})


def non_scalar(collectives, kind):
    return [c for c in collectives if c.kind == kind and any(not s.endswith("[]") for s in c.shapes)]


def test_dp_all_reduces_every_gradient_once():
    """One SPMD program: each scanned layer's gradients are all-reduced inside the backward loop
    (once per layer, where XLA can overlap them with the next layer's backward pass), the rest
    once after it; every gradient byte is reduced exactly once and nothing else moves."""
    collectives = find_collectives(compile_step("dp", "data=8")[1].as_text())
    assert {c.kind for c in collectives} == {"all-reduce"}, collectives
    reduced = non_scalar(collectives, "all-reduce")
    in_loop = [c for c in reduced if c.executions == CONFIG.n_layers]
    assert in_loop, "the layers' gradients were not reduced inside the layer loop"
    scalars = sum(4 * c.executions for c in reduced for shape in c.shapes if shape.endswith("[]"))
    assert sum(c.operand_bytes * c.executions for c in reduced) - scalars == gradient_bytes()


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_zero2_and_fsdp_reduce_scatter_gradients(strategy):
    collectives = find_collectives(compile_step(strategy, "data=8")[1].as_text())
    assert non_scalar(collectives, "all-reduce") == []  # no full-gradient all-reduce
    scattered = [c for c in collectives if c.kind in (REDUCE_SCATTER_PATTERN, "reduce-scatter")]
    reduced = sum(c.bytes * c.executions for c in scattered)
    kept = sum(c.shard_bytes * c.executions for c in scattered)
    # Each gradient is reduced at most once (XLA may compute a shard of one directly, e.g. the
    # output head's after an all-to-all of activations), and each device keeps its eighth.
    assert 0.8 * gradient_bytes() <= reduced <= gradient_bytes()
    assert kept * 8 == reduced


def test_fsdp_gathers_each_layer_inside_the_loops_forward_and_backward():
    from shardax.analysis.lint import full_parameter_gathers

    parallel, compiled, _ = compile_step("fsdp", "data=8")
    collectives = find_collectives(compiled.as_text())
    per_layer = [c for c in collectives if c.kind == "all-gather" and c.executions == CONFIG.n_layers]
    assert per_layer, "stacked layers were gathered outside the scan"
    assert full_parameter_gathers(parallel.layout, collectives) == []  # never a whole stack at once
    # ZeRO-3 frees gathered weights after the forward pass and gathers them again for the
    # backward pass: each layer's weights are gathered twice per step (XLA may keep the tiny
    # layer-norm vectors instead of gathering them again).
    stacked = [leaf for leaf in parallel.layout.leaves.values() if "layers" in (leaf.logical or ())]
    layer_bytes = sum(4 * math.prod(leaf.shape) for leaf in stacked)
    assert 1.95 * layer_bytes <= sum(c.bytes * c.executions for c in per_layer) <= 2 * layer_bytes
