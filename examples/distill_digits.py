"""Knowledge distillation on handwritten digits: a small student learns from a frozen teacher, on 8 devices.

First the teacher (64 -> 256 -> 10 with Dropout) trains alone, as any one model does. Then the
student (64 -> 24 -> 10) trains beside it in a run of two parts: the student with its optimizer,
the teacher frozen (no gradient, no optimizer state, eval mode: no Dropout), started from the
teacher's trained weights. The student's loss is the cross-entropy to the teacher's softened
distribution plus a little of the labels' (Hinton et al., 2015). Both parts are laid out by the
strategy; under ``tp`` their hidden layers are split as Megatron would, read off each part's
forward. The printed figures are held-out accuracies and how often the student agrees with the
teacher.

    python examples/distill_digits.py
    python examples/distill_digits.py --strategy tp
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from classify_digits import batches, load_digits

TEMPERATURE = 2.0


class MLP(nnx.Module):
    """Flattened 8x8 pixels -> ``hidden`` -> 10 logits, with Dropout."""

    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.reshape(images.shape[0], -1)
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def teacher(rngs: nnx.Rngs) -> MLP:
    return MLP(256, rngs)


def student(rngs: nnx.Rngs) -> MLP:
    return MLP(24, rngs)


def classification(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
    logits = model(batch["images"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["labels"])}


def distill_step(parts, batch: dict) -> dict:
    """One update of the student toward the frozen teacher's softened predictions."""
    target = jax.nn.softmax(parts["teacher"](batch["images"]) / TEMPERATURE)

    def loss(model: MLP) -> tuple[jax.Array, jax.Array]:
        logits = model(batch["images"])
        soft = optax.softmax_cross_entropy(logits / TEMPERATURE, target).mean() * TEMPERATURE**2
        hard = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return 0.9 * soft + 0.1 * hard, logits

    (value, logits), grads = nnx.value_and_grad(loss, has_aux=True)(parts["student"])
    parts.update("student", grads)
    return {"loss": value, "accuracy": jnp.mean(logits.argmax(-1) == batch["labels"])}


def distill_eval(parts, batch: dict) -> dict:
    student_logits, teacher_logits = parts["student"](batch["images"]), parts["teacher"](batch["images"])
    return {"accuracy": jnp.mean(student_logits.argmax(-1) == batch["labels"]),
            "agreement": jnp.mean(student_logits.argmax(-1) == teacher_logits.argmax(-1))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args(argv)

    import shardax
    from shardax import Part

    shardax.init_distributed(cpu_devices=int(os.environ.get("SHARDAX_DEVICES_PER_PROCESS", 8)))
    train, test = load_digits()
    example = next(iter(batches(train, args.batch_size, seed=0, repeat=False)))
    held_out = batches(test, 120, seed=None, repeat=False)
    teaching = shardax.Trainer(teacher, optax.adam(2e-3), classification, strategy=args.strategy,
                               example_batch=example, name="teacher")
    taught = teaching.fit(batches(train, args.batch_size, seed=1, repeat=True), steps=args.teacher_steps,
                          eval_data=held_out, log_every=args.log_every)
    parts = {"teacher": Part(teacher, init_from=teaching.model(), forward=lambda m, b: m(b["images"])),
             "student": Part(student, optax.adam(3e-3), forward=lambda m, b: m(b["images"]))}
    distilling = shardax.Trainer(parts=parts, step=distill_step, eval_fn=distill_eval, strategy=args.strategy,
                                 example_batch=example, name="distill")
    result = distilling.fit(batches(train, args.batch_size, seed=2, repeat=True), steps=args.steps,
                            eval_data=held_out, log_every=args.log_every)
    figures = {"teacher": taught.last_eval["accuracy"], "student": result.last_eval["accuracy"],
               "agreement": result.last_eval["agreement"]}
    if jax.process_index() == 0:
        print(f"held-out accuracy: teacher {figures['teacher']:.4f}, student {figures['student']:.4f} "
              f"(agrees with the teacher on {figures['agreement']:.4f} of {len(test)} images)")
    return figures


if __name__ == "__main__":
    main()
