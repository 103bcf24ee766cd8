"""Train a small MLP data-parallel on 8 (simulated CPU) devices and check it against one device.

    python examples/train_data_parallel.py [--devices 8] [--steps 60]

Each step the global batch of 64 is split over the mesh's `data` axis (8 rows per device),
every device holds a replica of the model, and XLA averages the gradients across devices.
The same 60 steps on a single device give the same losses: data parallelism changes where the
work happens, not what is computed.
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on GPU/TPU)")
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()

import jax  # noqa: E402  (devices must be configured before JAX starts)
from shardax.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(args.devices)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from shardax import DeviceMeshManager, get_mesh_info  # noqa: E402
from shardax.compat import DataParallel, spmd_train_step  # noqa: E402


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(32, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):  # (B, 32) -> (B, 10)
        return self.out(jax.nn.gelu(self.hidden(x)))


def loss_fn(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def batches(steps, batch_size=64, seed=0):
    """Points in 32-D labelled by the nearest of 10 fixed centres: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(10, 32)).astype(np.float32)
    for _ in range(steps):
        labels = rng.integers(0, 10, size=batch_size)
        inputs = centres[labels] + 0.8 * rng.normal(size=(batch_size, 32)).astype(np.float32)
        yield {"inputs": inputs, "labels": labels.astype(np.int32)}


@nnx.jit
def train_step(model, optimizer, batch):
    return spmd_train_step(model, optimizer, loss_fn, batch)


def train(mesh=None):
    model = Classifier(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    dp = DataParallel()
    losses = []
    if mesh is None:  # one device: plain arrays
        for batch in batches(args.steps):
            losses.append(float(train_step(model, optimizer, jax.tree.map(jnp.asarray, batch))))
        return losses
    dp.shard_model_state(model, mesh, "replicate")
    dp.shard_model_state(optimizer, mesh, "replicate")
    sharding = dp.create_data_parallel_sharding(mesh)
    with jax.set_mesh(mesh):
        for step, batch in enumerate(batches(args.steps)):
            losses.append(float(train_step(model, optimizer, dp.shard_batch(batch, sharding))))
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


mesh = DeviceMeshManager().create_data_parallel_mesh()
info = get_mesh_info(mesh)
print(f"mesh {info['shape']} on {info['num_devices']} {info['platform']} devices; global batch 64")
parallel = train(mesh)
single = train(None)
gap = max(abs(a - b) for a, b in zip(parallel, single))
print(f"loss {parallel[0]:.4f} -> {parallel[-1]:.4f}; largest difference from one device: {gap:.2e}")
