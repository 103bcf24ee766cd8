"""A variational autoencoder of handwritten digits, trained with ZeRO-2 on 8 devices.

A generative model with an RNG stream of its own: every training step draws the
reparameterisation noise from the model's ``sample`` stream (an ``nnx.Rngs`` held by the
module), so the stream's counter is part of the state that checkpoints save and resume.
The data is scikit-learn's bundled digits; pixel intensities in [0, 1] are modelled as
Bernoulli probabilities. The printed figure is the held-out ELBO in nats per image (higher is
better), before training and after.

    python examples/vae_digits.py
    python examples/vae_digits.py --strategy fsdp
    python examples/vae_digits.py --strategy tp
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from classify_digits import batches, load_digits

LATENT = 8


class DigitsVAE(nnx.Module):
    """64 pixels -> (mean, log variance) of an 8-d latent -> 64 pixel logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.encode = nnx.Linear(64, 128, rngs=rngs)
        self.mean = nnx.Linear(128, LATENT, rngs=rngs)
        self.log_variance = nnx.Linear(128, LATENT, rngs=rngs)
        self.decode_hidden = nnx.Linear(LATENT, 128, rngs=rngs)
        self.decode = nnx.Linear(128, 64, rngs=rngs)
        self.rngs = nnx.Rngs(sample=rngs.params())  # the model's own stream for the noise

    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        pixels = images.reshape(images.shape[0], -1)  # (B, 64)
        hidden = nnx.relu(self.encode(pixels))
        mean, log_variance = self.mean(hidden), self.log_variance(hidden)
        noise = jax.random.normal(self.rngs.sample(), mean.shape)
        latent = mean + jnp.exp(0.5 * log_variance) * noise  # reparameterisation
        return self.decode(nnx.relu(self.decode_hidden(latent))), mean, log_variance


def negative_elbo(model: DigitsVAE, batch: dict) -> tuple[jax.Array, dict]:
    """-ELBO per image: Bernoulli reconstruction loss plus the KL divergence to N(0, I)."""
    logits, mean, log_variance = model(batch["images"])
    pixels = batch["images"].reshape(logits.shape)
    reconstruction = optax.sigmoid_binary_cross_entropy(logits, pixels).sum(-1)
    kl = 0.5 * (jnp.exp(log_variance) + mean**2 - 1.0 - log_variance).sum(-1)
    return jnp.mean(reconstruction + kl), {"reconstruction": reconstruction.mean(), "kl": kl.mean()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zero2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--metrics")
    args = parser.parse_args(argv)

    import shardax

    shardax.init_distributed(cpu_devices=int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", 8)))
    train, test = load_digits()
    held_out = batches(test, 120, seed=None, repeat=False)
    example = next(iter(held_out))  # under tp and fsdp_tp the weights are split as Megatron would, read off it
    trainer = shardax.Trainer(DigitsVAE, optax.adam(args.lr), negative_elbo, strategy=args.strategy, name="vae_digits",
                              example_batch=example)
    before = trainer.evaluate(held_out)
    result = trainer.fit(batches(train, args.batch_size, seed=1, repeat=True), steps=args.steps,
                         eval_data=held_out, eval_every=args.steps // 2, log_every=args.log_every,
                         metrics=args.metrics)
    after = result.last_eval
    if jax.process_index() == 0:
        print(f"held-out ELBO: {-before['loss']:.2f} nats/image before training, {-after['loss']:.2f} after "
              f"(reconstruction {after['reconstruction']:.2f}, KL {after['kl']:.2f})")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
