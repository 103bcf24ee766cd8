"""Two processes: a state moves between strategies whose shards live on both processes, exactly."""

import numpy as np
from start import start_worker

process = start_worker()

import jax  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from shardax import DeviceMeshManager, parallelize, reshard  # noqa: E402
from shardax.models.transformer import TransformerConfig, TransformerLM  # noqa: E402

config = TransformerConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
manager = DeviceMeshManager()
layouts = {
    "dp": parallelize(lambda r: TransformerLM(config, rngs=r), optax.adamw(1e-3),
                      manager.create_device_mesh("data=8"), "dp"),
    "fsdp": parallelize(lambda r: TransformerLM(config, rngs=r), optax.adamw(1e-3),
                        manager.create_device_mesh("data=8"), "fsdp"),
    "fsdp_tp": parallelize(lambda r: TransformerLM(config, rngs=r), optax.adamw(1e-3),
                           manager.create_device_mesh("data=4,model=2"), "fsdp_tp"),
}
original = layouts["dp"].init(seed=3)
state = original
for name in ("fsdp", "fsdp_tp", "fsdp", "dp"):
    state = reshard(state, layouts[name])
    kernel = state.params["blocks"]["layers"]["mlp_in"][...]
    assert kernel.sharding == layouts[name].state_shardings.params["blocks"]["layers"]["mlp_in"].get_value()
    assert {shard.device.process_index for shard in kernel.addressable_shards} == {process}


def gathered(tree):
    return [np.asarray(x) for x in multihost_utils.process_allgather(jax.tree.leaves(tree), tiled=True)]


for before, after in zip(gathered(original), gathered(state)):
    np.testing.assert_array_equal(before, after)
print(f"process {process} ok")
