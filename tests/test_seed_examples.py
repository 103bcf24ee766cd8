"""The seed documents' usage examples, run against shardax with only the import line changed.

Placeholders (MyModel, loss_fn, dataloader, compute_loss) are filled with small real ones; the
one example that is wrong JAX (artifex's `jax.pmap` without `axis_name`) is run in its corrected
form, and its original form is shown to fail with shardax's clear message.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from small_models import MLP, mse_loss, regression_batches

from shardax import DeviceMeshManager
from shardax.compat import DataParallel, data_parallel_rules, spmd_train_step


class MyModel(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(784, 10, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_basic_data_parallel_training():
    manager = DeviceMeshManager()
    mesh = manager.create_data_parallel_mesh()
    dp = DataParallel()
    sharding = dp.create_data_parallel_sharding(mesh)
    batch = {"inputs": jnp.ones((32, 784)), "targets": jnp.zeros((32,))}
    sharded_batch = dp.shard_batch(batch, sharding)

    assert {s.data.shape for s in sharded_batch["inputs"].addressable_shards} == {(4, 784)}
    assert {s.data.shape for s in sharded_batch["targets"].addressable_shards} == {(4,)}
    assert len({s.device for s in sharded_batch["inputs"].addressable_shards}) == 8


def test_sharding_model_state():
    mesh = DeviceMeshManager().create_data_parallel_mesh()
    dp = DataParallel()
    model_state = nnx.state(MyModel(nnx.Rngs(0)))
    sharded_state = dp.shard_model_state(model_state, mesh, param_sharding="replicate")
    assert sharded_state["linear"]["kernel"][...].sharding.is_fully_replicated
    sharded_state = dp.shard_model_state(model_state, mesh, param_sharding="shard")
    kernel = sharded_state["linear"]["kernel"][...]  # (784, 10): 784 = 8 * 98
    assert {s.data.shape for s in kernel.addressable_shards} == {(98, 10)}
    assert sharded_state["linear"]["bias"][...].sharding.is_fully_replicated  # 10 does not divide by 8


def compute_loss(params, batch):
    return jnp.mean((batch @ params["w"]) ** 2)


def test_gradient_aggregation_corrected_pmap():
    # The seed wrote `@jax.pmap`; the collective needs the axis it reduces over to be named.
    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(params, batch):
        def loss_fn(p):
            return compute_loss(p, batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = DataParallel.all_reduce_gradients_static(grads, reduce_type="mean")
        return grads, loss

    params = {"w": jnp.ones((8, 3, 1))}  # replicated by hand: one copy per device
    batch = jnp.arange(8 * 4 * 3, dtype=jnp.float32).reshape(8, 4, 3)
    grads, _ = train_step(params, batch)
    full = jax.grad(compute_loss)({"w": jnp.ones((3, 1))}, batch.reshape(32, 3))
    for device_grads in grads["w"]:
        np.testing.assert_allclose(np.asarray(device_grads), np.asarray(full["w"]), rtol=1e-5)


def test_gradient_aggregation_as_written_fails_clearly():
    @jax.pmap
    def train_step(params, batch):
        grads = jax.grad(compute_loss)(params, batch)
        return DataParallel.all_reduce_gradients_static(grads, reduce_type="mean")

    with pytest.raises(ValueError,
                       match=r"axis_name='batch' is not a bound parallel axis.*jax.pmap\(\.\.\., "
                             r"axis_name='batch'\)"):
        train_step({"w": jnp.ones((8, 3, 1))}, jnp.ones((8, 4, 3)))


def test_using_static_methods():
    manager = DeviceMeshManager()
    batch = {"inputs": jnp.ones((32, 784)), "targets": jnp.zeros((32,))}
    mesh = manager.create_device_mesh({"data": 4})
    sharding = DataParallel.create_data_parallel_sharding_static(mesh)
    sharded_batch = DataParallel.shard_batch_static(batch, sharding)
    assert {s.data.shape for s in sharded_batch["inputs"].addressable_shards} == {(8, 784)}
    assert len(sharded_batch["inputs"].addressable_shards) == 4


def test_complete_training_example():
    manager = DeviceMeshManager()
    mesh = manager.create_data_parallel_mesh()
    dp = DataParallel()

    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    data_sharding = dp.create_data_parallel_sharding(mesh)
    model_state = nnx.state(model)
    sharded_model_state = dp.shard_model_state(model_state, mesh)
    nnx.update(model, sharded_model_state)  # the seed forgot to put the placed state back

    dataloader = [next(regression_batches(1))] * 5  # one batch, seen five times
    losses = []
    for batch in dataloader:
        sharded_batch = dp.shard_batch(batch, data_sharding)

        def loss_fn(model):
            return mse_loss(model, sharded_batch)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert model.hidden.kernel[...].sharding.is_fully_replicated


def test_datarax_spmd_example():
    mesh = jax.make_mesh((4,), ("data",))
    rules = data_parallel_rules()
    assert ("batch", "data") in rules

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    my_loss_fn = mse_loss

    @nnx.jit
    def train_step(model, optimizer, batch):
        return spmd_train_step(model, optimizer, my_loss_fn, batch)

    batch = next(regression_batches(1))
    with jax.set_mesh(mesh):
        batch = DataParallel.shard_batch_static(batch,
                                                DataParallel.create_data_parallel_sharding_static(mesh))
        loss = train_step(model, optimizer, batch)
    assert np.isfinite(float(loss)) and float(loss) > 0
