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
        # 6 channels: never divides by 8
        self.conv2 = nnx.Conv(8, 6, (3, 3), strides=2, use_bias=False, rngs=rngs)
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
    added to its inputs in training from an RNG stream of its own (``noise``). Its inputs are
    paired through a constant index table kept as a plain ``jnp`` array attribute, as window
    attention keeps its relative position index."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(24, 40, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(40, 5, rngs=rngs)
        self.seen = SeenExamples(jnp.zeros((), jnp.int32))
        self.noise = nnx.Rngs(noise=rngs.params())
        features = jnp.arange(12)
        self.pairs = jnp.stack([features, (features + 5) % 12], axis=-1).reshape(-1)  # (24,) int32

    def __call__(self, x):
        if not self.dropout.deterministic:  # training
            self.seen[...] += x.shape[0]
            x = x + 0.1 * jax.random.normal(self.noise.noise(), x.shape)
        x = x[:, self.pairs] * jnp.where(self.pairs % 2 == 0, 1.0, -0.5)  # (B, 24)
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


class LoRAMLP(nnx.Module):
    """12 -> 40 -> 5 fine-tuned with Flax's own LoRA layers (``nnx.LoRALinear``: the base kernel
    an ``nnx.Param``, the adapters ``nnx.LoRAParam``s of rank 3), as Flax's guide writes it."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.LoRALinear(12, 40, lora_rank=3, rngs=rngs)
        self.out = nnx.LoRALinear(40, 5, lora_rank=3, b_initializer=nnx.initializers.normal(0.1), rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


class SquareMLP(nnx.Module):
    """16 -> 64 -> 64 -> 4 with ReLUs: a square hidden weight (jax.nn.relu's one cached jaxpr serves both
    calls)."""

    def __init__(self, rngs: nnx.Rngs):
        self.a, self.b, self.c = (nnx.Linear(i, o, rngs=rngs) for i, o in ((16, 64), (64, 64), (64, 4)))

    def __call__(self, x):
        return self.c(nnx.relu(self.b(nnx.relu(self.a(x)))))


class VAE(nnx.Module):
    """32 -> 64 -> 64 -> (mean, log-variance) of 8 -> 64 -> 64 -> 32: equal hidden widths, two heads."""

    def __init__(self, rngs: nnx.Rngs):
        self.encode = nnx.List([nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)])
        self.mean, self.log_variance = nnx.Linear(64, 8, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)
        self.decode = nnx.List([nnx.Linear(8, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs),
                                nnx.Linear(64, 32, rngs=rngs)])
        self.noise = nnx.Rngs(noise=rngs.params())

    def __call__(self, x):
        for layer in self.encode:
            x = nnx.relu(layer(x))
        mean, log_variance = self.mean(x), self.log_variance(x)
        z = mean + jnp.exp(0.5 * log_variance) * jax.random.normal(self.noise.noise(), mean.shape)
        for layer in self.decode[:-1]:
            z = nnx.relu(layer(z))
        return self.decode[-1](z), mean, log_variance


class TinyUNet(nnx.Module):
    """A diffusion U-Net's shape: a timestep embedding added to the features, a residual block
    with GroupNorm (an additive skip), a strided conv down, a transposed conv up, and the
    skip concatenated on the channels."""

    def __init__(self, rngs: nnx.Rngs, channels: int = 16):
        c = channels
        self.stem, self.time = nnx.Conv(3, c, (3, 3), rngs=rngs), nnx.Linear(16, c, rngs=rngs)
        self.block, self.norm = nnx.Conv(c, c, (3, 3), rngs=rngs), nnx.GroupNorm(c, num_groups=4, rngs=rngs)
        self.down = nnx.Conv(c, 2 * c, (3, 3), strides=2, rngs=rngs)
        self.middle = nnx.Conv(2 * c, 2 * c, (3, 3), rngs=rngs)
        self.up = nnx.ConvTranspose(2 * c, c, (2, 2), strides=(2, 2), rngs=rngs)
        self.fuse, self.out = nnx.Conv(2 * c, c, (3, 3), rngs=rngs), nnx.Conv(c, 3, (3, 3), rngs=rngs)

    def __call__(self, images, timesteps):
        h = self.stem(images) + self.time(timesteps)[:, None, None, :]
        h = h + nnx.silu(self.norm(self.block(nnx.silu(h))))
        middle = nnx.silu(self.middle(nnx.silu(self.down(h))))
        return self.out(nnx.silu(self.fuse(jnp.concatenate([self.up(middle), h], axis=-1))))


class DiTBlock(nnx.Module):
    """A DiT block (Peebles and Xie): adaLN-Zero, the timestep's shift, scale and gate for the
    attention and the MLP, computed by one linear layer and split six ways."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32, heads: int = 4):
        self.modulation = nnx.Linear(width, 6 * width, rngs=rngs)
        self.norm1 = nnx.LayerNorm(width, use_scale=False, use_bias=False, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, use_scale=False, use_bias=False, rngs=rngs)
        self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x, condition):
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.modulation(nnx.silu(condition))[:, None], 6, -1)
        x = x + gate1 * self.attention(self.norm1(x) * (1 + scale1) + shift1)
        return x + gate2 * self.down(nnx.gelu(self.up(self.norm2(x) * (1 + scale2) + shift2)))


