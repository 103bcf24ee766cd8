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


def train_transformer(config, mesh, strategy, *, steps=20, batch_size=32, lr=3e-3, **options):
    """``steps`` AdamW steps of ``TransformerLM(config)`` on ``token_batches``: (losses, state, parallel)."""
    import optax

    from shardax import parallelize
    from shardax.models.transformer import TransformerLM, next_token_loss

    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(lr), mesh, strategy,
                           **options)
    state, step = parallel.init(seed=0), parallel.train_step(next_token_loss)
    losses = []
    for batch in token_batches(steps, batch_size=batch_size):
        state, metrics = step(state, parallel.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, state, parallel


def assert_trained_like(losses, state, reference, parallel, share=0.98):
    """A run of 20 AdamW steps against one device's (``reference``: its losses and state).

    - losses within 1e-5 relative, and falling;
    - every parameter tensor within 2e-5 relative: ``|p - p_ref| / |p_ref|`` (Frobenius norms; a
      layer-norm bias that starts at zero reached 1.1e-5 under pp_fsdp on one machine's XLA:CPU
      build and stayed under 1e-5 on another, with the same program);
    - element by element, every parameter within 1e-4, and ``share`` of them within 1e-5
      relative. Not all of them: sums in another order change a near-zero gradient by more than
      its own size, and Adam's 1/sqrt(nu) lifts that to a full step (plain dp on 8 devices
      leaves some of the 8-layer transformer's weights past 1e-5 relative too);
    - the state laid out as ``parallel`` says."""
    ref_losses, ref_state = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < 0.7 * losses[0]
    ours, theirs = jax.device_get(state.params), jax.device_get(ref_state.params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        relative = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert relative <= 2e-5, f"{jax.tree_util.keystr(path)} is {relative:.2g} off one device's (relative)"
    assert_trees_close(ours, theirs, rtol=1e-5, atol=1e-4)
    close = [np.isclose(a, b, rtol=1e-5, atol=1e-7)
             for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs))]
    assert sum(c.sum() for c in close) >= share * sum(c.size for c in close)
    assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings


class AnnotatedMLP(nnx.Module):
    """Megatron-style column -> row MLP, plus an unannotated head whose bias (4) never divides by 8."""

    def __init__(self, rngs: nnx.Rngs):
        from shardax.layers import ColumnParallelLinear, RowParallelLinear

        self.up = ColumnParallelLinear(16, 64, rngs=rngs)
        self.down = RowParallelLinear(64, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


def tiny_transformer_config(**overrides):
    from shardax.models.transformer import TransformerConfig

    settings = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    settings.update(overrides)
    return TransformerConfig(**settings)


def token_batches(steps, batch_size=16, length=17, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, size=(4, length))  # few patterns repeated: learnable in 20 steps
    for _ in range(steps):
        rows = base[rng.integers(0, 4, size=batch_size)]
        yield {"tokens": rows.astype(np.int32)}
