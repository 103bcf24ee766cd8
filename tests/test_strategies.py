"""Every strategy trains exactly like one device, and keeps its layout while doing so."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from small_models import (
    AnnotatedMLP,
    assert_trees_close,
    mse_loss,
    regression_batches,
    tiny_transformer_config,
    token_batches,
)

from shardax import DeviceMeshManager
from shardax.model_parallel import parallelize
from shardax.models.transformer import TransformerLM, next_token_loss, weighted_next_token_loss

# One pytest-xdist worker runs this file: the one-device reference runs are trained once and shared.
pytestmark = pytest.mark.xdist_group("test_strategies")

STEPS = 20
CASES = [
    ("dp", "data=8"), ("zero1", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"),
    ("zero2", "data=4,model=2"), ("fsdp", "data=2,model=4"),
    ("tp", "data=2,model=4"), ("tp", "model=8"),
    ("fsdp_tp", "data=2,model=4"), ("fsdp_tp", "data=4,model=2"),
    ("hsdp", "replica=2,data=4"),
]
MODELS = {
    "mlp": (lambda rngs: AnnotatedMLP(rngs), mse_loss, lambda: regression_batches(STEPS)),
    "transformer": (lambda rngs: TransformerLM(tiny_transformer_config(), rngs=rngs), next_token_loss,
                    lambda: token_batches(STEPS)),
}
LOOPED = {"looped transformer": (lambda rngs: TransformerLM(tiny_transformer_config(scan_layers=False),
                                                            rngs=rngs),
                                 next_token_loss, lambda: token_batches(STEPS))}


def train(model_name, strategy, mesh):
    factory, loss_fn, batches = {**MODELS, **LOOPED}[model_name]
    parallel = parallelize(factory, optax.adamw(1e-2), mesh, strategy)
    state = parallel.init(seed=0)
    initial = parallel.state_shardings
    assert jax.tree.map(lambda a: a.sharding, state) == initial  # init landed where the layout says
    step = parallel.train_step(loss_fn)
    losses = []
    for batch in batches():
        state, metrics = step(state, parallel.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, state, parallel


_REFERENCE = {}


def reference(model_name):
    if model_name not in _REFERENCE:
        one_device = DeviceMeshManager(devices=jax.devices()[:1]).create_device_mesh("data=1")
        _REFERENCE[model_name] = train(model_name, "dp", one_device)
    return _REFERENCE[model_name]


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("strategy, mesh_shape", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_strategy_matches_one_device(model_name, strategy, mesh_shape):
    ref_losses, ref_state, _ = reference(model_name)
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape)
    losses, state, parallel = train(model_name, strategy, mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < 0.7 * losses[0]
    # Sharded reductions sum in another order (fp32 rounding ~1e-7); Adam divides by sqrt(nu),
    # which lifts that to ~1e-6 on the few weights whose gradients are near zero, so the
    # parameters get an absolute floor of 1e-5 (weights are ~0.1-0.5), and Adam's moments one of
    # 2e-6 (gradients are ~1e-3; a moment near zero differs by ~1e-6 after 20 steps).
    assert_trees_close(jax.device_get(state.params), jax.device_get(ref_state.params), rtol=1e-5, atol=1e-5)
    assert_trees_close(jax.device_get(state.opt_state), jax.device_get(ref_state.opt_state), rtol=1e-4,
                       atol=2e-6)
    # the layout survived 20 updates: every leaf where init put it
    assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
@pytest.mark.slow
def test_blocks_in_a_python_loop_train_like_one_device(strategy):
    """Unscanned blocks: dp averages their dozens of small gradients in one bucket, fsdp gathers
    each weight; both match one device."""
    ref_losses, ref_state, _ = reference("looped transformer")
    losses, state, parallel = train("looped transformer", strategy,
                                    DeviceMeshManager().create_device_mesh("data=8"))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # a weight or two whose gradient is near zero drifts by ~3e-5 over 20 Adam steps (see above)
    assert_trees_close(jax.device_get(state.params), jax.device_get(ref_state.params), rtol=1e-5, atol=1e-4)
    assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings


def shard_shapes(array):
    return {shard.data.shape for shard in array.addressable_shards}


def test_layouts_per_strategy_on_what_devices_hold():
    mesh8 = DeviceMeshManager().create_device_mesh("data=8")
    mesh2x4 = DeviceMeshManager().create_device_mesh("data=2,model=4")
    factory = lambda rngs: AnnotatedMLP(rngs)  # noqa: E731
    tx = optax.adam(1e-3)

    dp = parallelize(factory, tx, mesh8, "dp").init()
    assert shard_shapes(dp.params["up"]["kernel"][...]) == {(16, 64)}

    zero1 = parallelize(factory, tx, mesh8, "zero1").init()
    assert shard_shapes(zero1.params["up"]["kernel"][...]) == {(16, 64)}
    assert shard_shapes(zero1.opt_state[0].mu["up"]["kernel"][...]) == {(16, 8)}  # largest dim 64 / 8

    fsdp = parallelize(factory, tx, mesh8, "fsdp").init()
    assert fsdp.params["up"]["kernel"][...].sharding.spec == P("data", None)  # `embed` over data
    assert shard_shapes(fsdp.params["up"]["kernel"][...]) == {(2, 64)}
    assert shard_shapes(fsdp.params["head"]["kernel"][...]) == {(2, 4)}  # unannotated: largest divisible dim
    assert fsdp.params["head"]["bias"][...].sharding.is_fully_replicated  # 4 does not divide by 8

    tp = parallelize(factory, tx, mesh2x4, "tp").init()
    assert tp.params["up"]["kernel"][...].sharding.spec == P(None, "model")  # column parallel
    assert tp.params["down"]["kernel"][...].sharding.spec == P("model", None)  # row parallel
    assert shard_shapes(tp.params["down"]["kernel"][...]) == {(16, 16)}

    both = parallelize(factory, tx, mesh2x4, "fsdp_tp").init()
    assert both.params["up"]["kernel"][...].sharding.spec == P("data", "model")
    assert shard_shapes(both.params["up"]["kernel"][...]) == {(8, 16)}
    for shard in both.params["up"]["kernel"][...].addressable_shards:  # each device: its own block
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(jax.device_get(both.params["up"]["kernel"][...]))[shard.index]
        )


@pytest.mark.slow
def test_initial_values_do_not_depend_on_the_strategy():
    factory = lambda rngs: TransformerLM(tiny_transformer_config(), rngs=rngs)  # noqa: E731
    one = parallelize(factory, optax.adam(1e-3),
                      DeviceMeshManager(devices=jax.devices()[:1]).create_device_mesh("data=1"))
    sharded = parallelize(factory, optax.adam(1e-3), DeviceMeshManager().create_device_mesh("data=2,model=4"),
                          "fsdp_tp")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(one.init(3).params),
                 jax.device_get(sharded.init(3).params))


def uneven_token_batches(kind, steps=2, batch_size=16, length=17, vocab=64, seed=0):
    """Token rows whose counted predictions differ from row to row: ``padded`` rows end in
    padding (segment 0) after 2 to 17 tokens, ``packed`` rows hold several documents and then
    padding; ``plain`` rows all count."""
    rng = np.random.default_rng(seed)
    for batch in token_batches(steps, batch_size, length, vocab, seed):
        if kind == "plain":
            yield batch
            continue
        segments = np.zeros((batch_size, length), np.int32)
        for row in range(batch_size):
            used = int(rng.integers(2, length + 1))
            cuts = (np.sort(rng.choice(np.arange(1, used), size=min(2, used - 1), replace=False))
                    if kind == "packed" else [])
            segments[row, :used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")
        yield {**batch, "segments": segments}


def masked_mse(model, batch):
    """A user's loss over the rows that count (``mask``), reporting how many did."""
    mask = batch["mask"]
    errors = ((model(batch["inputs"]) - batch["targets"]) ** 2).mean(-1)
    count = mask.sum()
    return (errors * mask).sum() / jax.numpy.maximum(count, 1.0), {"weight": count}