class TinyDiT(nnx.Module):
    """A diffusion transformer on 8x8x3 images: 2x2 patches embedded, a learned position table,
    two DiT blocks conditioned on the timestep embedding, a final norm and linear back to patches."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32):
        self.patches = nnx.Linear(12, width, rngs=rngs)
        self.positions = nnx.Param(jax.random.normal(rngs.params(), (16, width)) * 0.02)
        self.time = nnx.Linear(16, width, rngs=rngs)
        self.block1, self.block2 = DiTBlock(rngs, width), DiTBlock(rngs, width)
        self.final_norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, 12, rngs=rngs)

    def __call__(self, images, timesteps):
        b = images.shape[0]
        patches = images.reshape(b, 4, 2, 4, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 16, 12)
        x, condition = self.patches(patches) + self.positions[...], self.time(timesteps)
        x = self.block2(self.block1(x, condition), condition)
        out = self.out(self.final_norm(x)).reshape(b, 4, 4, 2, 2, 3).transpose(0, 1, 3, 2, 4, 5)
        return out.reshape(b, 8, 8, 3)


class ConvNeXtBlock(nnx.Module):
    """ConvNeXt's block: a depthwise 3x3 conv, a pointwise MLP (4x), added to its input."""

    def __init__(self, rngs: nnx.Rngs, channels: int = 16):
        self.depthwise = nnx.Conv(channels, channels, (3, 3), feature_group_count=channels, rngs=rngs)
        self.up, self.down = (nnx.Linear(channels, 4 * channels, rngs=rngs),
                              nnx.Linear(4 * channels, channels, rngs=rngs))

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.depthwise(x))))


class TinyConvNeXt(nnx.Module):
    """A stem conv, a LayerStack of two ConvNeXt blocks (so pipelines can stage it), a head."""

    def __init__(self, rngs: nnx.Rngs):
        from shardax.blocks import LayerStack

        self.stem = nnx.Conv(3, 16, (2, 2), strides=2, rngs=rngs)
        self.stack = LayerStack(lambda rngs: ConvNeXtBlock(rngs), 2, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, images):
        return self.head(self.stack(self.stem(images)).mean(axis=(1, 2)))


def generative_batch(name, rows=8, seed=0):
    """One batch for SquareMLP ("square"), VAE ("vae"), TinyUNet ("unet"), TinyDiT ("dit") or
    TinyConvNeXt ("convnext"), and its loss."""
    rng = np.random.default_rng(seed)
    if name == "convnext":
        batch = {"inputs": rng.normal(size=(rows, 8, 8, 3)).astype(np.float32),
                 "labels": rng.integers(0, 10, rows).astype(np.int32)}
        return TinyConvNeXt, batch, lambda model, b: classification_loss(model, b)[0]
    if name == "square":
        batch = {"x": rng.normal(size=(rows, 16)), "y": rng.normal(size=(rows, 4))}
        return (SquareMLP, jax.tree.map(np.float32, batch),
                lambda model, b: ((model(b["x"]) - b["y"]) ** 2).mean())
    if name == "vae":
        def elbo(model, b):
            out, mean, log_variance = model(b["x"])
            kl = 0.5 * (jnp.exp(log_variance) + mean**2 - 1 - log_variance).sum(-1).mean()
            return ((out - b["x"]) ** 2).sum(-1).mean() + kl
        return VAE, {"x": rng.normal(size=(rows, 32)).astype(np.float32)}, elbo
    batch = {"images": rng.normal(size=(rows, 8, 8, 3)), "noise": rng.normal(size=(rows, 8, 8, 3)),
             "t": rng.normal(size=(rows, 16))}
    return TinyDiT if name == "dit" else TinyUNet, jax.tree.map(np.float32, batch), lambda model, b: (
        (model(b["images"] + b["noise"], b["t"]) - b["noise"]) ** 2).mean()


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


def plain_nnx_run(factory, tx, loss_fn, batches, *, grad_accum=1, wrt=nnx.Param, optimizer_too=False):
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
            (loss, metrics), micro_grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt),
                                                              has_aux=True)(model, micro)
            values = {"loss": loss, **metrics}
            totals = values if totals is None else jax.tree.map(jnp.add, totals, values)
            grads = micro_grads if grads is None else jax.tree.map(jnp.add, grads, micro_grads)
        optimizer.update(model, jax.tree.map(lambda g: g / grad_accum, grads))
        return jax.tree.map(lambda total: total / grad_accum, totals)

    history = [jax.device_get(step(model, optimizer, batch)) for batch in batches]
    return (history, model, optimizer) if optimizer_too else (history, model)


def on_host(tree):
    """Every leaf as numpy; RNG keys as their raw bits."""
    def fetch(leaf):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(jax.device_get(leaf))

    return jax.tree.map(fetch, tree)


# Procedures of several parts (shardax.Part): each step is written once, against ``parts`` (a
# part by name, ``parts.update(name, grads)``), and runs in shardax and in plain NNX (PlainParts).

