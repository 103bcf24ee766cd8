"""Data-parallel steps on 8 devices train exactly like one device (fp32, 20 steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import AxisType
from small_models import MLP, assert_trees_close, mse_loss, regression_batches

from shardax.compat import (
    DataParallel,
    data_parallel_train_step,
    place_batch_on_shards,
    place_model_state_on_shards,
    spmd_train_step,
)

STEPS = 20


@nnx.jit
def train_step(model, optimizer, batch):
    return spmd_train_step(model, optimizer, mse_loss, batch)


OPTIMIZERS = {"adamw": lambda: optax.adamw(1e-2), "sgd": lambda: optax.sgd(0.05, momentum=0.9)}


def single_device_run(optimizer_name):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPTIMIZERS[optimizer_name](), wrt=nnx.Param)
    losses = [float(train_step(model, optimizer, jax.tree.map(jnp.asarray, b)))
              for b in regression_batches(STEPS)]
    return losses, nnx.state(model, nnx.Param)


_REFERENCES = {}


def reference_run(optimizer_name):
    """Losses and final parameters of 20 steps on one device (computed once per optimizer)."""
    if optimizer_name not in _REFERENCES:
        _REFERENCES[optimizer_name] = single_device_run(optimizer_name)
    return _REFERENCES[optimizer_name]


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
@pytest.mark.parametrize(
    "param_sharding, axis_type",
    [("replicate", AxisType.Auto), ("replicate", AxisType.Explicit), ("shard", AxisType.Auto)],
    ids=["replicate-auto", "replicate-explicit", "shard-auto"],
)
def test_spmd_step_on_8_devices_matches_one_device(optimizer_name, param_sharding, axis_type):
    reference = reference_run(optimizer_name)
    mesh = make_mesh((8,), ("data",), axis_type)
    dp = DataParallel()
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPTIMIZERS[optimizer_name](), wrt=nnx.Param)
    dp.shard_model_state(model, mesh, param_sharding=param_sharding)
    dp.shard_model_state(optimizer, mesh, param_sharding=param_sharding)
    sharding = dp.create_data_parallel_sharding(mesh)
    losses = []
    with jax.set_mesh(mesh):
        for batch in regression_batches(STEPS):
            losses.append(float(train_step(model, optimizer, dp.shard_batch(batch, sharding))))
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < 0.5 * losses[0]  # it really learned
    assert_trees_close(nnx.state(model, nnx.Param), ref_params)
    kernel = model.hidden.kernel[...]
    if param_sharding == "replicate":
        assert kernel.sharding.is_fully_replicated
    else:  # the update kept the FSDP layout: each device still holds 1/8 of the kernel
        assert {s.data.shape for s in kernel.addressable_shards} == {(16, 4)}


def pure_loss(params, batch, graphdef):
    return mse_loss(nnx.merge(graphdef, params), batch)


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
@pytest.mark.parametrize("state_kind", ["train_state", "dict"])
def test_shard_map_step_matches_one_device(mesh8, state_kind, optimizer_name):
    reference = reference_run(optimizer_name)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = OPTIMIZERS[optimizer_name]()
    if state_kind == "train_state":
        state = TrainState.create(apply_fn=None, params=params, tx=tx)
    else:
        state = {"params": params, "opt_state": tx.init(params), "step": 0}
    loss_fn = jax.tree_util.Partial(pure_loss, graphdef=graphdef)
    losses = []
    for batch in regression_batches(STEPS):
        state, metrics = data_parallel_train_step(loss_fn, tx, batch, state, mesh=mesh8)
        losses.append(float(metrics["loss"]))
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    final = state.params if state_kind == "train_state" else state["params"]
    assert int(state.step if state_kind == "train_state" else state["step"]) == STEPS
    assert_trees_close(final, nnx.to_pure_dict(ref_params))
    for leaf in jax.tree.leaves(final):  # every replica identical to the reference
        assert leaf.sharding.is_fully_replicated


def test_shard_map_step_compiles_one_all_reduce_per_gradient(mesh8):
    params = {"w": jnp.ones((16, 4)), "b": jnp.zeros(4)}
    state = {"params": params, "opt_state": optax.sgd(0.1).init(params)}

    def loss_fn(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2)

    batch = {"x": np.ones((32, 16), np.float32)}
    data_parallel_train_step(loss_fn, optax.sgd(0.1), batch, state, mesh=mesh8)
    text = _lower_text(loss_fn, state, batch, mesh8)
    all_reduces = [line for line in text.splitlines()
                   if " all-reduce(" in line or "all-reduce-start(" in line]
    assert all_reduces, text
    assert "all-gather" not in text


def _lower_text(loss_fn, state, batch, mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shardax.compat.steps import engine_step

    placed = place_batch_on_shards(batch, NamedSharding(mesh, P("data")))
    leaves, treedef = jax.tree.flatten(placed)
    return engine_step.lower(state["params"], state["opt_state"], placed, jax.random.key(0), loss_fn=loss_fn,
                       tx=optax.sgd(0.1), mesh=mesh, data_axis="data", reduce_type="mean", has_aux=False,
                       with_rng=False, batch_specs=(treedef, tuple(leaf.sharding.spec for leaf in leaves))
                       ).compile().as_text()


def test_rng_is_folded_per_device(mesh8):
    params = {"w": jnp.zeros(())}
    state = {"params": params, "opt_state": optax.sgd(1.0).init(params)}

    def loss_fn(p, batch, rng):
        return p["w"] * 0 + jax.random.uniform(rng), {"noise": jax.random.uniform(rng)}

    _, metrics = data_parallel_train_step(loss_fn, optax.sgd(1.0), {"x": np.ones((8, 1))}, state,
                                          rngs=jax.random.key(1), mesh=mesh8, has_aux=True)
    per_device = [float(jax.random.uniform(jax.random.fold_in(jax.random.key(1), i))) for i in range(8)]
    np.testing.assert_allclose(float(metrics["aux"]["noise"]), np.mean(per_device), rtol=1e-6)


def test_bad_state_and_optimizer_are_clear_errors(mesh8):
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="state is a list; data_parallel_train_step takes a flax TrainState"):
        data_parallel_train_step(lambda p, b: 0.0, optax.sgd(0.1), {"x": np.ones((8, 2))}, [params],
                                 mesh=mesh8)
    with pytest.raises(ValueError, match="optimizer is str; give an optax.GradientTransformation"):
        data_parallel_train_step(lambda p, b: 0.0, "adam", {"x": np.ones((8, 2))},
                                 {"params": params, "opt_state": ()}, mesh=mesh8)
    with pytest.raises(ValueError, match="needs a mesh: pass mesh=... or call it under"):
        data_parallel_train_step(lambda p, b: 0.0, optax.sgd(0.1), {"x": np.ones((8, 2))},
                                 {"params": params, "opt_state": ()})


@pytest.mark.parametrize("reduce_type,expected_w", [("mean", 0.5), ("sum", 1 - 0.5 * 8)])
def test_model_state_placed_then_spmd_step_under_set_mesh_uses_context_mesh(mesh8, reduce_type, expected_w):
    params = {"w": jnp.ones((4,))}
    state = place_model_state_on_shards({"params": params, "opt_state": optax.sgd(0.5).init(params)}, mesh8)
    with jax.set_mesh(mesh8):
        state, metrics = data_parallel_train_step(
            lambda p, b: jnp.mean((b["x"] * p["w"]).sum(-1)), optax.sgd(0.5), {"x": np.ones((16, 4))}, state,
            reduce_type=reduce_type,
        )
    # each device's gradient is 1 per weight: their mean is 1, their sum 8
    np.testing.assert_allclose(np.asarray(state["params"]["w"]), np.full(4, expected_w))
    assert float(metrics["loss"]) == pytest.approx(4.0)  # the mean over devices either way
    assert int(metrics["skipped_steps"]) == 0
    poisoned = {"x": np.full((16, 4), np.nan, np.float32)}  # a non-finite step leaves the state as it was
    after, metrics = data_parallel_train_step(lambda p, b: jnp.mean((b["x"] * p["w"]).sum(-1)),
                                              optax.sgd(0.5), poisoned, state, mesh=mesh8)
    assert int(metrics["skipped_steps"]) == 1
    np.testing.assert_array_equal(np.asarray(after["params"]["w"]), np.asarray(state["params"]["w"]))