def masked_regression_batches(steps=2, batch_size=32):
    rng = np.random.default_rng(1)
    for batch in regression_batches(steps, batch_size):
        yield {**batch,
               "mask": (rng.random(batch_size) < np.linspace(0.1, 0.9, batch_size)).astype(np.float32)}


ACCUMULATION = {  # (model, loss, batches, strategy, mesh)
    "lm plain": (lambda rngs: TransformerLM(tiny_transformer_config(), rngs=rngs), weighted_next_token_loss,
                 lambda: uneven_token_batches("plain", batch_size=32), "fsdp_tp", "data=4,model=2"),
    "lm packed": (lambda rngs: TransformerLM(tiny_transformer_config(), rngs=rngs), weighted_next_token_loss,
                  lambda: uneven_token_batches("packed"), "fsdp_tp", "data=4,model=2"),
    "lm padded": (lambda rngs: TransformerLM(tiny_transformer_config(), rngs=rngs), weighted_next_token_loss,
                  lambda: uneven_token_batches("padded"), "dp", "data=8"),
    "user weighted loss": (lambda rngs: AnnotatedMLP(rngs), masked_mse, masked_regression_batches, "zero2",
                           "data=4,model=2"),
}


@pytest.mark.parametrize("case", list(ACCUMULATION))
@pytest.mark.slow
def test_gradient_accumulation_is_the_same_update_as_the_full_batch(case):
    """2 and 4 microbatches give the full batch's loss and parameters within 1e-6 relative, also when
    microbatches count different numbers of tokens (packed or padded rows) or rows (a user's
    masked loss reporting its weight): each microbatch is weighted by what it counts."""
    factory, loss_fn, batches, strategy, mesh_shape = ACCUMULATION[case]
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape)
    results = {}
    for accum in (1, 2, 4):
        # SGD keeps parameters linear in the gradients, so this compares the gradients tightly.
        parallel = parallelize(factory, optax.sgd(0.5), mesh, strategy, grad_accum=accum)
        state, step = parallel.init(), parallel.train_step(loss_fn)
        losses = []
        for batch in batches():
            state, metrics = step(state, parallel.place_batch(batch))
            losses.append(float(metrics["loss"]))
        results[accum] = (losses, jax.device_get(state.params))
        assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings
    for accum in (2, 4):
        np.testing.assert_allclose(results[accum][0], results[1][0], rtol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(results[accum][1]),
                                jax.tree.leaves(results[1][1])):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            relative = np.linalg.norm(a - b) / np.linalg.norm(b)  # each tensor, as a whole
            assert relative <= 1e-6, f"grad_accum={accum}: {jax.tree_util.keystr(path)} is {relative:.2g} off"
