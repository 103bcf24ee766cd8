import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.compat import DataParallel, create_data_parallel_sharding, place_batch_on_shards


def rows_on_each_device(array):
    """{device id: the rows of dim 0 it holds}."""
    return {s.device.id: (s.index[0].start or 0, s.index[0].stop) for s in array.addressable_shards}


def test_numpy_and_jax_leaves_are_both_split_over_data(mesh8):
    inputs = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    batch = {"inputs": inputs, "targets": jnp.arange(32)}
    placed = place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))
    for leaf, source in ((placed["inputs"], inputs), (placed["targets"], np.arange(32))):
        assert isinstance(leaf, jax.Array)
        assert len(leaf.addressable_shards) == 8
        for shard in leaf.addressable_shards:
            start = shard.index[0].start
            assert shard.data.shape[0] == 4
            np.testing.assert_array_equal(np.asarray(shard.data), source[start : start + 4])
        assert sorted(rows_on_each_device(leaf).values()) == [(i, i + 4) for i in range(0, 32, 4)]


def test_scalars_are_replicated(mesh8):
    placed = place_batch_on_shards({"x": np.ones((8, 2)), "temperature": 0.5, "step": np.int32(3)},
                                   create_data_parallel_sharding(mesh8))
    for key, value in (("temperature", 0.5), ("step", 3)):
        assert placed[key].sharding.is_fully_replicated
        assert [float(s.data) for s in placed[key].addressable_shards] == [value] * 8


def test_2d_mesh_splits_over_data_and_replicates_over_model(mesh2d):
    data = mesh2d.shape["data"]
    batch = np.arange(16 * 5).reshape(16, 5)
    placed = DataParallel().shard_batch(batch, DataParallel().create_data_parallel_sharding(mesh2d))
    rows = 16 // data
    for shard in placed.addressable_shards:
        assert shard.data.shape == (rows, 5)
        np.testing.assert_array_equal(np.asarray(shard.data), batch[shard.index[0]])
    # each slice of rows lives on exactly `model` devices
    counts = {}
    for shard in placed.addressable_shards:
        counts[shard.index[0].start] = counts.get(shard.index[0].start, 0) + 1
    assert set(counts.values()) == {mesh2d.shape["model"]}


def test_indivisible_batch_names_leaf_size_and_axis(mesh8):
    batch = {"inputs": np.ones((30, 3)), "targets": np.ones((32,))}
    with pytest.raises(ValueError) as info:
        place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))
    message = str(info.value)
    assert "\n" not in message
    for expected in ("'inputs'", "size 30", "'data'", "size 8", "data=8", "multiple of 8", "32"):
        assert expected in message


def test_non_array_leaf_is_a_clear_error(mesh8):
    with pytest.raises(ValueError, match="batch leaf 'name' is a str"):
        place_batch_on_shards({"name": "cat", "x": np.ones(8)}, create_data_parallel_sharding(mesh8))


def test_unknown_data_axis_lists_mesh_axes(mesh2d):
    with pytest.raises(ValueError, match=r"data_axis='batch' is not an axis of the mesh data=\d,model=\d"):
        create_data_parallel_sharding(mesh2d, "batch")


def test_static_and_instance_methods_agree(mesh8):
    sharding = DataParallel.create_data_parallel_sharding_static(mesh8)
    assert sharding == NamedSharding(mesh8, P("data"))
    a = DataParallel.shard_batch_static(np.arange(16.0), sharding)
    b = DataParallel().shard_batch(np.arange(16.0), sharding)
    assert a.sharding == b.sharding and np.array_equal(a, b)
