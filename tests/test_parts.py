"""Runs of several named parts (``shardax.Part``) and a step the user wrote over them.

A GAN (two models, two optimizers, alternating updates, BatchNorm in the generator, a moving
average of the generator's weights) and a distillation (a student beside a frozen teacher that
has Dropout) train under each strategy exactly as the same step does in plain Flax NNX on one
device: the metrics of every step, every parameter's movement (SGD: a gradient off by any factor
shows), batch statistics, the moving average. Checkpoints hold every part, resume exactly and
restore with orbax alone; bad input is one line.
"""

import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from user_models import (
    Discriminator,
    Generator,
    Student,
    Teacher,
    distill_eval,
    distill_step,
    gan_batches,
    gan_eval,
    gan_step,
    on_host,
    plain_parts_run,
    vector_batches,
)

from shardax import Part, Trainer, ema_params, report
from shardax.errors import UsageError
from shardax.parts import part_seed

pytestmark = pytest.mark.xdist_group("test_parts")

STEPS = 4
STRATEGIES = [("dp", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2"),
              ("fsdp_tp", "data=4,model=2"), ("hsdp", "replica=2,data=4")]


def sgd():
    return optax.sgd(0.05, momentum=0.9)


def gan_parts():
    """The generator keeps a moving average of its weights, as GANs are sampled from. No part says
    how the step calls it: under tp its split is read off the step itself (the distillation's
    parts give ``forward``, read instead)."""
    return {"generator": Part(Generator, optax.chain(sgd(), ema_params(0.8))),
            "discriminator": Part(Discriminator, sgd())}


def distill_parts():
    return {"teacher": Part(Teacher, forward=lambda t, b: t(b["inputs"])),
            "student": Part(Student, sgd(), forward=lambda s, b: s(b["inputs"]))}


PROCEDURES = {
    "gan": (gan_parts, gan_step, gan_eval, gan_batches),
    "distillation": (distill_parts, distill_step, distill_eval, vector_batches),
}
_REFERENCE = {}


def reference(procedure):
    """Plain NNX on one device, each part built with the seed shardax gives it (from its name)."""
    if procedure not in _REFERENCE:
        make, step, _, batches = PROCEDURES[procedure]
        parts = make()
        _REFERENCE[procedure] = plain_parts_run(
            {name: part.model for name, part in parts.items()},
            {name: part.optimizer for name, part in parts.items() if part.optimizer is not None},
            step, batches(STEPS), seeds={name: part_seed(0, name) for name in parts})
    return _REFERENCE[procedure]


def by_path(tree):
    return {jax.tree_util.keystr(path).removesuffix(".value"): np.asarray(value)
            for path, value in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def unwrapped(tree):  # plain NNX's optimizer holds Variables (OptArray); their values
    return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, tree,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


@pytest.mark.parametrize("procedure", list(PROCEDURES))
@pytest.mark.parametrize("strategy, mesh_shape", STRATEGIES, ids=[s for s, _ in STRATEGIES])
@pytest.mark.slow
def test_a_procedure_of_parts_trains_like_plain_nnx_on_one_device(procedure, strategy, mesh_shape):
    make, step, evaluate, batches = PROCEDURES[procedure]
    expected, ref_models, ref_optimizers = reference(procedure)
    parts = make()
    trainer = Trainer(parts=parts, step=step, eval_fn=evaluate, strategy=strategy, mesh=mesh_shape,
                      example_batch=next(batches(1)))
    initial = {name: by_path(nnx.state(trainer.part(name, trainer.init()), nnx.Param)) for name in parts}
    result = trainer.fit(list(batches(STEPS)), steps=STEPS, log_every=1, summary=False)
    for name in expected[0]:
        np.testing.assert_allclose([r[name] for r in result.history], [e[name] for e in expected], rtol=1e-5,
                                   err_msg=name)
    state = result.state
    assert set(state.opt_state) == {name for name, part in parts.items() if part.optimizer is not None}
    for name, part in parts.items():
        model, ref = trainer.part(name), ref_models[name]
        params, ref_params = by_path(nnx.state(model, nnx.Param)), by_path(nnx.state(ref, nnx.Param))
        assert params.keys() == ref_params.keys()
        for path in params:
            moved, ref_moved = params[path] - initial[name][path], ref_params[path] - initial[name][path]
            if part.optimizer is None:  # frozen: exactly as it started
                np.testing.assert_array_equal(moved, 0, err_msg=f"{name}{path}")
                continue
            scale = float(np.abs(ref_moved).max())
            assert scale > 0, (name, path)
            # 1e-5 of the step, plus the float32 rounding of the parameters the step was added to
            rounding = 2 * float(np.spacing(np.abs(ref_params[path]).max()))
            np.testing.assert_allclose(moved, ref_moved, rtol=0, atol=1e-5 * scale + rounding,
                                       err_msg=f"{name}{path}")
        stats, ref_stats = by_path(nnx.state(model, nnx.BatchStat)), by_path(nnx.state(ref, nnx.BatchStat))
        for path in stats:
            np.testing.assert_allclose(stats[path], ref_stats[path], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}{path}")
    if procedure == "gan":  # the generator's moving average: one device's
        from shardax.step.ema import averaged

        ours = by_path(nnx.state(trainer.part("generator", ema=True), nnx.Param))
        theirs = by_path(averaged(unwrapped(ref_optimizers["generator"].opt_state),
                                  unwrapped(nnx.state(ref_models["generator"], nnx.Param))))
        for path in ours:
            moved, ref_moved = (ours[path] - initial["generator"][path],
                                theirs[path] - initial["generator"][path])
            np.testing.assert_allclose(moved, ref_moved, rtol=0, atol=1e-4 * float(np.abs(ref_moved).max()))
    assert jax.tree.map(lambda a: a.sharding, state) == trainer.parallel.state_shardings
    if strategy == "tp":  # Megatron's split of both parts' square, skip and odd weights
        assert report(trainer.parallel).fraction <= 0.75
    metrics = trainer.evaluate(list(batches(2)))
    assert set(metrics) == {"d_accuracy"} if procedure == "gan" else {"agreement"}


def policy_step(parts, batch):
    """A policy trained on next tokens, held near a frozen reference model (a KL term): DPO's and
    RL's pair of parts."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    reference = jax.nn.log_softmax(parts["reference"](inputs))

    def loss(policy):
        logits = jax.nn.log_softmax(policy(inputs))
        nll = -jax.numpy.take_along_axis(logits, targets[..., None], axis=-1).mean()
        return nll + 0.5 * (jax.numpy.exp(logits) * (logits - reference)).sum(-1).mean()

    value, grads = nnx.value_and_grad(loss)(parts["policy"])
    parts.update("policy", grads)
    return {"loss": value}


def language_models():
    from small_models import tiny_transformer_config

    from shardax.models.transformer import TransformerLM

    config = tiny_transformer_config()
    return {"policy": Part(lambda rngs: TransformerLM(config, rngs=rngs), sgd()),
            "reference": Part(lambda rngs: TransformerLM(config, rngs=rngs))}


@pytest.mark.parametrize("strategy, mesh_shape", [("pp_tp", "stage=2,data=2,model=2"),
                                                  ("fsdp", "data=2,context=4")])
def test_a_policy_beside_its_frozen_reference_trains_like_one_device_pipelined_or_split_by_context(
        strategy, mesh_shape):
    """Parts take every strategy a lone model takes: both language models staged over a pipeline
    (each stage holding its layers of both), or their sequences split over a context axis; the
    policy's every parameter moves as plain NNX on one device moves it (SGD)."""
    from small_models import token_batches

    parts = language_models()
    batches = list(token_batches(3))
    expected, ref_models, _ = plain_parts_run(
        {name: part.model for name, part in parts.items()}, {"policy": sgd()}, policy_step, batches,
        seeds={name: part_seed(0, name) for name in parts})
    trainer = Trainer(parts=parts, step=policy_step, strategy=strategy, mesh=mesh_shape)
    initial = by_path(nnx.state(trainer.part("policy", trainer.init()), nnx.Param))
    result = trainer.fit(batches, steps=3, log_every=1, summary=False)
    np.testing.assert_allclose([r["loss"] for r in result.history], [e["loss"] for e in expected], rtol=2e-5)
    ours, theirs = by_path(nnx.state(trainer.part("policy"), nnx.Param)), by_path(
        nnx.state(ref_models["policy"], nnx.Param))
    assert ours.keys() == theirs.keys()
    for path in ours:
        moved, ref_moved = ours[path] - initial[path], theirs[path] - initial[path]
        np.testing.assert_allclose(moved, ref_moved, rtol=0, atol=1e-4 * float(np.abs(ref_moved).max()),
                                   err_msg=path)
    if strategy == "pp_tp":  # each stage holds its own layer of each model
        kernel = result.state.params["reference"]["blocks"]["layers"]["mlp_in"]
        assert kernel.addressable_shards[0].data.shape[0] == 1
    else:
        assert trainer.context_attention == "all-gather"


def test_a_run_of_parts_resumes_exactly_and_restores_with_orbax_alone(tmp_path):
    batches = list(gan_batches(6))

    def gan(**options):
        return Trainer(parts=gan_parts(), step=gan_step, strategy="fsdp", **options)

    straight = gan().fit(batches, steps=6, log_every=1, summary=False)
    gan().fit(batches, steps=3, checkpoint_dir=tmp_path, summary=False)
    resumed = gan().fit(batches, steps=6, log_every=1, checkpoint_dir=tmp_path, resume=True, summary=False)
    assert resumed.start_step == 3
    assert [r["g_loss"] for r in resumed.history] == [r["g_loss"] for r in straight.history[3:]]
    jax.tree.map(np.testing.assert_array_equal, on_host(resumed.state), on_host(straight.state))
    # orbax alone: the generator's parameters and batch statistics from the tree keyed by part
    generator = nnx.eval_shape(lambda: Generator(nnx.Rngs(0)))
    params, rest = nnx.state(generator, nnx.Param, ...)
    target = {"params": {"generator": params}, "rest": {"generator": rest}}
    restored = ocp.PyTreeCheckpointer().restore(
        os.path.abspath(tmp_path / "6" / "state"),
        args=ocp.args.PyTreeRestore(item=target,
                                    restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                    partial_restore=True))
    nnx.update(generator, restored["params"]["generator"], restored["rest"]["generator"])
    trained = resumed.state.params["generator"]
    np.testing.assert_array_equal(generator.out.kernel[...], np.asarray(trained["out"]["kernel"][...]))


def _wrong_grads(parts, batch):
    grads = nnx.grad(lambda d: d(batch["image"]).mean())(parts["discriminator"])
    parts.update("generator", grads)
    parts.update("discriminator", grads)
    return {}


def _reshaped_grads(parts, batch):
    grads = nnx.grad(lambda d: d(batch["image"]).mean())(parts["discriminator"])
    parts.update("discriminator", jax.tree.map(lambda g: g.T if g.ndim == 2 else g, grads))
    return {}


def _bfloat16_grads(parts, batch):
    grads = nnx.grad(lambda d: d(batch["image"]).mean())(parts["discriminator"])
    parts.update("discriminator", jax.tree.map(lambda g: g.astype(jax.numpy.bfloat16), grads))
    return {}


def _never_updates_the_generator(parts, batch):
    grads = nnx.grad(lambda d: d(batch["image"]).mean())(parts["discriminator"])
    parts.update("discriminator", grads)
    return {"score": parts["discriminator"](batch["image"]).mean()}


def _updates_the_teacher(parts, batch):
    grads = nnx.grad(lambda t: t(batch["inputs"]).mean())(parts["teacher"])
    parts.update("teacher", grads)
    return {}


GAN_BATCH = next(gan_batches(1))


@pytest.mark.parametrize("call, message", [
    (lambda: Trainer(Generator, (sgd(), sgd()), lambda m, b: 0.0),
     "Trainer was given 2 optimizers; one model trains with one optax transformation: for several models"),
    (lambda: Trainer(parts=gan_parts(), step=gan_step, loss_fn=lambda m, b: 0.0),
     "Trainer(parts=...) was also given loss_fn;"),
    (lambda: Trainer(parts=gan_parts()), "Trainer(parts=...) needs step=your_step(parts, batch)"),
    (lambda: Trainer(parts={"generator": Generator}, step=gan_step),
     "part 'generator' is the class Generator, not a Part; wrap it: Part("),
    (lambda: Trainer(parts={"teacher": Part(Teacher)}, step=gan_step),
     "every part is frozen, so nothing would train"),
    (lambda: Trainer(parts=gan_parts(), step=gan_step, strategy="pp", mesh="data=4,stage=2"),
     "part 'generator': strategy 'pp' cuts a stack of layers into stages over 'stage', and this model has "
     "none"),
    (lambda: Trainer(parts=gan_parts(), step=gan_step, mesh="data=2,context=4"),
     "part 'generator': a 'context' mesh axis splits sequences for models that attend through "
     "shardax.blocks.Attention"),
    (lambda: Trainer(parts=gan_parts(), step=_wrong_grads, example_batch=GAN_BATCH),
     ("parts.update('generator', grads): grads hold 8 arrays that are not the gradients of part 'generator' "
      "(7 trained parameters)")),
    (lambda: Trainer(parts=gan_parts(), step=_reshaped_grads, example_batch=GAN_BATCH),
     "parts.update('discriminator', grads): the gradient of down/kernel is float32[16, 32] where the "
     "parameter is float32[32, 16]"),
    (lambda: Trainer(parts=gan_parts(), step=_bfloat16_grads, example_batch=GAN_BATCH),
     "parts.update('discriminator', grads): the gradient of down/bias is bfloat16[16] where the "
     "parameter is float32[16]; pass nnx.grad(loss)(parts['discriminator']) unchanged"),
    (lambda: Trainer(parts=gan_parts(), step=_never_updates_the_generator, example_batch=GAN_BATCH),
     "part 'generator' has an optimizer but the step never called parts.update('generator', grads)"),
    (lambda: Trainer(parts=distill_parts(), step=_updates_the_teacher, example_batch=next(vector_batches(1))),
     "parts.update('teacher', ...): part 'teacher' is frozen (no optimizer)"),
    (lambda: Trainer(parts=gan_parts(), step=lambda parts, batch: [1.0], example_batch=GAN_BATCH),
     "the step returned a list; return a dict of scalar metrics"),
    (lambda: Trainer(parts=gan_parts(), step=gan_step).fit([GAN_BATCH], steps=1, eval_data=[GAN_BATCH]),
     "this run of parts has no evaluation step; give Trainer(eval_fn="),
    (lambda: Trainer(parts=gan_parts(), step=gan_step).model(),
     "this trainer holds parts (generator, discriminator); take one with trainer.part('generator')"),
    (lambda: Trainer(parts=gan_parts(), step=gan_step).part("discriminator", ema=True),
     "part 'discriminator' keeps no moving average of its weights"),
])
def test_bad_input_to_a_run_of_parts_is_one_line(call, message):
    with pytest.raises(UsageError) as error:
        call()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_drawing_samples_never_changes_the_run_and_a_run_that_samples_resumes_exactly(tmp_path):
    """``draw`` calls the generator's own sampling method, which draws from its RNG stream: on a
    copy, so the run (its RNG streams, statistics, weights) is the run without samples, and a run
    that samples resumes exactly. Its grids go under the run directory."""
    batches = list(gan_batches(4))

    def draw(models, step):
        return {"fake": (models["generator"].sample(6).reshape(6, 2, 4) + 1) / 2}

    def gan():
        return Trainer(parts=gan_parts(), step=gan_step, strategy="fsdp")

    plain = gan().fit(batches, steps=4, summary=False)
    sampled = gan().fit(batches, steps=4, samples=draw, sample_every=1, run_dir=tmp_path / "a", summary=False)
    jax.tree.map(np.testing.assert_array_equal, on_host(sampled.state), on_host(plain.state))
    assert sorted(p.name for p in (tmp_path / "a" / "samples").iterdir()) == [
        f"fake_step_{step:06d}.png" for step in (1, 2, 3, 4)]
    gan().fit(batches, steps=2, samples=draw, sample_every=1, run_dir=tmp_path / "b", summary=False)
    resumed = gan().fit(batches, steps=4, samples=draw, sample_every=1, run_dir=tmp_path / "b", resume=True,
                        summary=False)
    assert resumed.start_step == 2
    jax.tree.map(np.testing.assert_array_equal, on_host(resumed.state), on_host(plain.state))


def test_a_module_given_as_init_from_stays_usable_and_unchanged():
    """The run's state is donated to every step; a teacher handed over as ``init_from`` (here one a
    first run trained, already laid out as this run lays it out) is copied into it, so the
    caller's module still computes, with the weights it had."""
    first = Trainer(parts={"teacher": Part(Teacher, sgd()), "student": Part(Student)},
                    step=lambda parts, batch: distill_step(parts, batch, learner="teacher"), strategy="dp")
    first.fit(list(vector_batches(2)), steps=2, summary=False)
    teacher = first.part("teacher")
    before = on_host(nnx.state(teacher))
    parts = {"teacher": Part(Teacher, init_from=teacher), "student": Part(Student, sgd())}
    trainer = Trainer(parts=parts, step=distill_step, strategy="dp")
    trainer.fit(list(vector_batches(3)), steps=3, summary=False)
    inputs = next(vector_batches(1))["inputs"]
    np.testing.assert_array_equal(np.asarray(teacher(inputs)), np.asarray(trainer.part("teacher")(inputs)))
    jax.tree.map(np.testing.assert_array_equal, on_host(nnx.state(teacher)), before)


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_an_update_with_a_non_finite_gradient_is_dropped(on_nonfinite):
    """A batch with a NaN image makes the discriminator's gradient NaN: its update is dropped (its
    parameters and optimizer state stay), counted in skipped_steps. Under "skip" the generator's
    update, whose gradient is finite, stands; under "stop" the whole step is dropped and fit
    stops naming it."""
    from shardax.errors import NonFiniteError

    trainer = Trainer(parts=gan_parts(), step=gan_step, strategy="fsdp")
    step = trainer.train_step(on_nonfinite)
    good, bad = list(gan_batches(2))
    bad["image"][3, 2] = np.nan
    first, _ = step(trainer.init(), trainer.place(good))
    before = on_host(first)
    second, metrics = step(first, trainer.place(bad))
    after = on_host(second)
    assert int(metrics["skipped_steps"]) == 1 and not np.isfinite(float(metrics["grad_norm/discriminator"]))
    jax.tree.map(np.testing.assert_array_equal, after.params["discriminator"], before.params["discriminator"])
    jax.tree.map(np.testing.assert_array_equal, after.opt_state["discriminator"],
                 before.opt_state["discriminator"])
    generator_moved = any((a != b).any() for a, b in zip(jax.tree.leaves(after.params["generator"]),
                                                         jax.tree.leaves(before.params["generator"])))
    assert generator_moved == (on_nonfinite == "skip")
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(after.params))
    if on_nonfinite == "stop":
        with pytest.raises(NonFiniteError, match="step 2: the loss or gradient norm is NaN or infinite"):
            Trainer(parts=gan_parts(), step=gan_step, strategy="fsdp").fit([good, bad, good], steps=3,
                                                                           summary=False)
