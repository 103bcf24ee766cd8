"""Data formats as plug-ins (``shardax.data.registry``): a format defined outside shardax
(``tiny_format``: questions and answers, the loss on the answers alone) is read off its records,
prepared with its loss mask and trained by ``shardax train --format tiny_format:QuestionAnswer``;
the registry's errors are one line; the core names no format. And full DPO from the command line
(preference pairs without LoRA): the policy trains against a frozen copy of its first weights,
its first gradient is ``shardax.dpo_loss``'s, and the run resumes exactly and exports the policy."""

import ast
import json
import math
import random
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from cli_helpers import QUICK, read_metrics
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import shardax
from shardax.cli import main
from shardax.data import registry
from shardax.errors import UsageError

pytestmark = pytest.mark.xdist_group("test_data_formats")

SPEC = "tiny_format:QuestionAnswer"


@pytest.fixture
def qa(tmp_path):
    """Sums asked and answered, as JSON lines; the format forgotten again after the test."""
    rng = random.Random(0)
    records = [{"question": f"{a} + {b} = ", "answer": f"{a + b}\n"}
               for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(300))]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    yield path, records
    registry.unregister_format("qa")


def test_a_format_of_ones_own_is_read_off_its_records_and_prepared_with_its_mask(qa, tmp_path):
    """Registered (here by its module:Class), the format claims its records, and prepare keeps
    each example whole with a mask of exactly its answer's tokens."""
    from shardax.data.examples import Examples
    from shardax.data.prepare import prepare
    from shardax.data.python_chats import built_in_file
    from shardax.lm.data import open_data

    path, records = qa
    kind = registry.load_format(SPEC)
    assert kind.name == "qa" and registry.format_names()[-1] == "qa" and registry.get_format("qa") is kind
    assert registry.detect_format([path], "text") is kind
    pairs = registry.detect_format([built_in_file("python-pairs", tmp_path)], "text")
    assert pairs.name == "preferences"  # shardax's own, still claimed by theirs
    done = prepare([path], tmp_path / "prepared", data_format="qa", show_progress=False)
    assert done.index["kind"] == "qa"
    answers = {record["question"]: record["answer"] for record in records}
    splits, seen = done.index["splits"], 0
    for split in ("train", "validation"):
        examples, learned = Examples(done.root, splits[split]["shards"], done.index["dtype"], 257), 0
        for number in range(len(examples)):
            ids, mask = examples.example(number, 1 << 10)
            question, answer = (bytes(ids[side].astype(np.uint8)).decode() for side in (mask == 0, mask > 0))
            assert answer == answers[question] and bytes(ids.astype(np.uint8)).decode() == question + answer
            learned += len(answer)
        assert splits[split]["trained"] == learned  # what the header counts
        seen += len(examples)
    assert seen == len(records)
    registry.unregister_format("qa")  # the shards name their format: read without it, one line says so
    with pytest.raises(UsageError, match="holds data of the format 'qa', which is not registered here"):
        open_data([str(done.root)], None, None, None, 32)


def test_the_registrys_errors_are_one_line():
    from shardax.data.formats.conversations import Conversations

    class Again(Conversations):
        name = "conversations"

    bad = [(lambda: registry.register_format(object), "a format is a subclass of shardax.data.registry."
                                                         "DataFormat with a name"),
           (lambda: registry.register_format(Again), "a data format named 'conversations' is registered "
                                                      "already (Conversations); give replace=True"),
           (lambda: registry.get_format("pairs"), "--format 'pairs' is not one of auto, documents, "
                                                  "conversations, preferences"),
           (lambda: registry.get_format("text"), "--format 'text' is not one of auto"),
           (lambda: registry.get_format("tiny_format:"), "--format tiny_format:: expected module:Class"),
           (lambda: registry.get_format("tiny_format:nothing"), "tiny_format.nothing is nothing, not a data"),
           (lambda: registry.get_format("user_lm:TinyLM"), "user_lm.TinyLM is the class TinyLM, not a data")]
    for call, message in bad:
        with pytest.raises(UsageError) as raised:
            call()
        assert message in str(raised.value) and "\n" not in str(raised.value)
    assert registry.get_format("conversations") is Conversations  # nothing was replaced


def test_the_core_never_names_a_format():
    """Outside ``shardax.data.formats``, the LM job, prepare and the command lines import no
    format and name none (``documents`` and ``text``, also the names of a split's counts and of a
    file's kind, are the registry's defaults): they ask the registry, and the format itself."""
    root = Path(shardax.__file__).parent
    core = [root / name for name in ("lm/job.py", "lm/data.py", "lm/models.py", "lm/config.py",
                                     "data/prepare.py", "data/documents.py", "data/conversations.py",
                                     "cli/train.py", "cli/prepare.py", "cli/export.py")]
    formats = registry.registered()
    names = {kind.name for kind in formats} - {registry.DOCUMENTS, registry.TEXT}
    classes = {kind.__name__ for kind in formats}
    found = []
    for path in core:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.name}: {node.value!r}")
            if isinstance(node, ast.Name) and node.id in classes:
                found.append(f"{path.name}: {node.id}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardax.data.formats"):
                found.append(f"{path.name}: imports {node.module}")
    assert found == []


