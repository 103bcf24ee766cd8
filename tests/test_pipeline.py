"""Pipeline parallelism: stages over a ``stage`` mesh axis train exactly like one device, hold
1/S of the layers each, run R*M + S - 1 iterations and send what theory says between stages."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from small_models import (
    assert_trained_like,
    assert_trees_close,
    tiny_transformer_config,
    token_batches,
    train_transformer,
)

from shardax import DeviceMeshManager, parallelize, reshard
from shardax.analysis.collectives import find_collectives
from shardax.analysis.traffic import wire_bytes
from shardax.errors import UsageError
from shardax.models.transformer import TransformerLM, next_token_loss
from shardax.runtime.pipeline import Schedule

pytestmark = pytest.mark.xdist_group("test_pipeline")

STEPS = 20
BATCH = 32
LR = 3e-3
CONFIG = tiny_transformer_config(n_layers=8)


def factory(rngs):
    return TransformerLM(CONFIG, rngs=rngs)


def train(strategy, mesh_shape, devices=None, **schedule):
    mesh = DeviceMeshManager(devices=devices).create_device_mesh(mesh_shape)
    return train_transformer(CONFIG, mesh, strategy, steps=STEPS, batch_size=BATCH, lr=LR, **schedule)


_REFERENCE = {}


def reference():
    if not _REFERENCE:
        _REFERENCE["one device"] = train("dp", "data=1", devices=jax.devices()[:1])
    return _REFERENCE["one device"]


CASES = [("pp", "stage=8", m, 1) for m in (8, 16, 32)] + \
        [("pp", "stage=4,data=2", m, 1) for m in (4, 8, 16)] + \
        [("pp_tp", "stage=2,data=2,model=2", m, 1) for m in (2, 4, 8)] + \
        [("pp_fsdp", "stage=4,data=2", 4, 1), ("pp", "stage=4,data=2", 8, 2),
         ("pp_fsdp", "stage=2,data=4", 4, 2)]


@pytest.mark.parametrize("strategy, mesh_shape, microbatches, repeats", CASES,
                         ids=[f"{s}-{m}-M{mb}-R{r}" for s, m, mb, r in CASES])
# the fast tier's strategy families (tests/test_experts.py) compare pp and pp_tp with one device
@pytest.mark.slow
def test_pipeline_trains_like_one_device(strategy, mesh_shape, microbatches, repeats):
    ref_losses, ref_state, _ = reference()
    losses, state, parallel = train(strategy, mesh_shape, microbatches=microbatches, pipeline_repeats=repeats)
    # every parameter tensor within 1e-5 relative (measured: at most 3.4e-6); element by element
    # dp on data=8 ends up to 1.2e-5 off one device on this 8-layer model, the pipelines up to
    # 6e-5 (weights are ~0.1-0.5): every one within 1e-4, 99% within 1e-5 relative
    assert_trained_like(losses, state, (ref_losses, ref_state), parallel)
    assert_trees_close(jax.device_get(state.opt_state), jax.device_get(ref_state.opt_state), rtol=1e-4,
                       atol=2e-6)


def stacked(tree):
    """The leaves of the layer stack (leading dimension: the 8 layers)."""
    return [leaf for leaf in jax.tree.leaves(tree) if leaf.ndim >= 2 and leaf.shape[0] == CONFIG.n_layers]


@pytest.mark.parametrize("strategy, mesh_shape, stages", [("pp", "stage=8", 8), ("pp", "stage=4,data=2", 4),
                                                          ("pp_fsdp", "stage=4,data=2", 4),
                                                          ("pp_tp", "stage=2,data=2,model=2", 2)])
def test_each_device_holds_its_stage_of_the_layers(strategy, mesh_shape, stages):
    """Stage s holds layers s*L/S .. (s+1)*L/S - 1 of every stacked parameter and of its Adam
    moments, and nothing else of the stack."""
    parallel = parallelize(factory, optax.adamw(LR), DeviceMeshManager().create_device_mesh(mesh_shape),
                           strategy)
    state = parallel.init(seed=0)
    whole = jax.device_get(state.params)
    for leaf, host in zip(stacked(state.params), stacked(whole)):
        for shard in leaf.addressable_shards:
            assert shard.data.shape[0] == CONFIG.n_layers // stages
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(host)[shard.index])
        per_device = (sum(shard.data.nbytes for shard in leaf.addressable_shards)
                      / len(leaf.addressable_shards))
        split = np.prod([parallel.mesh.shape[a] for e in leaf.sharding.spec if e
                         for a in ((e,) if isinstance(e, str) else e)])
        assert per_device == leaf.nbytes / split and split % stages == 0
    for leaf in stacked(state.opt_state):
        assert {shard.data.shape[0] for shard in leaf.addressable_shards} == {CONFIG.n_layers // stages}


def compiled_step(strategy, mesh_shape, microbatches, repeats):
    parallel = parallelize(factory, optax.adamw(LR), DeviceMeshManager().create_device_mesh(mesh_shape),
                           strategy, microbatches=microbatches, pipeline_repeats=repeats)
    batch = {"tokens": jax.ShapeDtypeStruct((BATCH, CONFIG.seq_len + 1), jnp.int32,
                                            sharding=parallel.layout.batch())}
    step = parallel.train_step(next_token_loss)
    return parallel, step.lower(parallel.abstract_state, batch).compile()


@pytest.mark.parametrize("mesh_shape, stages, microbatches, repeats", [
    ("stage=4,data=2", 4, 4, 1), ("stage=4,data=2", 4, 8, 1), ("stage=4,data=2", 4, 16, 1),
    ("stage=2,data=4", 2, 4, 2), ("stage=8", 8, 8, 1)])
def test_the_compiled_step_runs_r_m_plus_s_minus_1_stage_iterations(mesh_shape, stages, microbatches,
                                                                    repeats):
    """The bubble is (S-1)/(R*M+S-1): the compiled loops (forward and backward) run exactly
    R*M + S - 1 iterations, and each device sends one microbatch's activations to the next
    stage per iteration each way (plus one roll that hands the last outputs back)."""
    schedule = Schedule(stages, microbatches, repeats)
    parallel, compiled = compiled_step("pp", mesh_shape, microbatches, repeats)
    text = compiled.as_text()
    trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', text)]
    assert trips.count(repeats * microbatches + stages - 1) == 2, trips  # the forward and the backward loop
    assert schedule.bubble == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))
    groups = parallel.mesh.shape.get("data", 1)
    slot = BATCH // groups // microbatches * CONFIG.seq_len * CONFIG.d_model * 4  # one microbatch, one device
    devices = parallel.mesh.devices.size
    in_loop = [c for c in find_collectives(text) if c.kind == "collective-permute" and c.executions > 1]
    sent = sum(wire_bytes(c, devices) * c.executions for c in in_loop)
    assert sent == 2 * schedule.iterations * slot, [(c.bytes, c.executions, c.replica_groups)
                                                    for c in in_loop]
    # nothing else crosses between devices inside the loops: no per-iteration gradient reduction
    assert not [c for c in find_collectives(text) if c.executions > 1 and c.kind != "collective-permute"]


@pytest.mark.slow
def test_a_circular_schedule_keeps_no_copy_of_its_weights_per_stage_iteration():
    """Each pass picks its chunk of the stage's layers; the backward pass picks it again rather
    than keeping R*M + S - 1 copies of it (the MLP weights, 32 x 64 here, would show as buffers
    with one entry per iteration)."""
    schedule = Schedule(2, 4, 2)
    _, compiled = compiled_step("pp", "stage=2,data=4", schedule.microbatches, schedule.repeats)
    per_iteration = re.findall(rf"f32\[{schedule.iterations},[\d,]*\b(?:32,64|64,32)\]", compiled.as_text())
    assert not per_iteration
    # the activations are kept per iteration, as they must be
    assert re.search(rf"f32\[{schedule.iterations},[\d,]*\]", compiled.as_text())


@pytest.mark.parametrize("remat, below", [("full", 0.5), ("dots_saveable", 0.95)])
@pytest.mark.slow
def test_a_circular_schedule_keeps_what_the_remat_policy_says(remat, below):
    """With R > 1 each stage iteration runs under a checkpoint of its own (so that it picks its
    chunk again rather than keep it); that checkpoint follows the model's remat policy, so
    ``--remat full`` or ``dots_saveable`` keeps less per iteration than ``none``, as with R = 1.
    (Once it saved everything whatever the policy: the temporaries were the same for all three.)"""
    def temporaries(policy, repeats):
        model = tiny_transformer_config(n_layers=8, d_model=64, seq_len=32, remat=policy)
        parallel = parallelize(lambda rngs: TransformerLM(model, rngs=rngs), optax.adamw(LR),
                               DeviceMeshManager().create_device_mesh("stage=2,data=4"), "pp",
                               microbatches=4, pipeline_repeats=repeats)
        batch = {"tokens": jax.ShapeDtypeStruct((BATCH, model.seq_len + 1), jnp.int32,
                                                sharding=parallel.layout.batch())}
        step = parallel.train_step(next_token_loss)
        return step.lower(parallel.abstract_state, batch).compile().memory_analysis().temp_size_in_bytes

    kept, recomputed, one_pass = temporaries("none", 2), temporaries(remat, 2), temporaries(remat, 1)
    assert recomputed < below * kept, (recomputed, kept)
    assert recomputed < 1.25 * one_pass, (recomputed, one_pass)


@pytest.mark.slow
def test_a_pipeline_checkpoint_reshards_into_fsdp_and_back_exactly():
    losses, state, parallel = train("pp", "stage=4,data=2", microbatches=8)
    fsdp = parallelize(factory, optax.adamw(LR), DeviceMeshManager().create_device_mesh("data=8"), "fsdp")
    moved = reshard(state, fsdp)
    assert jax.tree.map(lambda a: a.sharding, moved) == fsdp.state_shardings
    back = reshard(moved, parallel)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), jax.device_get(state))
    # and the fsdp copy trains on exactly as the pipeline would
    batch = next(token_batches(1, batch_size=BATCH, seed=5))
    _, pipelined = parallel.with_settings(microbatches=8).train_step(
        next_token_loss, donate=False)(state, parallel.place_batch(batch))
    _, sharded = fsdp.train_step(next_token_loss, donate=False)(moved, fsdp.place_batch(batch))
    np.testing.assert_allclose(float(pipelined["loss"]), float(sharded["loss"]), rtol=1e-6)


def test_layers_that_do_not_split_into_stages_are_refused_with_the_nearest_counts():
    parallel = parallelize(lambda rngs: TransformerLM(tiny_transformer_config(n_layers=6), rngs=rngs),
                           optax.adamw(LR), DeviceMeshManager().create_device_mesh("stage=4,data=2"), "pp")
    with pytest.raises(UsageError,
                       match=r"^6 layers do not split into 4 stages; use 4 or 8 layers, or a stage count "
                             r"that divides 6$"):
        parallel.train_step(next_token_loss)
    with pytest.raises(UsageError, match=r"`pipeline_repeats=2` needs microbatches of at least the 4 stages"):
        Schedule(4, 2, 2)


def test_a_model_without_stacked_layers_is_refused_under_a_pipeline():
    from small_models import AnnotatedMLP

    # Refused when the layout is read, before any state is built or a step is compiled.
    with pytest.raises(UsageError,
                       match="cuts a stack of layers into stages over 'stage', and this model has none"):
        parallelize(lambda rngs: AnnotatedMLP(rngs), optax.adamw(LR),
                    DeviceMeshManager().create_device_mesh("stage=2,data=4"), "pp")
    with pytest.raises(UsageError,
                       match="`microbatches`/`pipeline_repeats` are for pipeline strategies; .fsdp. is not"):
        parallelize(lambda rngs: AnnotatedMLP(rngs), optax.adamw(LR),
                    DeviceMeshManager().create_device_mesh("data=8"), "fsdp", microbatches=4)


# Circular schedules regroup each stage's layers (and their gradients) every step. With S = R
# that is one all-to-all, as little as must move; with S = 4, R = 2 XLA writes it as an
# all-to-all within pairs of stages and then a permute of the whole stage, 1.33x the least, so
# the step sends 1.09x theory.
PLANS = [("pp", "stage=4,data=2", 8, 1, 0.05), ("pp", "stage=8", 8, 1, 0.05),
         ("pp_fsdp", "stage=4,data=2", 8, 1, 0.05),
         ("pp_tp", "stage=2,data=2,model=2", 4, 1, 0.05), ("pp", "stage=2,data=4", 4, 2, 0.05),
         ("pp_fsdp", "stage=2,data=4", 4, 2, 0.05), ("pp", "stage=4,data=2", 8, 2, 0.10)]


@pytest.mark.parametrize("strategy, mesh_shape, microbatches, repeats, within", PLANS,
                         ids=[f"{s}-{m}-M{mb}-R{r}" for s, m, mb, r, _ in PLANS])
@pytest.mark.slow
def test_plan_counts_what_a_pipeline_sends_and_flags_a_large_bubble(strategy, mesh_shape, microbatches,
                                                                    repeats,
                                                                      within):
    """``shardax plan`` compiles the pipeline: state exact, communication within 5% of theory
    (the shift, the hand-out and hand-in of microbatches, the data-parallel gradient sums, a
    circular schedule's regroup of the stages' layers), the bubble reported, and a bubble over
    25% named in the lint with the microbatches that fix it."""
    from shardax.analysis.plan import plan_strategy

    plan = plan_strategy(CONFIG, strategy, mesh_shape, batch_size=BATCH, microbatches=microbatches,
                         pipeline_repeats=repeats)
    stages = int(re.search(r"stage=(\d+)", mesh_shape).group(1))
    assert plan.bubble == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))
    assert plan.predicted["state"] == plan.compiled["arguments"]
    # the memory estimate (XLA:CPU) stays in its band: 0.94 to 1.03 of the compiled peak here
    # (0.87 to 1.03 before it counted the copy of one iteration's residuals that nested scans make)
    assert 0.92 <= plan.predicted["total"] / plan.compiled["peak"] <= 1.05, (plan.predicted, plan.compiled)
    assert plan.collective_bytes == pytest.approx(plan.theoretical_collective_bytes,
                                                  rel=within), plan.collectives
    bubbles = [note for note in plan.lint if note.startswith("pipeline bubble")]
    if plan.bubble > 0.25:
        enough = next(m for m in range(stages, 100, stages) if (stages - 1) / (m + stages - 1) <= 0.25)
        assert len(bubbles) == 1 and f"--microbatches {enough} brings it to" in bubbles[0]
    else:
        assert not bubbles


def test_a_circular_schedule_regroups_what_a_stage_does_not_hold():
    """Stage s holds chunks s*R .. s*R + R - 1 and runs chunks s, S + s, ...: what it lacks."""
    from shardax.analysis.theory import circular_regroup_share

    assert circular_regroup_share(Schedule(2, 4, 2)) == 0.5  # holds 0,1 / 2,3; runs 0,2 / 1,3
    assert circular_regroup_share(Schedule(4, 8, 2)) == 0.75  # stages 0 and 3 keep one chunk each
    assert circular_regroup_share(Schedule(4, 8, 4)) == 0.75  # a transpose: each keeps its diagonal chunk
    assert circular_regroup_share(Schedule(4, 8, 1)) == 0.0


@pytest.mark.slow
def test_shardax_train_runs_a_pipeline_and_resumes_it_exactly(small_corpus, tmp_path):
    from cli_helpers import QUICK, read_metrics, shardax

    from shardax.trainer.checkpoint import saved_arrays

    common = ["train", *QUICK, "--batch-size", 32, "--data", small_corpus, "--log-every", 1, "--eval-every",
              2, "--sample-bytes", 0]
    run = [*common, "--strategy", "pp", "--mesh", "stage=4,data=2", "--microbatches", 8]
    straight = shardax(*run, "--steps", 4, "--checkpoint-dir", tmp_path / "a", "--metrics",
                       tmp_path / "a.jsonl")
    assert ("pipeline: 4 stages x 8 microbatches: 11 stage iterations per step, bubble 27.3%"
            in straight.stdout)
    shardax(*run, "--steps", 4, "--checkpoint-every", 2, "--checkpoint-dir", tmp_path / "b",
            "--metrics", tmp_path / "b.jsonl")
    # resume the second run from step 2 (its last checkpoint is removed): it ends as the first
    import shutil
    shutil.rmtree(tmp_path / "b" / "4")
    resumed = shardax(*run, "--checkpoint-dir", tmp_path / "b", "--metrics", tmp_path / "b.jsonl", "--resume")
    assert "resumed from step 2" in resumed.stdout and "changed since" not in resumed.stdout
    losses = [r["loss"] for r in read_metrics(tmp_path / "a.jsonl") if r.get("loss") is not None]
    again = [r["loss"] for r in read_metrics(tmp_path / "b.jsonl") if r.get("loss") is not None]
    assert again[-2:] == losses[-2:] and all(np.isfinite(losses)) and losses[-1] < losses[0]
    expected, got = saved_arrays(tmp_path / "a", 4), saved_arrays(tmp_path / "b", 4)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    # the pipeline's checkpoint goes on under fsdp (a strategy may change on resume)
    onward = shardax(*common, "--strategy", "fsdp", "--checkpoint-dir", tmp_path / "a", "--resume",
                     "--extend-to", 5, "--precision", "bfloat16")
    assert "resumed from step 4" in onward.stdout and "strategy fsdp" in onward.stdout
    assert ("changed since the checkpoint was saved: strategy pp -> fsdp; mesh stage=4,data=2 -> data=8; "
            "precision float32 -> bfloat16\n") in onward.stdout
