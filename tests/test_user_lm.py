"""`shardax train --model user_lm:factory`: a user's own LM (tests/user_lm.py, plain Flax NNX) trained
by the LM job with its data, run directory, metrics, checkpoints and exact resume; what cannot
work is refused in one line (more cases in test_bad_inputs.py)."""

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import QUICK, read_metrics, shardax
from flax import nnx
from user_lm import PackedLM, TinyLM

from shardax.cli import main
from shardax.lm.models import TokensOnly, takes_segments, user_model
from shardax.lm.sampling import sample_tokens
from shardax.models.transformer import weighted_next_token_loss
from shardax.trainer.checkpoint import saved_arrays


def test_the_loss_calls_a_tokens_only_model_with_the_tokens_alone():
    model = TinyLM(50, 8, nnx.Rngs(0))
    assert not takes_segments(model) and takes_segments(PackedLM(50, 8, nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 50)
    segments = jnp.array([[1] * 4 + [2] * 5, [1] * 7 + [0] * 2])  # two documents; padding at the end
    batch = {"tokens": tokens, "segments": segments, "positions": jnp.zeros_like(tokens)}
    adapted = user_model("user_lm:factory", 50, 8, 2, packed=True).adapted(weighted_next_token_loss)
    loss, metrics = adapted(model, batch)
    # by hand: each row as one sequence, the predictions from or into padding left out
    losses = -jnp.take_along_axis(jax.nn.log_softmax(model(tokens[:, :-1])), tokens[:, 1:, None], -1)[..., 0]
    counted = (segments[:, :-1] > 0) & (segments[:, 1:] > 0)
    assert int(metrics["weight"]) == 8 + 6 == int(counted.sum())
    np.testing.assert_allclose(loss, (losses * counted).sum() / counted.sum(), rtol=1e-6)
    packed = user_model("user_lm:packed_factory", 50, 8, 2, packed=True)
    assert packed.adapted(weighted_next_token_loss) is weighted_next_token_loss  # it takes the segments
    assert TokensOnly(model)(tokens, segments, None).shape == (2, 9, 50)


class _Merged:
    """What ``sample_tokens`` reads of a ``ParallelModel``: ``merge(state)`` gives the model."""

    def __init__(self, model):
        self.model = model

    def merge(self, state):
        return self.model


def test_a_model_without_a_cache_samples_what_its_full_forward_pass_predicts():
    """Greedy: each token is the argmax of the model run on the latest context (8 tokens) alone,
    though the sampler pads the window to the context; the prompt and the sample outrun it."""
    model = TinyLM(50, 8, nnx.Rngs(3))
    prompt = [3, 14, 15, 9, 26, 5]
    got = sample_tokens(_Merged(model), None, prompt, 7, 8, vocab=40, temperature=0, top_k=0)
    tokens = list(prompt)
    for _ in range(7):
        window = jnp.asarray([tokens[-8:]], jnp.int32)
        tokens.append(int(jnp.argmax(model(window)[0, -1, :40])))
    assert got == tokens[len(prompt):]
    drawn = sample_tokens(_Merged(model), None, prompt, 7, 8, vocab=40, temperature=1.0, top_k=3, seed=2)
    assert drawn == sample_tokens(_Merged(model), None, prompt, 7, 8, vocab=40, temperature=1.0, top_k=3,
                                  seed=2) and all(0 <= t < 40 for t in drawn)


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"shardax {command}: error: "), err
    return lines[0]


