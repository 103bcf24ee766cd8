"""Mixtures of experts: routing as Mixtral and Qwen3-MoE define it, dropless or with a capacity, the
router's losses as transformers computes them, and an ``expert`` mesh axis whose strategies train
like one device, each device holding its own experts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from small_models import tiny_transformer_config

from shardax import parallelize
from shardax.errors import UsageError
from shardax.models.transformer import TransformerLM, next_token_loss
from shardax.sharding.paths import path_to_str

# 4 experts of 24 hidden units, 3 per token (more than one device's share of experts under expert=4)
CONFIG = tiny_transformer_config(positions="rotary", norm="rms", mlp="swiglu",
                                 n_experts=4, experts_per_token=3,
                                 expert_d_ff=24, router_aux_loss=0.01, router_z_loss=0.001)
TOKENS = np.random.default_rng(0).integers(0, 64, (8, 17))


def one_device():
    """Loss, metrics and per-tensor gradients of the model on one device."""
    model = TransformerLM(CONFIG, rngs=nnx.Rngs(0))
    grad_fn = nnx.jit(nnx.value_and_grad(next_token_loss, has_aux=True))
    (loss, metrics), grads = grad_fn(model, {"tokens": jnp.asarray(TOKENS)})
    return float(loss), metrics, {path_to_str(p): np.asarray(g) for p, g in
                                  jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))}


@pytest.fixture(scope="module")
def reference():
    return one_device()


@pytest.mark.parametrize("strategy, mesh", [("fsdp_ep", "data=2,expert=4"),
                                            ("ep_tp", "data=2,expert=2,model=2"),
                                            ("ep", "data=2,expert=2,context=2"), ("pp", "stage=2,data=4"),
                                            ("pp_tp", "stage=2,data=2,model=2")])
def test_every_expert_axis_strategy_takes_one_devices_first_step(strategy, mesh, reference):
    """SGD with rate 1: each parameter moves by minus its gradient, which equals one device's per
    tensor (1e-5 of the tensor's largest), router losses included; each device holds E / X
    experts (its own), and the loss and router metrics are one device's. Under a pipeline the
    dropless grouped matmuls run batched over the stages and the router's statistics come out
    of the stages' loop (the mean over the microbatches)."""
    loss, metrics, grads = reference
    parallel = parallelize(lambda rngs: TransformerLM(CONFIG, rngs=rngs), optax.sgd(1.0), mesh, strategy,
                           context_attention="ring" if "context" in mesh else "all-gather")
    state = parallel.init(0)
    before = {path_to_str(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
    step = parallel.train_step(next_token_loss)
    new, got = step(state, parallel.place_batch({"tokens": TOKENS}))
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    for name in ("router_balance", "router_z"):
        np.testing.assert_allclose(float(got[name]), float(metrics[name]), rtol=1e-5)
    for (path, leaf) in jax.tree_util.tree_leaves_with_path(new.params):
        name = path_to_str(path)
        scale = np.abs(grads[name]).max()
        np.testing.assert_allclose(before[name] - np.asarray(leaf), grads[name], rtol=0,
                                   atol=1e-5 * scale + 1e-7, err_msg=name)
    experts = parallel.mesh.shape.get("expert", 1)
    for shard in new.params["blocks"]["layers"]["experts"]["gate_up"][...].addressable_shards:
        assert shard.data.shape[1] == CONFIG.n_experts // experts  # (layers, E / X, ...)


def test_a_capacity_of_experts_over_top_k_drops_nothing_and_a_smaller_one_drops():
    """The dense per-expert batches of a capacity E / k compute what the sorted dropless path does;
    a capacity of 0.5 drops some tokens (they pass the layer unchanged)."""
    import dataclasses

    dropless = TransformerLM(CONFIG, rngs=nnx.Rngs(0))(TOKENS)
    for factor, same in [(CONFIG.n_experts / CONFIG.experts_per_token, True), (0.5, False)]:
        capped = TransformerLM(dataclasses.replace(CONFIG, capacity_factor=factor), rngs=nnx.Rngs(0))(TOKENS)
        assert np.allclose(capped, dropless, rtol=1e-5, atol=1e-5) == same


@pytest.mark.parametrize("config, strategy, mesh, message", [
    (dict(n_experts=6, experts_per_token=2), "ep", "data=2,expert=4",
     "6 experts do not split over expert=4 devices"),
    (dict(n_experts=4, experts_per_token=5), None, None, "experts_per_token=5 must be from 1 to n_experts=4"),
    (dict(n_experts=4, capacity_factor=1.0), "ep", "data=4,expert=2",
     "capacity_factor=1.0 with the experts split"),
], ids=["axis-does-not-divide", "top-k-above-experts", "capacity-across-devices"])
@pytest.mark.every_case
def test_bad_expert_settings_are_one_line(config, strategy, mesh, message):
    with pytest.raises(UsageError) as error:
        settings = tiny_transformer_config(positions="rotary", norm="rms", mlp="swiglu", **config)
        parallel = parallelize(lambda rngs: TransformerLM(settings, rngs=rngs), optax.sgd(0.1), mesh,
                               strategy)
        parallel.train_step(next_token_loss)(parallel.init(0), parallel.place_batch({"tokens": TOKENS}))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("strategy, mesh, remat", [("fsdp_ep", "data=2,expert=4", "none"),
                                                   ("ep", "data=4,expert=2", "full")])
@pytest.mark.slow
def test_plan_counts_the_all_to_alls_and_the_experts_bytes_per_device(strategy, mesh, remat):
    """The compiled step's all-to-all bytes equal theory's (within 5%; a remat policy runs the
    forward pair again), and each device holds 1 / X of the experts' bytes (ep) or 1 / (X * data)
    (fsdp_ep), which the plan's notes state."""
    import dataclasses

    from shardax.analysis.plan import plan_strategy, transformer_for
    from shardax.analysis.theory import expert_exchange_bytes, experts_bytes

    config = dataclasses.replace(CONFIG, remat=remat)
    plan = plan_strategy(config, strategy, mesh, batch_size=16)
    layout = transformer_for(config, strategy, mesh).layout
    theory = expert_exchange_bytes(layout, config, 16)
    assert theory > 0
    np.testing.assert_allclose(plan.collectives["all-to-all"]["wire_bytes"], theory, rtol=0.05)
    whole, held = experts_bytes(layout)
    shards = layout.mesh.shape["expert"] * (layout.mesh.shape["data"] if strategy == "fsdp_ep" else 1)
    assert (whole == 2 * (4 * 32 * 2 * 24 + 4 * 24 * 32) * 4  # 2 layers' gate_up, down
            and held * shards == whole)
    assert any(note.startswith("experts: ") and f"{held / whole:.3g} of them" in note for note in plan.lint)
