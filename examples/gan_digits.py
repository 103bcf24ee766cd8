"""A GAN of handwritten digits: two models, two optimizers, a moving average, on 8 devices.

The generator (noise -> 8x8 image, BatchNorm, its own ``noise`` RNG stream) and the
discriminator are two parts of one run, each with its own Adam; the step is the user's: the
discriminator's update, then the generator's against the updated discriminator (the
non-saturating loss of Goodfellow et al., 2014). The generator's optimizer keeps an exponential
moving average of its weights (``shardax.ema_params``), which the sample grids written during
the run (``--samples-dir``) and the final figures are drawn from. Both parts are laid out by the
strategy; under ``tp`` their hidden layers are split as Megatron would, read off each part's
forward.

The printed figure is a "digit score": an Inception score (Salimans et al., 2016) with a
logistic-regression digit classifier fitted on the real training images in place of Inception:
exp of the mean KL divergence between each sample's class distribution and the samples' mean
one. Near 1 for a collapsed generator; the real held-out images score about 7. Beside it, the
Fréchet distance between the samples' pixels and the held-out digits' (FID's formula on the
pixels themselves): 0 for the same distribution, about 0.1 for the training images.

    python examples/gan_digits.py
    python examples/gan_digits.py --strategy tp --samples-dir runs/gan/samples
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from classify_digits import batches, load_digits

NOISE = 16


class Generator(nnx.Module):
    """Noise -> 128, BatchNorm, ReLU -> 128, BatchNorm, ReLU -> 64 pixels in [-1, 1]."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(NOISE, 128, use_bias=False, rngs=rngs)
        self.norm1 = nnx.BatchNorm(128, rngs=rngs)
        self.hidden2 = nnx.Linear(128, 128, use_bias=False, rngs=rngs)
        self.norm2 = nnx.BatchNorm(128, rngs=rngs)
        self.pixels = nnx.Linear(128, 64, rngs=rngs)
        self.rngs = nnx.Rngs(noise=rngs.params())  # the generator's own stream, checkpointed with it

    def __call__(self, noise: jax.Array) -> jax.Array:
        x = nnx.relu(self.norm1(self.hidden1(noise)))
        x = nnx.relu(self.norm2(self.hidden2(x)))
        return jnp.tanh(self.pixels(x))

    def sample(self, count: int) -> jax.Array:
        return self(jax.random.normal(self.rngs.noise(), (count, NOISE)))


class Discriminator(nnx.Module):
    """64 pixels -> 128, leaky ReLU -> 128, leaky ReLU -> one logit (real or generated)."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(64, 128, rngs=rngs)
        self.hidden2 = nnx.Linear(128, 128, rngs=rngs)
        self.logit = nnx.Linear(128, 1, rngs=rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        x = nnx.leaky_relu(self.hidden1(pixels), 0.2)
        return self.logit(nnx.leaky_relu(self.hidden2(x), 0.2))[:, 0]


def real_pixels(batch: dict) -> jax.Array:
    images = batch["images"]
    return images.reshape(images.shape[0], -1) * 2 - 1  # [0, 1] -> [-1, 1], as the generator's tanh


def gan_step(parts, batch: dict) -> dict:
    generator, discriminator = parts["generator"], parts["discriminator"]
    real = real_pixels(batch)
    fake = jax.lax.stop_gradient(generator.sample(real.shape[0]))

    def discriminator_loss(d: Discriminator) -> jax.Array:
        return jnp.mean(jax.nn.softplus(-d(real))) + jnp.mean(jax.nn.softplus(d(fake)))

    d_loss, grads = nnx.value_and_grad(discriminator_loss)(discriminator)
    parts.update("discriminator", grads)

    def generator_loss(g: Generator) -> jax.Array:  # non-saturating: make the discriminator say "real"
        return jnp.mean(jax.nn.softplus(-discriminator(g.sample(real.shape[0]))))

    g_loss, grads = nnx.value_and_grad(generator_loss)(generator)
    parts.update("generator", grads)
    return {"d_loss": d_loss, "g_loss": g_loss}


def draw(models: dict, step: int) -> jax.Array:
    """36 digits from the generator's moving average, as 8x8 images in [0, 1]."""
    return (models["generator"].sample(36).reshape(36, 8, 8) + 1) / 2


