"""Each process passes only its own rows; the global batch must hold all rows in order."""

import numpy as np
from start import start_worker

process = start_worker()

import jax  # noqa: E402

from shardax import DeviceMeshManager  # noqa: E402
from shardax.compat import DataParallel  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
mesh = DeviceMeshManager().create_device_mesh("data=-1")
dp = DataParallel()
sharding = dp.create_data_parallel_sharding(mesh)

global_inputs = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
local_rows = global_inputs[process * 16 : (process + 1) * 16]  # this host's half
batch = dp.shard_batch({"inputs": local_rows, "scale": 2.0}, sharding)

inputs = batch["inputs"]
assert inputs.shape == (32, 3), inputs.shape
assert not inputs.is_fully_addressable
for shard in inputs.addressable_shards:  # this process's devices hold its own rows
    np.testing.assert_array_equal(np.asarray(shard.data), global_inputs[shard.index])
    assert shard.device.process_index == process
total = jax.jit(lambda b: (b["inputs"] * b["scale"]).sum(),
                out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(batch)
assert float(total) == float(global_inputs.sum() * 2), float(total)

try:
    dp.shard_batch({"inputs": local_rows[:15]}, sharding)
except ValueError as error:
    assert "size 30" in str(error) and "this process holds 15 rows" in str(error), error
else:
    raise AssertionError("an indivisible host-local batch was accepted")

# An ICI x DCN mesh: `model` stays inside a process, `data` spans both processes.
hybrid = DeviceMeshManager().create_multi_slice_mesh("data=2,model=2", "data=2,model=1")
assert dict(hybrid.shape) == {"data": 4, "model": 2}
owners = np.vectorize(lambda d: d.process_index)(hybrid.devices)
assert (owners == owners[:, :1]).all(), owners  # each model group lives on one process
assert sorted(owners[:, 0].tolist()) == [0, 0, 1, 1], owners
print(f"process {process} ok {float(total)}")
