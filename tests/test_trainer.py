"""``shardax.Trainer``: any NNX model, any data source; metrics, evaluation, checkpoints, exact resume."""

import json
import struct

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from user_models import ConvNet, DropoutMLP, classification_loss, image_batches, on_host, vector_batches

import shardax
from shardax import Trainer, ema_params
from shardax.errors import UsageError
from shardax.trainer.checkpoint import saved_arrays, saved_steps
from shardax.trainer.lock import LOCK_NAME

pytestmark = pytest.mark.xdist_group("test_trainer")


def trainer(strategy="fsdp", model=DropoutMLP, **options):
    """A Trainer whose optimizer keeps a moving average of the weights (resumed with the rest)."""
    return Trainer(model, optax.chain(optax.adamw(1e-2), ema_params(0.9)), classification_loss,
                   strategy=strategy, **options)


def tensorboard_scalars(directory):
    """``{(tag, step): value}`` from the event files in ``directory`` (TFRecord framing, Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in directory.glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = (("image", value.image.height, value.image.width)
                                                    if value.HasField("image") else value.simple_value)
    return scalars


def mlflow_metrics(directory):
    """``{(tag, step): value}`` of the one run in the MLflow file store at ``directory``, read by MLflow's
    client."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=directory.resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("shardax").experiment_id])
    assert run.info.status == "FINISHED"
    return {(tag, m.step): m.value for tag in run.data.metrics
            for m in client.get_metric_history(run.info.run_id, tag)}


def wandb_history(directory):
    """``{(tag, step): value}`` from the offline W&B run under ``directory``: its transaction log
    (LevelDB-style framing: 7-byte header, 32 KiB blocks, records of crc, length, type) holds
    ``wandb.proto`` Records, the history rows among them."""
    from wandb.proto import wandb_internal_pb2

    [path] = directory.glob("wandb/offline-run-*/run-*.wandb")
    data, rows, pending = path.read_bytes(), {}, b""
    for block_start in range(7, len(data), 32768):
        block, offset = data[block_start:block_start + 32768], 0
        while offset + 7 <= len(block):
            length, kind = struct.unpack("<HB", block[offset + 4:offset + 7])
            if kind == 0:
                break
            pending += block[offset + 7:offset + 7 + length]
            offset += 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record.FromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    items = {item.nested_key and "/".join(item.nested_key) or item.key:
                             json.loads(item.value_json) for item in record.history.item}
                    rows.update({(tag, items["_step"]): value for tag, value in items.items() if "/" in tag})
    return rows


