"""A CNN with BatchNorm and Dropout classifies handwritten digits, trained with FSDP on 8 devices.

The data is scikit-learn's bundled digits (1,797 real 8x8 images; nothing is downloaded), fed by
a Grain dataset whose iterator position is saved in every checkpoint, so ``--resume`` continues
with exactly the next batch. The model is plain Flax NNX: no sharding annotations anywhere.

    python examples/classify_digits.py                               # 8 simulated CPU devices
    python examples/classify_digits.py --checkpoint-dir runs/digits --resume
    shardax launch -n 2 -- python examples/classify_digits.py        # 2 processes x 4 devices
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

HELD_OUT = 360  # 20% of the images, a multiple of 8 devices


class DigitsCNN(nnx.Module):
    """(B, 8, 8, 1) images -> 10 logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), use_bias=False, rngs=rngs)
        self.norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), strides=2, use_bias=False, rngs=rngs)  # -> 4x4
        self.norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 64, 10, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = nnx.relu(self.norm1(self.conv1(images)))
        x = nnx.relu(self.norm2(self.conv2(x)))
        return self.head(self.dropout(x.reshape(x.shape[0], -1)))


def loss_fn(model: DigitsCNN, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["images"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["labels"])}


class DigitImages:
    """A Grain random-access source over numpy arrays (its repr is part of Grain's saved state)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, name: str):
        self.images, self.labels, self.name = images, labels, name

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"images": self.images[index], "labels": self.labels[index]}

    def __repr__(self) -> str:
        return f"DigitImages({self.name}, {len(self)})"


def load_digits() -> tuple[DigitImages, DigitImages]:
    from sklearn.datasets import load_digits as bundled

    digits = bundled()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    return DigitImages(images[train], labels[train], "train"), DigitImages(images[test], labels[test], "test")


def batches(source: DigitImages, batch_size: int, *, seed: int | None, repeat: bool):
    """This process's rows of every global batch: Grain shards by process before batching."""
    import grain

    dataset = grain.MapDataset.source(source)
    if seed is not None:
        dataset = dataset.shuffle(seed=seed)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset[jax.process_index()::jax.process_count()]
    return dataset.batch(batch_size // jax.process_count(), drop_remainder=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--mesh", default=None, help="e.g. data=8 (default: every device on data)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--metrics")
    args = parser.parse_args(argv)

    import shardax

    shardax.init_distributed(cpu_devices=int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", 8)))
    train, test = load_digits()
    schedule = optax.cosine_decay_schedule(args.lr, args.steps)
    trainer = shardax.Trainer(DigitsCNN, optax.adamw(schedule), loss_fn, strategy=args.strategy, mesh=args.mesh,
                              learning_rate=schedule, name="classify_digits")
    result = trainer.fit(
        batches(train, args.batch_size, seed=1, repeat=True), steps=args.steps,
        eval_data=batches(test, 120, seed=None, repeat=False), eval_every=args.eval_every,
        log_every=args.log_every, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, metrics=args.metrics,
    )
    if jax.process_index() == 0:
        print(f"held-out accuracy: {result.last_eval['accuracy']:.4f} on {len(test)} images")
    return result.last_eval


if __name__ == "__main__":
    main()
