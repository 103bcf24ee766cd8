"""Small models and data shared by the tests (kept tiny: the suite runs on 2 CPU cores)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    """16 -> 32 -> 4 with a 3-wide odd layer so that some leaves never divide by 8."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.odd = nnx.Linear(32, 3, rngs=rngs)
        self.out = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.tanh(self.odd(jax.nn.relu(self.hidden(x)))))


def mse_loss(model, batch):
    return jnp.mean((model(batch["inputs"]) - batch["targets"]) ** 2)


def regression_batches(steps, batch_size=32, seed=0):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(16, 4)).astype(np.float32)
    for _ in range(steps):
        inputs = rng.normal(size=(batch_size, 16)).astype(np.float32)
        yield {"inputs": inputs, "targets": np.tanh(inputs @ teacher)}


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol),
        actual,
        expected,
    )