def test_fit_logs_evaluates_and_writes_metrics_curves_and_events(tmp_path, capsys):
    batches, held_out = list(vector_batches(6)), list(vector_batches(2, seed=9))
    logged, drawn = [], {}
    trackers = [f"mlflow:{tmp_path / 'mlflow'}", f"wandb:{tmp_path / 'wandb'}"]

    def draw(model, step):  # six 5x8 "images": the hidden layer's activations of six inputs
        drawn[step] = (model, jax.device_get(nnx.state(model, nnx.Param)))
        return jax.nn.sigmoid(model.hidden(held_out[0]["inputs"][:6, model.pairs])).reshape(6, 5, 8)

    fitting = trainer(trackers=trackers)
    run = fitting.fit(batches, steps=6, eval_data=held_out, eval_every=3, log_every=2,
                      metrics=tmp_path / "m.jsonl", tensorboard=tmp_path / "tb", on_log=logged.append,
                      samples=draw, sample_every=3, run_dir=tmp_path, eval_ema=True)  # samples under run_dir
    from cli_helpers import read_metrics

    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 6] and records == logged == run.history
    for record in records:
        if "loss" in record:
            assert {"loss", "accuracy", "grad_norm", "step_time_s", "examples_per_sec"} <= set(record)
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert run.last_eval == {"loss": records[-1]["val_loss"], "accuracy": records[-1]["val_accuracy"]}
    # the average's
    assert run.last_eval == fitting.evaluate(held_out, ema=True) != fitting.evaluate(held_out)
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    # every tracker holds every record, read back by its own client (TensorBoard: its protos)
    for logged_by in (tensorboard_scalars(tmp_path / "tb"), mlflow_metrics(tmp_path / "mlflow"),
                      wandb_history(tmp_path / "wandb")):
        assert logged_by[("train/loss", 6)] == pytest.approx(records[-1]["loss"], rel=1e-6)
        assert logged_by[("eval/accuracy", 3)] == pytest.approx(records[2]["val_accuracy"], rel=1e-6)
        assert {step for tag, step in logged_by if tag == "train/loss"} == {1, 2, 4, 6}
    out = capsys.readouterr().out
    assert "strategy fsdp" in out and "eval step 3: validation loss" in out and "summary" in out
    assert (run.start_step, run.end_step) == (0, 6) and run.examples_per_sec > 0
    # samples: drawn from the moving average of the weights in eval mode, written as 2x3 grids of 5x8
    assert sorted(drawn) == [3, 6] and drawn[6][0].dropout.deterministic
    averaged = jax.device_get(nnx.state(fitting.model(ema=True), nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(drawn[6][1]), jax.tree.leaves(averaged))
    from PIL import Image

    for step in (3, 6):
        with Image.open(tmp_path / "samples" / f"samples_step_{step:06d}.png") as image:
            assert image.mode == "L" and image.size == (3 * 9 + 1, 2 * 6 + 1)  # grey, as drawn
        assert f"samples_step_{step:06d}.png" in out
    assert tensorboard_scalars(tmp_path / "tb")[("samples/samples", 6)] == ("image", 13, 28)
    images = wandb_history(tmp_path / "wandb")
    assert images[("samples/samples/_type", 3)] == "image-file" and images[("samples/samples/width", 6)] == 28
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlflow").resolve().as_uri())
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("shardax").experiment_id])
    assert [a.path for a in client.list_artifacts(mlflow_run.info.run_id)] == ["images"]


@pytest.mark.slow
def test_fit_takes_exactly_the_steps_of_the_compiled_step_by_hand():
    """The Trainer adds nothing to the arithmetic: the same losses, bit for bit, as calling the step
    (its settings given as one ``FitSettings``, the Trainer's as one ``TrainerSettings``)."""
    batches = list(image_batches(4))
    by_trainer = Trainer(ConvNet, optax.chain(optax.adamw(1e-2), ema_params(0.9)), classification_loss,
                         settings=shardax.TrainerSettings(strategy="zero2", grad_accum=2))
    assert (by_trainer.settings.grad_accum, by_trainer.strategy.name) == (2, "zero2")
    run = by_trainer.fit(batches, settings=shardax.FitSettings(steps=4, log_every=1))
    by_hand = trainer("zero2", ConvNet)
    state, step = by_hand.init(), by_hand.parallel.with_settings(grad_accum=2).train_step(classification_loss)
    losses = []
    for batch in batches:
        state, metrics = step(state, by_hand.parallel.place_batch(batch))
        losses.append(float(metrics["loss"]))
    assert [r["loss"] for r in run.history] == losses
    jax.tree.map(np.testing.assert_array_equal, on_host(run.state), on_host(state))


class Digits:
    """A Grain random-access source (with a stable repr, which Grain records in its state)."""

    def __init__(self, count=96):
        batch = next(vector_batches(1, batch_size=count, seed=3))
        self.inputs, self.labels = batch["inputs"], batch["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"inputs": self.inputs[index], "labels": self.labels[index]}

    def __repr__(self):
        return f"Digits({len(self)})"


def grain_dataset():
    import grain

    return grain.MapDataset.source(Digits()).shuffle(seed=4).repeat().batch(16)


def grain_loader():
    import grain

    sampler = grain.samplers.IndexSampler(len(Digits()), shuffle=True, seed=4, num_epochs=None,
                                          shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True))
    return grain.DataLoader(data_source=Digits(), sampler=sampler,
                            operations=[grain.transforms.Batch(16, drop_remainder=True)], worker_count=0)