class Generator(nnx.Module):
    """A GAN generator in the DCGAN style, as an MLP: noise 4 -> 24, BatchNorm, ReLU, a square
    24 -> 24, ReLU, -> 8, tanh; ``sample(count)`` draws its own noise from a stream of its own,
    as generators' sampling methods do."""

    def __init__(self, rngs: nnx.Rngs):
        self.project = nnx.Linear(4, 24, use_bias=False, rngs=rngs)  # BatchNorm has the bias
        self.norm = nnx.BatchNorm(24, momentum=0.8, rngs=rngs)
        self.hidden = nnx.Linear(24, 24, rngs=rngs)
        self.out = nnx.Linear(24, 8, rngs=rngs)
        self.latent = nnx.Rngs(latent=rngs.params())

    def __call__(self, noise):
        h = nnx.relu(self.norm(self.project(noise)))
        return jnp.tanh(self.out(nnx.relu(self.hidden(h))))

    def sample(self, count):
        return self(jax.random.normal(self.latent.latent(), (count, 4)))


class Discriminator(nnx.Module):
    """8 -> 16, leaky ReLU, a residual MLP block 16 -> 32 -> 16 added to its input, -> one score."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)
        self.score = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, images):
        h = nnx.leaky_relu(self.embed(images), 0.2)
        h = h + self.down(nnx.leaky_relu(self.up(h), 0.2))
        return self.score(h)[:, 0]


def gan_step(parts, batch):
    """The non-saturating GAN: the discriminator's update, then the generator's against it."""
    generator, discriminator = parts["generator"], parts["discriminator"]
    fake = jax.lax.stop_gradient(generator(batch["noise"]))

    def discriminator_loss(d):
        return jnp.mean(jax.nn.softplus(-d(batch["image"]))) + jnp.mean(jax.nn.softplus(d(fake)))

    d_loss, grads = nnx.value_and_grad(discriminator_loss)(discriminator)
    parts.update("discriminator", grads)

    def generator_loss(g):
        return jnp.mean(jax.nn.softplus(-discriminator(g(batch["noise"]))))

    g_loss, grads = nnx.value_and_grad(generator_loss)(generator)
    parts.update("generator", grads)
    return {"d_loss": d_loss, "g_loss": g_loss}


def gan_eval(parts, batch):
    """How often the discriminator tells real from generated."""
    scores_real = parts["discriminator"](batch["image"])
    scores_fake = parts["discriminator"](parts["generator"](batch["noise"]))
    return {"d_accuracy": (jnp.mean(scores_real > 0) + jnp.mean(scores_fake < 0)) / 2}


def gan_batches(steps, batch_size=16, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield {"noise": rng.normal(size=(batch_size, 4)).astype(np.float32),
               "image": np.tanh(rng.normal(0.5, 0.6, size=(batch_size, 8))).astype(np.float32)}


class Teacher(nnx.Module):
    """A wider classifier 12 -> 48 -> 5 with Dropout (off while it teaches: a frozen part runs in eval
    mode)."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(12, 48, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(48, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.gelu(self.hidden(x))))


class Student(nnx.Module):
    """12 -> 10 (an odd width) -> 5."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(12, 10, rngs=rngs)
        self.out = nnx.Linear(10, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def distill_step(parts, batch, temperature=2.0, learner="student"):
    """Knowledge distillation: the student matches the frozen teacher's softened distribution
    (``learner="teacher"``: the other way round, the teacher trained)."""
    source = "teacher" if learner == "student" else "student"
    target = jax.nn.softmax(parts[source](batch["inputs"]) / temperature)

    def loss(model):
        return jnp.mean(optax.softmax_cross_entropy(model(batch["inputs"]) / temperature, target))

    value, grads = nnx.value_and_grad(loss)(parts[learner])
    parts.update(learner, grads)
    return {"loss": value}


def distill_eval(parts, batch):
    student, teacher = parts["student"](batch["inputs"]), parts["teacher"](batch["inputs"])
    return {"agreement": jnp.mean(student.argmax(-1) == teacher.argmax(-1))}


class PlainParts:
    """What a step of parts sees, in plain Flax NNX on one device: models by name, and
    ``update(name, grads)`` as each part's ``nnx.Optimizer`` (frozen parts in eval mode)."""

    def __init__(self, models, optimizers):
        self.models, self.optimizers = models, optimizers

    def __getitem__(self, name):
        return self.models[name]

    def update(self, name, grads):
        self.optimizers[name].update(self.models[name], grads)


def plain_parts_run(factories, optimizers, step_fn, batches, seeds):
    """Train parts with plain Flax NNX on one device: the reference a run of parts must match."""
    models = {name: factory(nnx.Rngs(seeds[name])) for name, factory in factories.items()}
    for name, model in models.items():
        model.train() if name in optimizers else model.eval()
    opts = {name: nnx.Optimizer(models[name], tx, wrt=nnx.Param) for name, tx in optimizers.items()}

    @nnx.jit
    def step(models, opts, batch):
        return step_fn(PlainParts(models, opts), batch)

    history = [jax.device_get(step(models, opts, batch)) for batch in batches]
    return history, models, opts
