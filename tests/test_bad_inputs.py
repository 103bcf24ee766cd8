"""Bad input, tried as a new user would: every case exits 2 with one line on stderr that says what was
given, what was expected and how to fix it, and nothing that existed before is changed."""

import shutil
import subprocess
import sys

import pytest
from cli_helpers import QUICK, built_once, shardax

from shardax.cli import main
from shardax.trainer.manifest import MANIFEST

pytestmark = pytest.mark.xdist_group("test_bad_inputs")


@pytest.fixture(scope="module")
def workspace(small_corpus):
    """Text, odd data, YAML files and checkpoint directories (another run's, a damaged one, not
    shardax's), made once per test session whichever worker asks first (no test changes it)."""
    return built_once("bad_inputs_workspace", lambda root: _make_workspace(root, small_corpus))


def _make_workspace(root, small_corpus):
    shutil.copytree(small_corpus, root / "text")
    (root / "empty").mkdir()
    (root / "binary").mkdir()
    (root / "binary" / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    (root / "unreadable").mkdir()
    (root / "unreadable" / "gone.txt").symlink_to(root / "nowhere.txt")
    (root / "short.txt").write_text("too short")
    (root / "a_file").write_text("not a directory")
    yaml = {"typo.yaml": "stepz: 5\n", "ten.yaml": "steps: ten\n", "list.yaml": "- steps\n- 5\n",
            "broken.yaml": "steps: [5\n", "lr.yaml": "optimizer:\n  lr: -1e-3\n",
            "misplaced.yaml": "model:\n  lr: 1e-3\n"}
    for name, text in yaml.items():
        (root / name).write_text(text)
    run = ("train", *QUICK, "--steps", 2, "--eval-every", 0, "--data", root / "text")
    cli(*run, "--checkpoint-dir", root / "other_run", "--metrics", root / "other_run.jsonl")
    shutil.copytree(root / "other_run", root / "damaged")
    shutil.copytree(root / "other_run", root / "a_run" / "checkpoints")  # a run directory
    (root / "damaged" / "2" / MANIFEST).write_text('{"files": {"state/missing": '
                                                   '{"bytes": 1, "sha256": "0"}}}')
    cli("prepare", root / "text", "--out", root / "shards_bpe", "--tokenizer", "bpe", "--vocab-size", 300)
    cli("prepare", root / "text", "--out", root / "swapped")  # bytes; a run trains on them ...
    cli(*run[:-2], "--data", root / "swapped", "--checkpoint-dir", root / "swapped_run")
    cli("prepare", root / "text", "--out", root / "swapped", "--tokenizer", "bpe", "--vocab-size", 300,
        "--overwrite")  # ... then they are replaced by BPE shards
    (root / "bad").mkdir()
    (root / "bad" / "empty.txt").write_text("")
    (root / "bad" / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (root / "bad" / "other.jsonl").write_text('{"body": "text under another name"}\n')
    reply = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
    (root / "bad" / "noreply.jsonl").write_text(reply + '{"messages": [{"role": "user", "content": "Hi"}]}\n')
    pytest.importorskip("pyarrow.parquet").write_table(
        __import__("pyarrow").table({"body": ["text under another name"]}), root / "bad" / "other.parquet")
    (root / "not_shardax" / "7").mkdir(parents=True)
    (root / "not_shardax" / "7" / "notes.txt").write_text("someone else's files")


def cli(*args):
    """``shardax ...`` in a process of its own, as a user runs it (a run's checkpoint writers, the
    tokenizer's threads and their state stay out of the test worker)."""
    shardax(*args)


def snapshot(root):
    return {p: (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


TRAIN = ("train", *QUICK, "--steps", "2", "--eval-every", "0")
CASES = [
    # flags: zero, negative, wrong type, unknown choice
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--steps", "-3"], "--steps -3 must be at least 1"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--batch-size", "12"],
     ("a global batch of 12 rows (--batch-size 12) does not split over the batch axes ('data',) of mesh "
      "data=8")),
    (["--lr", "-1"], "--lr -1.0 must be a positive learning rate"),
    (["--lr", "0"], "--lr 0.0 must be a positive learning rate"),
    (["--log-every", "0"], "--log-every 0 must be at least 1"),
    (["--eval-every", "-1"], "--eval-every -1 must be at least 0"),
    (["--eval-batches", "0"], "--eval-batches 0 must be at least 1"),
    (["--grad-accum", "0"], "--grad-accum 0 must be at least 1"),
    (["--grad-accum", "3"], "times --grad-accum 3 (= 24); use a multiple of 24"),
    (["--seq-len", "0"], "--seq-len 0 must be at least 1"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints 0 must be at least 1"),
    (["--devices", "0"], "--devices 0 must be at least 1"),
    (["--strategy", "fsdq"], "argument --strategy: invalid choice: 'fsdq'"),
    (["--precision", "float16"], "argument --precision: invalid choice: 'float16'"),
    (["--attention", "cudnn"], "--attention cudnn: it needs a GPU (this is cpu); it needs bfloat16 compute"),
    (["--preset", "huge"], "unknown --preset huge; choose one of tiny, small"),
    (["--extend-to", "9"], "--extend-to 9 continues a saved run; add --resume"),
    # meshes
    (["--mesh", "data=16"], "mesh shape 'data=16' needs 16 devices but only 8 are available"),
    (["--mesh", "data:8"], "data:8"),
    (["--strategy", "fsdp_tp", "--mesh", "data=8"], "strategy 'fsdp_tp' needs mesh axes ('data', 'model')"),
    # data
    (["--data", "{root}/nonexistent"], "does not exist"),
    (["--data", "{root}/empty"], "holds no text files"),
    (["--data", "{root}/binary"], "no usable text in --data"),
    (["--data", "{root}/unreadable"], "holds no text files"),  # its only .txt is a link to nothing
    (["--data", "{root}/short.txt"], "bytes of training text, fewer than the 33"),
    (["--data", "{root}/shards_bpe", "--tokenizer", "bytes"],
     "holds shards made with bpe (trained, vocabulary 300)"),
    (["--data", "{root}/swapped", "--checkpoint-dir", "{root}/swapped_run", "--resume", "--extend-to", "4"],
     "was trained on bytes tokens (model vocabulary 320), but its data now gives bpe-"),
    (["--vocab-size", "300"], "--vocab-size 300 needs --tokenizer bpe"),
    (["--tokenizer", "{root}/a_file"], "a_file is not JSON"),
    (["--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size 100 must be at least 258"),
    (["--no-packing"], "--no-packing lays conversations one a row, and --data holds documents; leave it out"),
    (["--dpo-beta", "0.5"], "--dpo-beta tunes DPO, and --data holds no preference pairs"),
    (["--data", "{root}/bad/noreply.jsonl"], "noreply.jsonl line 2: the conversation has no assistant turn"),
    # --format: a data format's name, or one of the user's (module:Class, a shardax.data.registry.DataFormat)
    (["--format", "pairs"], "--format 'pairs' is not one of auto, documents, conversations, preferences"),
    (["--format", "user_lm:factory"], "--format user_lm:factory: user_lm.factory is a function, not a data"),
    (["--format", "no_such_formats:QA"], "--format no_such_formats:QA: the module no_such_formats does not"),
    # --model: a model of the user's own (tests/user_lm.py)
    (["--model", "user_lm"], "--model user_lm: expected module:function, e.g. my_lm:build"),
    (["--model", "no_such_lm:build"],
     "--model no_such_lm:build: the module no_such_lm does not import: ModuleNotFoundError: No module named "
     "'no_such_lm' (is it in the current directory or on PYTHONPATH?)"),
    (["--model", "user_lm:nothing"], "user_lm.py) has no function nothing"),
    (["--model", "user_lm:failing"],
     "--model user_lm:failing: failing(vocab_size=320, seq_len=32, rngs=...) failed: ValueError: width 30 "
     "does not split into 4 heads"),
    (["--model", "user_lm:not_a_module"], "returned a dict; return an nnx.Module whose __call__(tokens)"),
    (["--model", "user_lm:wrong_shape"], "its TinyLM gave float32 logits of shape (16, 32, 321) for tokens"),
    (["--model", "user_lm:factory", "--init-from", "{root}/text"],
     "--init-from {root}/text shapes shardax's transformer, and --model user_lm:factory trains your own"),
    (["--model", "user_lm:factory", "--lora-rank", "4"], "--lora-rank 4 shapes shardax's transformer"),
    (["--model", "user_lm:factory", "--no-scan-layers"], "--scan-layers False shapes shardax's transformer"),
    (["--checkpoint-dir", "{root}/other_run", "--resume", "--model", "user_lm:factory"],
     "--model user_lm:factory contradicts the checkpoint's --model none (shardax's transformer)"),
    # YAML files
    (["--config", "{root}/missing.yaml"], "cannot read it (No such file or directory)"),
    (["--config", "{root}/broken.yaml"], "not valid YAML"),
    (["--config", "{root}/typo.yaml"], "unknown setting 'stepz'; did you mean 'steps'?"),
    (["--config", "{root}/ten.yaml"], "steps is 'ten', expected int"),
    (["--config", "{root}/list.yaml"], "expected a mapping of settings, got list"),
    (["--config", "{root}/lr.yaml"], "--lr -0.001 must be a positive learning rate"),
    (["--config", "{root}/misplaced.yaml"], "lr belongs under optimizer:, not model:"),
    # checkpoint directories and files to write
    (["--checkpoint-dir", "{root}/a_file"], "is a file; give a directory"),
    (["--checkpoint-dir", "{root}/other_run"], "already holds checkpoints (latest step 2); pass --resume"),
    (["--checkpoint-dir", "{root}/damaged", "--resume"], "no good checkpoint in"),
    (["--checkpoint-dir", "{root}/not_shardax", "--resume"],
     "step 7 is damaged (it is not a checkpoint written by"),
    (["--checkpoint-dir", "{root}/empty", "--resume"], "resume: no checkpoint in"),
    (["--checkpoint-dir", "/proc/shardax/ckpt"], "cannot be created (No such file or directory)"),
    (["--resume"], "--resume continues a saved run: name it with --run-dir DIR"),
    (["--run-dir", "{root}/a_file"], "--run-dir {root}/a_file is a file; give a directory"),
    (["--run-dir", "{root}/empty", "--resume"], "--run-dir {root}/empty holds no checkpoints to resume"),
    (["--run-dir", "{root}/a_run"],
     "--run-dir {root}/a_run already holds checkpoints (latest step 2); pass --resume"),
    (["--checkpoint-dir", "{root}/other_run", "--resume", "--seed", "5"],
     "--seed 5 contradicts the checkpoint's --seed 0"),
    (["--metrics", "{root}/empty"], "is a directory; give a file name"),
    (["--tracker", "neptune:{root}/runs"],
     "--tracker got 'neptune:{root}/runs'; write it as KIND:DIRECTORY with KIND "
     "one of tensorboard, mlflow, wandb"),
    (["--tracker", "mlflow:/proc/shardax/mlflow"], "mlflow directory /proc/shardax/mlflow cannot be created"),
    # refused by the first step's trace, before the metrics file or a checkpoint is written
    (["--mesh", "data=2,context=4", "--seq-len", "30", "--metrics", "{root}/new.jsonl", "--checkpoint-dir",
      "{root}/new"], "of 30 tokens does not cut into 8 equal chunks"),
    (["--metrics", "/proc/shardax/m.jsonl"], "cannot be written"),
]


def exit_code(argv):
    """``main``'s return code; argparse's errors leave through ``SystemExit``."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(args) for args, _ in CASES])
@pytest.mark.every_case
def test_bad_train_input(args, message, workspace, capsys):
    args = [arg.replace("{root}", str(workspace)) for arg in args]
    data = [] if "--data" in args or "--config" in args else ["--data", str(workspace / "text")]
    before = snapshot(workspace)
    assert exit_code([*TRAIN, *data, *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert (lines[0].startswith("shardax train: error: ")
            and message.replace("{root}", str(workspace)) in lines[0]), lines[0]
    assert snapshot(workspace) == before


@pytest.mark.parametrize("name, extra, message", [
    ("empty.txt", [], "empty.txt is empty; remove it from the inputs"),
    ("latin1.txt", [], "latin1.txt is not UTF-8 text (byte 3: b'\\xe9'); convert it"),
    ("other.jsonl", [], "other.jsonl line 1 has no field 'text' (it has body); pass --field NAME"),
    ("other.parquet", [], "other.parquet has no column 'text' (it has body); pass --field NAME"),
    ("noreply.jsonl", [],
     "noreply.jsonl line 2: the conversation has no assistant turn, so nothing in it would"),
    ("noreply.jsonl", ["--tokenizer", "bpe"],
     "--tokenizer bpe trains on documents, and --data holds conversations"),
    ("noreply.jsonl", ["--chat-template", "{root}/text"], "has no chat template (no chat_template in"),
    ("other.jsonl", ["--chat-template", "{root}/text"],
     "--chat-template {root}/text applies to conversations"),
    ("other.parquet", ["--tokenizer", "bpe", "--vocab-size", "9"], "--vocab-size 9: a byte-level BPE needs"),
    ("latin1.txt", ["--tokenizer", "{root}/shards_bpe/index.json"], "is not a Hugging Face tokenizer.json"),
])
@pytest.mark.every_case
def test_bad_prepare_input(name, extra, message, workspace, tmp_path, capsys):
    """Each case prepares into a new folder of its own: what one case left cannot fail another."""
    before = snapshot(workspace)
    extra = [arg.replace("{root}", str(workspace)) for arg in extra]
    out = tmp_path / "new"
    assert exit_code(["prepare", str(workspace / "bad" / name), "--out", str(out), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    message = message.replace("{root}", str(workspace))
    assert len(lines) == 1 and lines[0].startswith("shardax prepare: error: ") and message in lines[0], lines
    assert snapshot(workspace) == before and list(tmp_path.iterdir()) == []  # no output, no staging folder


@pytest.mark.parametrize("args, message", [
    (["launch", "-n", "2"], "nothing to launch; give the command after --"),
    (["launch", "-n", "0", "--", "shardax", "train"], "-n 0 and --devices-per-process 8 must be at least 1"),
    (["launch", "-n", "2", "--devices-per-process", "0", "--", "shardax", "train"], "must be at least 1"),
    (["launch", "-n", "two", "--", "true"], "argument -n/--num-processes: invalid int value: 'two'"),
    (["plan", "--device-memory", "lots"], "--device-memory lots is not a size"),
    (["plan", "--strategy", "zero4"], "argument --strategy: invalid choice: 'zero4'"),
    (["plan", "--target", "tpu-v9-8"],
     "--target 'tpu-v9-8' is not a TPU slice or GPU host; write it like tpu-v5p-8"),
    (["plan", "--target", "tpu-v5p-6"], "v5p slices come in powers of two from v5p-8"),
    (["plan", "--fit", "--strategy", "dp"], "--fit searches against a chip's memory; add --target"),
])
@pytest.mark.every_case
def test_bad_launch_and_plan_input(args, message, tmp_path):
    result = shardax(*args, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_bug_keeps_its_traceback_and_another_exit_code():
    """Not every ValueError is the user's: one raised below shardax is a bug and looks like one."""
    code = ("import sys; import shardax.cli as cli\n"
            "def broken(args): raise ValueError('deep inside a library')\n"
            "cli.train = broken\n"
            "sys.exit(cli.main(['train']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: deep inside a library" in result.stderr