BATCHES = list(vector_batches(12, seed=5))
SOURCES = {
    "list": lambda: BATCHES,
    "step function": lambda: (lambda step: BATCHES[step]),
    "grain dataset": grain_dataset,
    "grain loader": grain_loader,
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_stop_and_resume_is_bit_identical_to_one_run(source, tmp_path):
    """Parameters, optimizer, Dropout's RNG counters, the user's counter and the data position."""
    straight = trainer().fit(SOURCES[source](), steps=6, log_every=1)
    trainer().fit(SOURCES[source](), steps=3, log_every=1, checkpoint_dir=tmp_path)
    resumed = trainer().fit(SOURCES[source](), steps=6, log_every=1, checkpoint_dir=tmp_path, resume=True)
    assert resumed.start_step == 3
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history[3:]]
    jax.tree.map(np.testing.assert_array_equal, on_host(resumed.state), on_host(straight.state))
    assert saved_steps(tmp_path) == [3, 6]


def test_a_checkpoint_resumes_into_another_strategy(tmp_path):
    straight = trainer("dp").fit(BATCHES, steps=6, log_every=1)
    trainer("dp").fit(BATCHES, steps=3, checkpoint_dir=tmp_path)
    moved = trainer("fsdp_tp", example_batch=BATCHES[0]).fit(BATCHES, steps=6, log_every=1,
                                                             checkpoint_dir=tmp_path,
                                                             resume=True)  # tp reads the split off the model
    np.testing.assert_allclose([r["loss"] for r in moved.history], [r["loss"] for r in straight.history[3:]],
                               rtol=1e-5)


def test_a_checkpoint_of_the_older_flat_layout_still_resumes(tmp_path):
    """Checkpoints written before the state tree (a flat dict of dotted names, RNG keys as raw
    bits) resume as before: the same step 6 as from the current layout."""
    import orbax.checkpoint as ocp

    from shardax.trainer.checkpoint import Checkpointer, SaveState, flatten_state

    first = trainer()
    first.fit(BATCHES, steps=3, checkpoint_dir=tmp_path / "tree")
    with Checkpointer(tmp_path / "tree") as tree:
        record = tree.record(3)
        assert set(tree.saved_arrays(3)) == {"params", "rest", "opt_state", "step", "skipped"}
    with Checkpointer(tmp_path / "flat") as flat:  # as shardax wrote them before
        flat.make_writable()
        flat.manager.save(3, args=ocp.args.Composite(state=SaveState(flatten_state(first.state)),
                                                     record=ocp.args.JsonSave(record)))
        flat.wait()
        assert "params.hidden.kernel" in flat.saved_arrays(3)
    runs = [trainer().fit(BATCHES, steps=6, log_every=1, checkpoint_dir=tmp_path / name, resume=True)
            for name in ("tree", "flat")]
    assert (runs[1].start_step == 3
            and [r["loss"] for r in runs[1].history] == [r["loss"] for r in runs[0].history])
    jax.tree.map(np.testing.assert_array_equal, on_host(runs[1].state), on_host(runs[0].state))
    assert saved_arrays(tmp_path / "flat", 3).keys() == saved_arrays(tmp_path / "tree", 3).keys()


def test_data_that_runs_out_ends_the_run_at_its_last_step(tmp_path, capsys):
    run = trainer().fit(BATCHES[:5], steps=10, eval_data=BATCHES[5:7], eval_every=4, log_every=4,
                        checkpoint_dir=tmp_path / "ckpt", checkpoint_every=4)
    assert run.end_step == 5 and "the data ran out after step 5 (of 10)" in capsys.readouterr().out
    assert [r["step"] for r in run.history] == [1, 4, 5] and "val_loss" in run.history[-1]
    assert saved_steps(tmp_path / "ckpt") == [4, 5]
    until_the_end = trainer().fit(BATCHES[:5], log_every=10)  # steps=None: one pass over the data
    assert until_the_end.end_step == 5


