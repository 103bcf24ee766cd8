"""A diffusion model of handwritten digits (DDPM) with a moving average of its weights, on 8 devices.

A small U-Net in the style of the DDPM implementations people write: a sinusoidal timestep
embedding added into each residual block, GroupNorm, a downsampling convolution, self-attention
at the lowest resolution, upsampling, a skip concatenated across, and an output convolution.
Each training step noises the images to a random step of a 100-step linear schedule (both drawn
from the model's own RNG stream) and the model predicts the noise (Ho et al., 2020). The
optimizer keeps an exponential moving average of the weights (``shardax.ema_params``); samples
are drawn from it by ancestral sampling, as PNG grids during the run (``--samples-dir``) and for
the printed figures (see ``gan_digits.py``). The Fréchet distance to the held-out digits is the
one to read here: noise through an untrained U-Net already has a fair digit score.

    python examples/diffusion_digits.py
    python examples/diffusion_digits.py --strategy tp --samples-dir runs/diffusion/samples
"""

from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from classify_digits import batches, load_digits
from gan_digits import digit_classifier, quality

STEPS = 100
BETAS = np.linspace(1e-4, 0.05, STEPS, dtype=np.float32)
ALPHA_BARS = np.cumprod(1 - BETAS)


def timestep_embedding(t: jax.Array, width: int) -> jax.Array:
    half = width // 2
    frequencies = jnp.exp(-math.log(1000.0) * jnp.arange(half) / half)
    angles = t.astype(jnp.float32)[:, None] * frequencies[None]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResBlock(nnx.Module):
    """GroupNorm, SiLU, conv; plus the timestep; GroupNorm, SiLU, conv; added to the input."""

    def __init__(self, channels: int, time_width: int, rngs: nnx.Rngs):
        self.norm1 = nnx.GroupNorm(channels, num_groups=8, rngs=rngs)
        self.conv1 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
        self.time = nnx.Linear(time_width, channels, rngs=rngs)
        self.norm2 = nnx.GroupNorm(channels, num_groups=8, rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array, time: jax.Array) -> jax.Array:
        h = self.conv1(nnx.silu(self.norm1(x))) + self.time(time)[:, None, None, :]
        return x + self.conv2(nnx.silu(self.norm2(h)))


class UNet(nnx.Module):
    """(B, 8, 8, 1) noisy images and steps -> the noise: 8x8 at 32 channels, 4x4 at 64 with attention."""

    def __init__(self, rngs: nnx.Rngs):
        self.time1 = nnx.Linear(32, 64, rngs=rngs)
        self.time2 = nnx.Linear(64, 64, rngs=rngs)
        self.stem = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.down_block = ResBlock(32, 64, rngs)
        self.down = nnx.Conv(32, 64, (3, 3), strides=2, rngs=rngs)
        self.mid_block = ResBlock(64, 64, rngs)
        self.attention_norm = nnx.GroupNorm(64, num_groups=8, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=rngs)
        self.up = nnx.Conv(64 + 32, 32, (3, 3), rngs=rngs)
        self.up_block = ResBlock(32, 64, rngs)
        self.out_norm = nnx.GroupNorm(32, num_groups=8, rngs=rngs)
        self.out = nnx.Conv(32, 1, (3, 3), rngs=rngs)
        self.rngs = nnx.Rngs(diffusion=rngs.params())  # the training steps' own draws

    def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
        time = self.time2(nnx.silu(self.time1(timestep_embedding(t, 32))))
        skip = self.down_block(self.stem(x), time)  # (B, 8, 8, 32)
        h = self.mid_block(self.down(skip), time)  # (B, 4, 4, 64)
        b, height, width, c = h.shape
        tokens = self.attention_norm(h).reshape(b, height * width, c)
        h = h + self.attention(tokens).reshape(b, height, width, c)
        h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)  # (B, 8, 8, 64)
        h = self.up_block(self.up(jnp.concatenate([h, skip], axis=-1)), time)
        return self.out(nnx.silu(self.out_norm(h)))


def images_in_range(batch: dict) -> jax.Array:
    return batch["images"] * 2 - 1  # [0, 1] -> [-1, 1]


def noise_prediction_loss(model: UNet, batch: dict) -> jax.Array:
    x0 = images_in_range(batch)
    t = jax.random.randint(model.rngs.diffusion(), (x0.shape[0],), 0, STEPS)
    noise = jax.random.normal(model.rngs.diffusion(), x0.shape)
    alpha_bar = jnp.asarray(ALPHA_BARS)[t][:, None, None, None]
    noisy = jnp.sqrt(alpha_bar) * x0 + jnp.sqrt(1 - alpha_bar) * noise
    return jnp.mean((model(noisy, t) - noise) ** 2)


@nnx.jit(static_argnums=1)
def sample(model: UNet, count: int, key: jax.Array) -> jax.Array:
    """Ancestral sampling from pure noise through the 100 steps, as images in [0, 1]."""

    def denoise(i: int, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x, key = carry
        t = STEPS - 1 - i
        key, draw = jax.random.split(key)
        beta, alpha_bar = jnp.asarray(BETAS)[t], jnp.asarray(ALPHA_BARS)[t]
        predicted = model(x, jnp.full((count,), t))
        mean = (x - beta / jnp.sqrt(1 - alpha_bar) * predicted) / jnp.sqrt(1 - beta)
        return mean + jnp.where(t > 0, jnp.sqrt(beta), 0.0) * jax.random.normal(draw, x.shape), key

    x = jax.random.normal(key, (count, 8, 8, 1))
    x, _ = jax.lax.fori_loop(0, STEPS, denoise, (x, key))
    return (jnp.clip(x, -1, 1)[..., 0] + 1) / 2


def draw(model: UNet, step: int) -> jax.Array:
    """36 digits from the moving average of the weights (the same starting noise every time)."""
    return sample(model, 36, jax.random.key(0))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--samples-dir", default=None)
    parser.add_argument("--sample-every", type=int, default=500)
    args = parser.parse_args(argv)

    import shardax

    shardax.init_distributed(cpu_devices=int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", 8)))
    train, test = load_digits()
    classifier = digit_classifier(train)
    example = next(iter(batches(train, args.batch_size, seed=0, repeat=False)))
    optimizer = optax.chain(optax.adamw(args.lr), shardax.ema_params(0.995))
    trainer = shardax.Trainer(UNet, optimizer, noise_prediction_loss, strategy=args.strategy,
                              example_batch=example, name="diffusion_digits")
    before = np.asarray(sample(trainer.model(trainer.init()), 500, jax.random.key(1))).reshape(500, -1)
    sampling = ({"samples": draw, "sample_every": args.sample_every, "samples_dir": args.samples_dir}
                if args.samples_dir else {})
    trainer.fit(batches(train, args.batch_size, seed=1, repeat=True), steps=args.steps, log_every=args.log_every,
                **sampling)
    after = np.asarray(sample(trainer.model(ema=True), 500, jax.random.key(1))).reshape(500, -1)
    figures = quality(classifier, train, test, before, after, "the moving average's samples")
    return figures


if __name__ == "__main__":
    main()
