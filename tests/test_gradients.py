import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.compat import DataParallel, reduce_gradient_tree, reduce_gradients_across_devices


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
    for reduced in (reduce_gradient_tree(grads, reduce_type),
                    jax.jit(reduce_gradient_tree, static_argnums=1)(grads, reduce_type)):
        assert reduced["kernel"].shape == (3, 2) and reduced["bias"].shape == (1,)
        for key in expected:
            np.testing.assert_allclose(np.asarray(reduced[key]), expected[key])
            for shard in reduced[key].addressable_shards:
                np.testing.assert_allclose(np.asarray(shard.data), expected[key][shard.index])


def test_reduce_gradient_tree_rejects_scalars():
    with pytest.raises(ValueError, match="gradient leaf 'loss_scale' is a scalar"):
        reduce_gradient_tree({"w": jnp.ones((8, 2)), "loss_scale": jnp.float32(1)})


# grouped convolutions: (input shape, kernel shape, conv_general_dilated's keywords)
GROUPED_CONVS = {
    "depthwise": ((8, 10, 10, 32), (3, 3, 1, 32), dict(window_strides=(1, 1), padding="SAME",
                                                       feature_group_count=32,
                                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "groups-strided-dilated": ((8, 11, 9, 32), (3, 3, 4, 16), dict(
        window_strides=(2, 1), padding="SAME", rhs_dilation=(1, 2), feature_group_count=8,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "nchw-input-dilated": ((8, 12, 7, 7), (12, 2, 3, 3), dict(
        window_strides=(1, 2), padding=((2, 0), (1, 1)), lhs_dilation=(2, 1), feature_group_count=6,
        dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "1d-valid": ((8, 20, 6), (7, 1, 12), dict(window_strides=(3,), padding="VALID", feature_group_count=6,
                                             dimension_numbers=("NWC", "WIO", "NWC"))),
    "3d": ((8, 5, 6, 7, 4), (2, 3, 3, 2, 8), dict(window_strides=(1, 2, 1), padding="SAME",
                                                  feature_group_count=2,
                                                  dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))),
}


@pytest.mark.parametrize("name", list(GROUPED_CONVS))
@pytest.mark.parametrize("mesh_shape", ["data=4,model=2", "data=2,model=4"])
def test_grouped_conv_gradients_equal_one_devices_with_the_batch_repeated_over_model(name, mesh_shape):
    """XLA's partitioner scales a grouped convolution's kernel gradient by the devices the batch
    repeats over (under tp); ``shardax.grouped_conv`` gives one device's gradients."""
    from shardax import DeviceMeshManager, grouped_conv

    x_shape, k_shape, keywords = GROUPED_CONVS[name]
    x, k = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate((x_shape, k_shape)))

    def loss(conv):
        def value(x, k):
            y = conv(x, k, **keywords)
            return (y * jnp.sin(jnp.arange(y.size).reshape(y.shape))).sum() + (y**2).mean()
        return value

    expected = jax.grad(loss(jax.lax.conv_general_dilated), (0, 1))(x, k)
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape)
    rows = jax.device_put(x, NamedSharding(mesh, P("data")))
    ours = jax.jit(jax.grad(loss(grouped_conv), (0, 1)))(rows, k)
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(jnp.abs(want).max()))
    np.testing.assert_allclose(jax.jit(loss(grouped_conv))(rows, k), loss(jax.lax.conv_general_dilated)(x, k),
                               rtol=1e-5)  # a sum over devices in another order
    if name == "depthwise":  # the case itself: when this fails, XLA has fixed it and grouped_conv can go
        theirs = jax.jit(jax.grad(loss(jax.lax.conv_general_dilated), 1))(rows, k)
        repeats = 8 // mesh.shape["data"]
        np.testing.assert_allclose(theirs, repeats * expected[1], rtol=1e-4, atol=1e-3)