def test_evaluation_and_the_model_are_in_eval_mode():
    fitted = trainer("fsdp", ConvNet)
    fitted.fit(list(image_batches(3)), steps=3)
    held_out = list(image_batches(2, seed=8))
    before = on_host(fitted.state)
    first, second = fitted.evaluate(held_out), fitted.evaluate(held_out)
    assert first == second
    jax.tree.map(np.testing.assert_array_equal, on_host(fitted.state), before)
    model = fitted.model()
    assert model.norm1.use_running_average  # the returned module is in eval mode
    loss, metrics = classification_loss(model, {k: np.concatenate([b[k] for b in held_out])
                                                for k in held_out[0]})
    np.testing.assert_allclose(first["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(first["accuracy"], float(metrics["accuracy"]), rtol=1e-6)
    # the moving average of the weights evaluates the same way, and is not the weights
    averaged = fitted.evaluate(held_out, ema=True)
    loss, _ = classification_loss(fitted.model(ema=True), {k: np.concatenate([b[k] for b in held_out])
                                                           for k in held_out[0]})
    np.testing.assert_allclose(averaged["loss"], float(loss), rtol=1e-5)
    assert averaged["loss"] != first["loss"]
    jax.tree.map(np.testing.assert_array_equal, on_host(fitted.state), before)


def one_pass():
    yield from BATCHES


@pytest.mark.parametrize("call, message", [
    (lambda t, d: t.fit(BATCHES, steps=2, log_every=0), "`log_every=0` must be at least 1"),
    (lambda t, d: t.fit(BATCHES, settings=shardax.FitSettings(log_every=0)),
     "`log_every=0` must be at least 1"),
    (lambda t, d: t.fit(BATCHES, steps=2, settings=shardax.FitSettings()),
     "fit() got settings=FitSettings(...) and steps=2; give steps inside the FitSettings"),
    (lambda t, d: t.fit(BATCHES, settings={"steps": 2}),
     "fit(settings=...) takes a shardax.FitSettings; got dict"),
    (lambda t, d: t.fit(BATCHES, steps=2, eval_data=one_pass()), "eval_data is a one-pass generator"),
    (lambda t, d: t.fit(BATCHES, steps=2, resume=True), "`resume=True` needs checkpoint_dir"),
    (lambda t, d: t.fit(BATCHES, steps=2, resume=True, checkpoint_dir=d), "resume: no checkpoint in"),
    (lambda t, d: t.fit(42, steps=2), "data is a int; give an iterable of batches"),
    (lambda t, d: t.fit([], steps=2), "the data gave no batches"),
    (lambda t, d: t.fit([{"inputs": np.ones((12, 12), np.float32), "labels": np.zeros(12, np.int32)}],
                        steps=1),
     "a global batch of 12 rows (`batch_size=12`) does not split over the batch axes ('data',) of mesh "
     "data=8 times `grad_accum=1` (= 8); use a multiple of 8, e.g. 8"),
    (lambda t, d: t.fit(BATCHES, steps=1, samples=lambda m, s: np.zeros((2, 4, 4))),
     "samples= needs a place for its PNG grids: give run_dir=DIR (they go to DIR/samples) or "
     "samples_dir=DIR"),
    (lambda t, d: t.fit(BATCHES, step=2),
     "fit() got step=2, which is no setting of a run; the closest is steps; the settings are run_dir, "
     "steps,"),
    (lambda t, d: Trainer(DropoutMLP, optax.sgd(0.1), classification_loss, stratgy="fsdp"),
     "Trainer() got stratgy='fsdp', which is no setting of a Trainer; the closest is strategy; the settings "
     "are mesh, strategy,"),
    (lambda t, d: Trainer(DropoutMLP, optax.sgd(0.1), classification_loss, seed=1,
                          settings=shardax.TrainerSettings()),
     "Trainer() got settings=TrainerSettings(...) and seed=1; give seed inside the TrainerSettings"),
    (lambda t, d: Trainer(DropoutMLP, optax.sgd(0.1), classification_loss, settings=shardax.FitSettings()),
     "Trainer(settings=...) takes a shardax.TrainerSettings; got FitSettings"),
    (lambda t, d: Trainer(DropoutMLP, optax.sgd(0.1), classification_loss).fit(BATCHES, steps=1,
                                                                               eval_ema=True),
     "eval_ema=True evaluates the moving average of the weights, and the optimizer keeps none; chain"),
    (lambda t, d: t.fit(BATCHES, steps=1, samples=lambda m, s: -np.ones((2, 4, 4)), samples_dir=d),
     "samples returned 'samples' with values from -1 to -1; return values in "),
    (lambda t, d: t.fit(BATCHES, steps=1, samples=lambda m, s: {"x": np.ones((2, 4))}, samples_dir=d),
     "samples returned 'x' of shape (2, 4); return images as (count, height, width) or"),
])
def test_bad_arguments_are_one_line_errors(call, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        call(trainer(), tmp_path / "ckpt")
    assert "\n" not in str(error.value)


def test_a_loss_fn_returning_something_else_is_a_clear_error():
    def per_example(model, batch):
        return classification_loss(model, batch)[0] * np.ones(16)

    with pytest.raises(ValueError, match=r"loss_fn returned a loss of shape \(16,\); return its mean"):
        Trainer(DropoutMLP, optax.adamw(1e-2), per_example).fit(BATCHES, steps=1)


def test_checkpoints_are_never_overwritten_and_resume_checks_what_it_reads(tmp_path):
    trainer().fit(BATCHES, steps=2, checkpoint_dir=tmp_path)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    with pytest.raises(ValueError,
                       match="already holds checkpoints \\(latest step 2\\); pass `resume=True` to continue"):
        trainer().fit(BATCHES, steps=4, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError,
                       match=r"holds a different model: params.hidden.bias has shape \(40,\) there but "
                             r"\(48,\)"):
        Trainer(_Wider, optax.adamw(1e-2), classification_loss).fit(BATCHES, steps=4, checkpoint_dir=tmp_path,
                                                                    resume=True)
    with pytest.raises(ValueError, match="saved reading data of kind 'iterable', this run reads 'by_step'"):
        trainer().fit(lambda step: BATCHES[step], steps=4, checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="needs data that can be read again from its start"):
        trainer().fit(one_pass(), steps=4, checkpoint_dir=tmp_path, resume=True)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")
            if p.is_file() and p.name != LOCK_NAME} == before


class _Wider(DropoutMLP):
    def __init__(self, rngs):
        super().__init__(rngs)
        from flax import nnx

        self.hidden = nnx.Linear(24, 48, rngs=rngs)
        self.out = nnx.Linear(48, 5, rngs=rngs)


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1, "0.9"])
def test_a_moving_average_outside_0_to_1_or_missing_is_one_line(decay):
    with pytest.raises(UsageError,
                       match=rf"EMA decay {decay!r} is not between 0 and 1 \(exclusive\); use e.g. 0.999"):
        ema_params(decay)
    if decay == 0:
        plain = Trainer(DropoutMLP, optax.adamw(1e-2), classification_loss, strategy="dp")
        plain.state = plain.init()
        with pytest.raises(UsageError,
                           match=r"the optimizer keeps 0 parameter averages, where one is needed; chain "
                                 r"shardax.ema_params\(decay\) once, last"):
            plain.evaluate(BATCHES[:1], ema=True)