def test_a_users_lm_trains_checkpoints_and_resumes_exactly(small_corpus, tmp_path, capsys):
    """--model from a YAML file; packed token shards (the model takes tokens alone); 4 steps with a
    checkpoint at 2 and 4. A copy of the run without its checkpoint 4 resumes from 2 to 5: steps 3
    and 4 lose the same and reach the same weights as the run that went straight on."""
    (tmp_path / "run.yaml").write_text("model: user_lm:factory\n")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", "--config", str(tmp_path / "run.yaml"), *QUICK, "--steps", "4", "--log-every", "1",
                 "--eval-every", "2", "--checkpoint-every", "2", "--data", str(small_corpus), "--tokenizer",
                 "bytes", "--run-dir", str(straight)]) == 0
    out = capsys.readouterr().out
    assert ("model: yours, TinyLM from user_lm:factory(vocab_size=320, seq_len=32); it takes tokens alone, "
            "so a packed row is one sequence to it") in out
    assert "attention:" not in out and "sample" in out and "unigram baseline" in out
    assert sorted(p.name for p in straight.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl",
                                                          "metrics.png", "tokenizer.json"]
    assert "  model: user_lm:factory" in (straight / "config.yaml").read_text()
    records = read_metrics(straight / "metrics.jsonl")
    losses = [r["loss"] for r in records]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]

    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    # no --model: the checkpoint's
    assert main(["train", "--run-dir", str(resumed), "--resume", "--extend-to", "5"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert [r["loss"] for r in read_metrics(resumed / "metrics.jsonl")][:4] == losses  # bit-identical floats
    expected, got = saved_arrays(straight / "checkpoints", 4), saved_arrays(resumed / "checkpoints", 4)
    assert expected.keys() == got.keys() and any("blocks" in key for key in got), list(got)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert (resumed / "checkpoints" / "5").is_dir()

    resume = ["train", "--run-dir", str(straight), "--resume", "--extend-to", "6"]
    assert main([*resume, "--model", "user_lm:packed_factory"]) == 2
    assert ("--model user_lm:packed_factory contradicts the checkpoint's --model user_lm:factory"
            in _one_line(capsys, "train"))
    assert main([*resume, "--precision", "bfloat16"]) == 2  # --model, from the checkpoint, refuses it
    assert "--precision bfloat16 shapes shardax's transformer, and --model user_lm:factory" in _one_line(
        capsys, "train")
    assert main(["export", str(straight), "--hf", str(tmp_path / "hf")]) == 2
    assert "trained a model of your own (shardax train --model)" in _one_line(capsys, "export")
    assert not (tmp_path / "hf").exists()
    # generate restores the user's model, which has no key/value cache to decode with
    assert main(["generate", "--checkpoint", str(straight), "--prompt", "import"]) == 2
    assert "implements shardax.decoding.CachedDecoder" in _one_line(capsys, "generate")


def test_a_bad_model_is_refused_in_one_line_by_the_command(small_corpus, tmp_path):
    """A process of its own, the module found on PYTHONPATH: exit 2, one line, no traceback."""
    from pathlib import Path

    tests = str(Path(__file__).parent)
    result = shardax("train", *QUICK, "--model", "user_lm:wrong_shape", "--data", small_corpus, "--run-dir",
                     tmp_path / "run", check=False, env={"PYTHONPATH": tests})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].endswith("--model user_lm:wrong_shape: its TinyLM gave float32 logits of shape (16, 32, "
                             "321) for tokens of shape (16, 32); it must give float logits (batch, seq_len, "
                             "vocab_size) = (16, 32, 320)")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # an end-to-end run; the fast tier trains the user's LM in the test above
def test_a_users_lm_tunes_preference_pairs_with_full_dpo(tmp_path, capsys):
    """--model with preference pairs: the user's LM is DPO's policy beside a frozen copy of its
    first weights (the reference), two parts of one run. The first loss is log 2 with no reward
    margin (the policy is its reference); the reference never moves, and the policy does."""
    run = tmp_path / "dpo"
    assert main(["train", "--model", "user_lm:factory", "--data", "python-pairs", "--seq-len", "64",
                 "--batch-size", "8", "--steps", "3", "--log-every", "1", "--eval-every", "0",
                 "--eval-batches", "1", "--sample-bytes", "8", "--checkpoint-every", "1",
                 "--keep-checkpoints", "3", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "parts: policy (TinyLM), reference (TinyLM, frozen)" in out, out
    records = read_metrics(run / "metrics.jsonl")
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6 and records[0]["reward_margin"] == 0
    first, last = saved_arrays(run / "checkpoints", 1), saved_arrays(run / "checkpoints", 3)
    policy = sorted(name for name in first if name.startswith("params.policy."))
    assert policy and any("blocks" in name for name in policy), list(first)
    for name in policy:
        reference = name.replace(".policy.", ".reference.")
        np.testing.assert_array_equal(first[reference], first[name], err_msg=name)  # policy = reference
        np.testing.assert_array_equal(last[reference], first[reference], err_msg=name)  # never moves
    assert any(not np.array_equal(last[name], first[name]) for name in policy)