def digit_classifier(train):
    """A logistic regression of the digits' classes fitted on the real training images (64 pixels in [0, 1])."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=2000).fit(train.images.reshape(len(train), -1), train.labels)


def frechet_distance(pixels: np.ndarray, real: np.ndarray) -> float:
    """The Fréchet distance between Gaussians fitted to two sets of images (64 pixels in [0, 1]):
    |mean difference|^2 + trace(C1 + C2 - 2 (C1 C2)^1/2), in the pixels themselves (FID's formula
    without Inception). 0 for the same distribution; noise and blurs score far."""
    from scipy.linalg import sqrtm

    means = pixels.mean(0) - real.mean(0)
    ours, theirs = np.cov(pixels, rowvar=False), np.cov(real, rowvar=False)
    root = sqrtm(ours @ theirs).real
    return float(means @ means + np.trace(ours + theirs - 2 * root))


def quality(classifier, train, test, before: np.ndarray, after: np.ndarray, what: str) -> dict:
    """Digit scores and Fréchet distances to the held-out digits of samples before and after
    training (500 each, 64 pixels in [0, 1]), with the real images' own figures; printed."""
    real = test.images.reshape(len(test), -1)
    figures = {"before": digit_score(classifier, before), "after": digit_score(classifier, after),
               "real": digit_score(classifier, real), "distance_before": frechet_distance(before, real),
               "distance_after": frechet_distance(after, real),
               "distance_real": frechet_distance(train.images.reshape(len(train), -1), real)}
    if jax.process_index() == 0:
        print(f"digit score: {figures['before']:.2f} before training, {figures['after']:.2f} after ({what}; real "
              f"held-out images {figures['real']:.2f})")
        print(f"Fréchet distance to the held-out digits: {figures['distance_before']:.2f} before training, "
              f"{figures['distance_after']:.2f} after (the training images: {figures['distance_real']:.2f})")
    return figures


def digit_score(classifier, pixels: np.ndarray) -> float:
    """exp(mean KL(p(class | image) || p(class))) of images as 64 pixels in [0, 1]."""
    probabilities = np.clip(classifier.predict_proba(pixels), 1e-12, 1.0)
    marginal = probabilities.mean(axis=0, keepdims=True)
    return float(np.exp(np.mean(np.sum(probabilities * (np.log(probabilities) - np.log(marginal)), axis=1))))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--samples-dir", default=None)
    parser.add_argument("--sample-every", type=int, default=500)
    args = parser.parse_args(argv)

    import shardax
    from shardax import Part

    shardax.init_distributed(cpu_devices=int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", 8)))
    train, test = load_digits()
    classifier = digit_classifier(train)
    adam = optax.adam(2e-4, b1=0.5)
    parts = {"generator": Part(Generator, optax.chain(adam, shardax.ema_params(0.99)),
                               forward=lambda g, b: g.sample(b["images"].shape[0])),
             "discriminator": Part(Discriminator, optax.adam(2e-4, b1=0.5), forward=lambda d, b: d(real_pixels(b)))}
    example = next(iter(batches(train, args.batch_size, seed=0, repeat=False)))
    trainer = shardax.Trainer(parts=parts, step=gan_step, strategy=args.strategy, example_batch=example,
                              name="gan_digits")

    def generated(ema: bool) -> np.ndarray:
        return (np.asarray(trainer.part("generator", ema=ema).sample(500)) + 1) / 2

    trainer.init()
    before = generated(ema=False)
    sampling = ({"samples": draw, "sample_every": args.sample_every, "samples_dir": args.samples_dir}
                if args.samples_dir else {})
    trainer.fit(batches(train, args.batch_size, seed=1, repeat=True), steps=args.steps, log_every=args.log_every,
                **sampling)
    figures = quality(classifier, train, test, before, generated(ema=True), "the generator's moving average")
    return figures


if __name__ == "__main__":
    main()