@pytest.mark.slow
def test_shardax_train_trains_a_format_of_ones_own(qa, tmp_path, capsys):
    """``--format tiny_format:QuestionAnswer`` on JSON lines: the header counts the answers'
    tokens, the loss falls, and the last step's loss is the loss on the answers alone, computed
    here from that step's batch and weights (every token of it gives another)."""
    from shardax.cli.export import restore_run
    from shardax.lm.data import open_data
    from shardax.models.transformer import weighted_next_token_loss

    path, _ = qa
    run_dir = tmp_path / "run"
    assert main(["train", "--data", str(path), "--format", SPEC, *QUICK, "--steps", "8", "--log-every", "1",
                 "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "1", "--keep-checkpoints",
                 "8", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    data = open_data([str(path)], None, None, None, 32, data_format=SPEC)  # the run's own shards, cached
    train = data.data.index["splits"]["train"]
    assert (f"{train['documents']:,} train / " in out and "questions and answers" in out
            and f"{train['trained']:,} of {train['tokens']:,} tokens learned (the answers')" in out)
    losses = [record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0
    _, _, _, parallel, state = restore_run(str(run_dir), 7)  # the weights step 8 computed its loss with
    model = parallel.merge(state)
    batch = data.batches(32, 16, 0, NamedSharding(Mesh(jax.devices(), ("data",)), PartitionSpec("data")))(7)
    answers, _ = weighted_next_token_loss(model, batch)
    every, _ = weighted_next_token_loss(model, {**batch, "mask": (batch["segments"] > 0).astype(np.int32)})
    assert losses[7] == pytest.approx(float(answers), rel=1e-5) and abs(float(every) - float(answers)) > 0.1


@pytest.mark.slow
def test_full_dpo_from_the_command_line_trains_the_policy_against_a_frozen_copy(tmp_path, capsys):  # noqa: PLR0915
    """Preference pairs without --lora-rank: the policy and a frozen reference, both from the
    seed's weights. The first loss is log 2 with zero rewards and the loss falls; the reference
    never moves; the policy's first gradient (Adam's first moment, 0.1 x the clipped gradient, and
    its norm) is ``shardax.dpo_loss``'s with the reference's log-probabilities computed here; a
    copy resumed from step 2 reaches step 4's weights bit for bit; export writes the policy."""
    from safetensors.numpy import load_file

    from shardax.cli.export import restore_run
    from shardax.lm.data import open_data
    from shardax.models.preference import dpo_loss, sequence_logprobs
    from shardax.trainer.checkpoint import saved_arrays

    straight, resumed = tmp_path / "dpo", tmp_path / "resumed"
    run = ["--data", "python-pairs", "--preset", "tiny", "--seq-len", "96", "--batch-size", "8", "--steps",
           "4", "--dpo-beta", "0.2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
           "--sample-bytes", "8", "--checkpoint-every", "1", "--keep-checkpoints", "4",
           "--run-dir", str(straight)]
    assert main(["train", *run]) == 0
    out = capsys.readouterr().out
    assert ("parts: policy (TransformerLM), reference (TransformerLM, frozen)" in out
            and "DPO against a frozen copy of the model's first weights (the reference)" in out)
    records = read_metrics(straight / "metrics.jsonl")
    losses = [record["loss"] for record in records]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and records[0]["reward_margin"] == 0
    assert losses[-1] < losses[0]
    first, last = saved_arrays(straight / "checkpoints", 1), saved_arrays(straight / "checkpoints", 4)
    policy = sorted(name for name in first if name.startswith("params.policy."))
    assert policy and not [name for name in first if name.startswith("opt_state.reference")]
    for name in policy:
        frozen = name.replace(".policy.", ".reference.")
        np.testing.assert_array_equal(first[frozen], first[name])  # policy = reference
        np.testing.assert_array_equal(last[frozen], first[frozen])  # the reference never moves
    assert not np.array_equal(last["params.policy.embedding"], first["params.policy.embedding"])

    # the first gradient, from Python: the weights at step 1 are the first ones (learning rate 0)
    _, _, _, parallel, state = restore_run(str(straight), 1)
    model = parallel.merge(state)
    data = open_data(["python-pairs"], None, None, None, 96)  # the run's own shards, cached
    batch = data.batches(96, 8, 0, NamedSharding(Mesh(jax.devices(), ("data",)), PartitionSpec("data")))(0)
    reference = {f"reference_{side}": sequence_logprobs(model, batch[side], batch[f"{side}_mask"])
                 for side in ("chosen", "rejected")}
    grads = nnx.grad(lambda m: dpo_loss(beta=0.2)(m, {**batch, **reference})[0])(model)
    norm = float(optax.tree.norm(grads))
    assert records[0]["grad_norm/policy"] == pytest.approx(norm, rel=1e-4) and norm > 0
    is_adam = lambda node: isinstance(node, optax.ScaleByAdamState)  # noqa: E731
    [adam] = [node for node in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(node)]
    moments, expected = jax.tree.leaves(adam.mu), jax.tree.leaves(grads)
    assert [m.shape for m in moments] == [g.shape for g in expected]
    for moment, gradient in zip(moments, expected):
        clipped = 0.1 * np.asarray(gradient) * min(1.0, 1.0 / norm)  # clip_by_global_norm(1), then b1 0.9
        np.testing.assert_allclose(np.asarray(moment), clipped, rtol=2e-4, atol=2e-4 * np.abs(clipped).max())

    shutil.copytree(straight, resumed)
    for step in ("3", "4"):
        shutil.rmtree(resumed / "checkpoints" / step)
    assert main(["train", "--run-dir", str(resumed), "--resume"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert [record["loss"] for record in read_metrics(resumed / "metrics.jsonl")][:4] == losses
    again = saved_arrays(resumed / "checkpoints", 4)
    assert again.keys() == last.keys()
    for name in last:
        np.testing.assert_array_equal(again[name], last[name], err_msg=name)

    assert main(["export", str(straight), "--hf", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    np.testing.assert_array_equal(exported["model.embed_tokens.weight"], last["params.policy.embedding"])
