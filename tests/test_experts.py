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


# every strategy family on one tiny model (a mixture of experts, so that the expert axis has
# something to split): data, ZeRO, FSDP, hybrid, tensor, pipeline, context and expert parallelism;
# each case is in the fast tier (every_case)
FAMILIES = [("dp", "data=8"), ("zero1", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"),
            ("hsdp", "replica=2,data=4"), ("tp", "data=4,model=2"), ("fsdp_tp", "data=2,model=4"),
            ("pp", "stage=2,data=4"), ("pp_tp", "stage=2,data=2,model=2"), ("fsdp", "data=2,context=4"),
            ("fsdp_ep", "data=2,expert=4"), ("ep_tp", "data=2,expert=2,model=2"),
            ("ep", "data=2,expert=2,context=2")]


@pytest.mark.every_case
@pytest.mark.parametrize("strategy, mesh", FAMILIES, ids=[f"{s}-{m}" for s, m in FAMILIES])
def test_every_strategy_family_takes_one_devices_first_step(strategy, mesh, reference):
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


class DenseMixture(nnx.Module):
    """A user's mixture of experts that follows ``shardax.experts.ExpertMixture``: every token
    through every expert, weighted by a softmax router. Told a layout with its experts split, each
    device runs its own experts in ``shard_map`` and the devices of the expert axis sum their shares."""

    routes_per_device = True
    laid_out: list = []  # the layouts its calls were traced under

    def __init__(self, rngs, width=8, hidden=16, experts=4):
        normal = nnx.initializers.normal(width ** -0.5)
        per_expert = nnx.with_partitioning(normal, ("expert", None, None))  # the experts' leading dimension
        self.router = nnx.Param(normal(rngs.params(), (width, experts)))
        self.up = nnx.Param(per_expert(rngs.params(), (experts, width, hidden)))
        self.down = nnx.Param(per_expert(rngs.params(), (experts, hidden, width)))
        self.expert_layout = None

    @staticmethod
    def experts(x, gates, up, down):  # (B, T, D), (B, T, E) -> (B, T, D), these experts only
        hidden = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, up))
        return jnp.einsum("bte,bted->btd", gates, jnp.einsum("btef,efd->bted", hidden, down))

    def __call__(self, x):
        gates = jax.nn.softmax(x @ self.router[...], axis=-1)
        layout = self.expert_layout
        DenseMixture.laid_out.append(layout)
        if layout is None or layout.axis is None:
            return self.experts(x, gates, self.up[...], self.down[...])
        P = jax.sharding.PartitionSpec

        def mine(x, gates, up, down):
            return jax.lax.psum(self.experts(x, gates, up, down), layout.axis)

        specs = (P(), P(None, None, layout.axis), P(layout.axis), P(layout.axis))  # each device its experts
        return jax.shard_map(mine, mesh=layout.mesh, in_specs=specs, out_specs=P())(
            x, gates, self.up[...], self.down[...])


def test_a_users_mixture_that_follows_the_protocol_is_told_the_layout_and_trains_as_one_device():
    """parallelize finds any ExpertMixture (here not shardax's MixtureOfExperts) and sets its layout
    on the step's copy of the model: under ep its experts split over ``expert`` (E / X a device) and
    the step takes one device's first step; without an expert axis a mixture that routes per device
    is still told the mesh (no axis), and outside a step it is told nothing."""
    from shardax.experts import ExpertLayout, ExpertMixture

    batch = {"x": np.random.default_rng(1).normal(size=(8, 4, 8)).astype(np.float32),
             "y": np.random.default_rng(2).normal(size=(8, 4, 8)).astype(np.float32)}

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    with nnx.use_eager_sharding(False):  # one device: the names are metadata
        alone = DenseMixture(nnx.Rngs(0))
    assert isinstance(alone, ExpertMixture) and alone.expert_layout is None
    loss, grads = nnx.value_and_grad(loss_fn)(alone, batch)
    parallel = parallelize(lambda rngs: DenseMixture(rngs), optax.sgd(1.0), "data=4,expert=2", "ep")
    state = parallel.init(0)
    before = {name: np.asarray(state.params[name][...]) for name in ("router", "up", "down")}
    DenseMixture.laid_out.clear()
    new, metrics = parallel.train_step(loss_fn)(state, parallel.place_batch(batch))
    assert DenseMixture.laid_out and all(isinstance(layout, ExpertLayout) and layout.axis == "expert"
                                         and layout.shards == 2 for layout in DenseMixture.laid_out)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    for name, was in before.items():  # SGD with rate 1: moved by minus one device's gradient
        np.testing.assert_allclose(was - np.asarray(new.params[name][...]), np.asarray(grads[name][...]),
                                   rtol=0, atol=1e-6)
    assert {shard.data.shape[0] for shard in new.params["up"][...].addressable_shards} == {2}
    dp = parallelize(lambda rngs: DenseMixture(rngs), optax.sgd(1.0), "data=8", "dp")
    told = nnx.merge(dp.configured(), dp.abstract_state.params, dp.abstract_state.rest).expert_layout
    assert told.axis is None and told.batch_axes == ("data",)
    assert parallel.merge(new).expert_layout is None
