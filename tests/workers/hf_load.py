"""Load a Hugging Face checkpoint over two processes (fsdp on data=8), check the logits and the
bytes this process read, then save it again (process 0 writes, everyone gathers)."""

import sys

import numpy as np
from start import start_worker

process = start_worker()

import jax  # noqa: E402

from shardax import hf  # noqa: E402

folder, expected_path, out = sys.argv[1:4]
loaded = hf.load(folder, "data=8", "fsdp")
own = 0  # the bytes of the distinct slices this process's devices hold (the files are float32)
for leaf in jax.tree.leaves(loaded.state.params):
    slices = {tuple((s.start, s.stop) for s in shard.index): shard.data.size
              for shard in leaf.addressable_shards}
    own += 4 * sum(slices.values())
total = sum(4 * leaf.size for leaf in jax.tree.leaves(loaded.state.params))
expected = np.load(expected_path)
tokens = np.random.default_rng(0).integers(0, 96, (8, 17))[:, :-1]
replicated = jax.sharding.NamedSharding(loaded.parallel.mesh, jax.sharding.PartitionSpec())
logits = jax.jit(lambda model, t: model(t), out_shardings=replicated)(loaded.model(), tokens)
np.testing.assert_allclose(np.asarray(logits.addressable_data(0)), expected, rtol=1e-4,
                           atol=1e-4 * np.abs(expected).max())
loaded.save(out)
print(f"process {process} read {loaded.bytes_read} own {own} total {total}")
