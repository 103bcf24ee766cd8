import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax import DataParallel, reduce_gradient_tree, reduce_gradients_across_devices


def per_device_gradients(mesh):
    """Device i holds gradient leaves filled with i (and i*10): different on every device."""
    index = np.arange(8, dtype=np.float32)
    return {
        "kernel": np.repeat(index[:, None, None], 3, 1).repeat(2, 2),  # (8, 3, 2) -> (1, 3, 2) per device
        "bias": index[:, None] * 10,  # (8, 1)
    }


@pytest.mark.parametrize("reduce_type, expected", [("mean", 3.5), ("sum", 28.0)])
def test_all_reduce_inside_shard_map(mesh8, reduce_type, expected):
    def reduce(grads):
        local = jax.tree.map(lambda g: g[0], grads)  # this device's own gradient, shape kept
        reduced = DataParallel.all_reduce_gradients_static(local, reduce_type=reduce_type, axis_name="data")
        return jax.tree.map(lambda g: g[None], reduced)

    out = jax.jit(jax.shard_map(reduce, mesh=mesh8, in_specs=P("data"), out_specs=P("data")))(
        per_device_gradients(mesh8)
    )
    assert out["kernel"].shape == (8, 3, 2) and out["bias"].shape == (8, 1)
    for shard in out["kernel"].addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.full((1, 3, 2), expected))
    for shard in out["bias"].addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.full((1, 1), expected * 10))


def test_all_reduce_inside_pmap_with_the_seed_default_axis_name():
    @functools.partial(jax.pmap, axis_name="batch")
    def step(grads):
        return DataParallel().all_reduce_gradients(grads, reduce_type="mean")

    out = step({"w": jnp.arange(8.0)[:, None] * jnp.ones((8, 4))})
    np.testing.assert_allclose(np.asarray(out["w"]), np.full((8, 4), 3.5))


def test_bad_reduce_type_and_unbound_axis(mesh8):
    with pytest.raises(ValueError, match="reduce_type='max' is not supported; use 'mean' or 'sum'"):
        reduce_gradients_across_devices({"w": jnp.ones(2)}, reduce_type="max")
    with pytest.raises(ValueError, match="reduce_type='median'"):
        reduce_gradient_tree({"w": jnp.ones((8, 2))}, reduce_type="median")
    with pytest.raises(ValueError, match=r"axis_name='batch' is not a bound parallel axis here"):
        jax.shard_map(
            lambda g: reduce_gradients_across_devices(g), mesh=mesh8, in_specs=P("data"), out_specs=P("data")
        )(jnp.ones(8))


@pytest.mark.parametrize("reduce_type", ["mean", "sum"])
def test_reduce_gradient_tree_reduces_the_replica_axis(mesh8, reduce_type):
    grads = jax.device_put(per_device_gradients(mesh8), NamedSharding(mesh8, P("data")))
    expected = jax.tree.map(lambda g: getattr(np, reduce_type)(g, axis=0), per_device_gradients(mesh8))
    for reduced in (reduce_gradient_tree(grads, reduce_type), jax.jit(reduce_gradient_tree, static_argnums=1)(grads, reduce_type)):
        assert reduced["kernel"].shape == (3, 2) and reduced["bias"].shape == (1,)
        for key in expected:
            np.testing.assert_allclose(np.asarray(reduced[key]), expected[key])
            for shard in reduced[key].addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), expected[key][shard.index])


def test_reduce_gradient_tree_rejects_scalars():
    with pytest.raises(ValueError, match="gradient leaf 'loss_scale' is a scalar"):
        reduce_gradient_tree({"w": jnp.ones((8, 2)), "loss_scale": jnp.float32(1)})
