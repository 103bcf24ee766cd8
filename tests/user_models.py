"""Models as users write them: plain Flax NNX, no logical-axis annotations, state that changes in
``__call__`` (BatchNorm statistics, Dropout's RNG stream, a counter of their own), odd sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class SeenExamples(nnx.Variable):
    """A user's own variable kind, updated on every training call."""


class ConvNet(nnx.Module):
    """8x8 images -> 10 classes: conv, BatchNorm, ReLU, conv, BatchNorm, a depthwise conv with a
    skip (ConvNeXt's kind), mean-pool, linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), use_bias=False, rngs=rngs)  # BatchNorm has the bias
        self.norm1 = nnx.BatchNorm(8, momentum=0.8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 6, (3, 3), strides=2, use_bias=False, rngs=rngs)  # 6 channels: never divides by 8
        self.norm2 = nnx.BatchNorm(6, momentum=0.8, rngs=rngs)
        self.depthwise = nnx.Conv(6, 6, (3, 3), feature_group_count=6, rngs=rngs)
        self.head = nnx.Linear(6, 10, rngs=rngs)

    def __call__(self, images):  # (B, 8, 8, 1)
        x = nnx.relu(self.norm1(self.conv1(images)))
        x = nnx.relu(self.norm2(self.conv2(x)))  # (B, 4, 4, 6)
        x = x + self.depthwise(x)
        return self.head(x.mean(axis=(1, 2)))


class DropoutMLP(nnx.Module):
    """12 -> 40 -> 5 with Dropout between, counting the examples it has trained on, and noise
    added to its inputs in training from an RNG stream of its own (``noise``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(12, 40, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(40, 5, rngs=rngs)
        self.seen = SeenExamples(jnp.zeros((), jnp.int32))
        self.noise = nnx.Rngs(noise=rngs.params())

    def __call__(self, x):
        if not self.dropout.deterministic:  # training
            self.seen[...] += x.shape[0]
            x = x + 0.1 * jax.random.normal(self.noise.noise(), x.shape)
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


class LoRAMLP(nnx.Module):
    """12 -> 40 -> 5 fine-tuned with Flax's own LoRA layers (``nnx.LoRALinear``: the base kernel
    an ``nnx.Param``, the adapters ``nnx.LoRAParam``s of rank 3), as Flax's guide writes it."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.LoRALinear(12, 40, lora_rank=3, rngs=rngs)
        self.out = nnx.LoRALinear(40, 5, lora_rank=3, b_initializer=nnx.initializers.normal(0.1), rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def classification_loss(model, batch):
    logits = model(batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["labels"])}


def image_batches(steps, batch_size=16, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        labels = rng.integers(0, 10, batch_size)
        images = rng.normal(size=(batch_size, 8, 8, 1)) + labels[:, None, None, None] / 5
        yield {"inputs": images.astype(np.float32), "labels": labels.astype(np.int32)}


def vector_batches(steps, batch_size=16, seed=0):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(12, 5))
    for _ in range(steps):
        inputs = rng.normal(size=(batch_size, 12))
        yield {"inputs": inputs.astype(np.float32), "labels": (inputs @ teacher).argmax(-1).astype(np.int32)}


USER_MODELS = {
    "cnn-batchnorm": (ConvNet, image_batches),
    "mlp-dropout": (DropoutMLP, vector_batches),
}


def plain_nnx_run(factory, tx, loss_fn, batches, *, grad_accum=1, wrt=nnx.Param):
    """Train with plain Flax NNX on one device: the reference every strategy must match.

    With ``grad_accum=k`` the model runs on k microbatches (rows i, i+k, ...) one after the
    other, updating its state each time, and the gradients are averaged. ``wrt``: the
    parameters trained (``nnx.LoRAParam``: the adapters alone, as Flax's LoRA guide does).
    """
    model = factory(nnx.Rngs(0))
    model.train()
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def step(model, optimizer, batch):
        totals, grads = None, None
        for i in range(grad_accum):
            micro = jax.tree.map(lambda leaf: leaf[i::grad_accum], batch)
            (loss, metrics), micro_grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)(
                model, micro)
            values = {"loss": loss, **metrics}
            totals = values if totals is None else jax.tree.map(jnp.add, totals, values)
            grads = micro_grads if grads is None else jax.tree.map(jnp.add, grads, micro_grads)
        optimizer.update(model, jax.tree.map(lambda g: g / grad_accum, grads))
        return jax.tree.map(lambda total: total / grad_accum, totals)

    history = [jax.device_get(step(model, optimizer, batch)) for batch in batches]
    return history, model


def on_host(tree):
    """Every leaf as numpy; RNG keys as their raw bits."""
    def fetch(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(jax.device_get(leaf))

    return jax.tree.map(fetch, tree)
