"""`shardax train` end to end: every strategy, metrics, clear errors."""

import math
import re
import shlex

import PIL.Image
import pytest
import yaml
from cli_helpers import QUICK, read_metrics, shardax

from shardax.cli import main

STRATEGY_MESHES = [("dp", None), ("zero1", None), ("zero2", None), ("fsdp", None), ("tp", "data=2,model=4"),
                   ("fsdp_tp", None), ("hsdp", None)]


@pytest.mark.parametrize("strategy, mesh", STRATEGY_MESHES, ids=[s for s, _ in STRATEGY_MESHES])
def test_every_strategy_trains_through_the_cli(strategy, mesh, small_corpus, tmp_path, capsys):
    args = ["train", *QUICK, "--steps", "4", "--log-every", "1", "--eval-every", "2", "--data",
            str(small_corpus), "--strategy", strategy, "--metrics", str(tmp_path / "m.jsonl")]
    if mesh:
        args += ["--mesh", mesh]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"strategy {strategy}" in out and "summary" in out
    losses = [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.slow
def test_blocks_in_a_python_loop_through_the_cli(small_corpus, tmp_path, capsys):
    run = ["train", *QUICK, "--eval-every", "0", "--data", str(small_corpus), "--checkpoint-dir",
           str(tmp_path)]
    assert main([*run, "--steps", "2", "--no-scan-layers"]) == 0
    assert "summary" in capsys.readouterr().out
    # its checkpoint holds one set of weights per block, which a scanned model cannot resume
    assert main([*run, "--extend-to", "3", "--resume", "--scan-layers"]) == 2
    assert "--scan-layers True contradicts the checkpoint's --scan-layers False" in capsys.readouterr().err
    assert main([*run, "--extend-to", "3", "--resume"]) == 0  # the saved run's blocks, in a loop
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "out"), "--ema"]) == 2
    assert (f"--ema: step 3 of {tmp_path} keeps no moving average of the weights (it was trained without "
            "shardax train --ema DECAY); drop --ema") in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_directory_holds_the_run_and_the_command_that_resumes_it(small_corpus, tmp_path, capsys,  # noqa: PLR0915
                                                                       monkeypatch):
    """No --run-dir: a new directory under runs/ named by time and strategy holds config.yaml, the
    metrics, their plot and the checkpoints; the run says where at the start and at the end, and the
    command it prints continues it with the same settings (fsdp, from config.yaml)."""
    monkeypatch.setenv("SHARDAX_RUNS_DIR", str(tmp_path / "runs"))
    assert main(["train", *QUICK, "--steps", "6", "--log-every", "2", "--eval-every", "3", "--data",
                 str(small_corpus), "--strategy", "fsdp", "--ema", "0.9"]) == 0
    [run] = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_fsdp", run.name)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl",
                                                     "metrics.png", "tokenizer.json"]
    assert (run / "checkpoints" / "6").is_dir()
    out = capsys.readouterr().out
    assert (out.index(f"run directory: {run} (resume it with: shardax train --run-dir {run} --resume)")
            < out.index("step      1"))
    assert re.search(r"validation loss +│ \d\.\d{4} nats/byte \(best \d\.\d{4}\); \d\.\d{3} bits/byte", out)
    assert re.search(r"unigram baseline +│ \d\.\d{4} nats/byte", out) and re.search(r"run directory +│ ", out)
    assert out.index("sample") < out.index("summary")  # the sample, then the summary, then what to do next
    settings = yaml.safe_load((run / "config.yaml").read_text())  # by section: model, data, optimizer, ...
    assert list(settings) == ["model", "data", "optimizer", "parallelism", "run"]
    assert settings["parallelism"]["strategy"] == "fsdp" and settings["model"]["preset"] == "tiny"
    assert settings["optimizer"]["steps"] == 6 and settings["optimizer"]["ema"] == 0.9
    assert settings["data"]["data"] == [str(small_corpus)] and "resume" not in settings["run"]

    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 6]  # first step, every 2nd, and evaluations (3, 6)
    for record in records:
        if "loss" in record:
            assert {"step", "loss", "tokens_per_sec", "step_time_s", "lr", "grad_norm"} <= set(record)
            assert record["step_time_s"] > 0 and record["grad_norm"] > 0 and record["lr"] >= 0
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    assert all(math.isclose(r["val_bits_per_byte"], r["val_loss"] / math.log(2), rel_tol=1e-6)
               for r in evaluated)
    png = PIL.Image.open(run / "metrics.png")
    assert png.format == "PNG" and "fsdp on mesh data=8" in png.info["Title"]
    assert png.info["Description"] == "loss on a log scale"

    [command] = re.findall(r"to train further: (shardax train .*)", out)
    assert command == f"shardax train --run-dir {run} --resume --extend-to 12"
    assert main(shlex.split(command)[1:]) == 0  # strategy, data... from the run's config.yaml
    out = capsys.readouterr().out
    assert "strategy fsdp" in out and f"resumed from step 6 of {run / 'checkpoints'}" in out
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")][-1] == 12
    assert (run / "checkpoints" / "12").is_dir()
    text = (run / "config.yaml").read_text()  # steps stays the schedule's length; the extension is said
    assert ("# trained to step 12 (--resume --extend-to 12): steps past 6 at the schedule's final "
            "learning rate" in text)
    assert yaml.safe_load(text) == settings

    again = tmp_path / "again"  # the same settings afresh, from the run's config.yaml
    assert main(["train", "--config", str(run / "config.yaml"), "--run-dir", str(again), "--steps", "2"]) == 0
    assert "strategy fsdp" in capsys.readouterr().out
    assert yaml.safe_load((again / "config.yaml").read_text()) == {
        **settings, "optimizer": {**settings["optimizer"], "steps": 2}}

    assert main(["train", "--resume"]) == 2
    assert (f"--resume continues a saved run: name it with --run-dir DIR (the latest is {run})"
            in capsys.readouterr().err)

    # the moving average the run kept (--ema 0.9, resumed with it): exported and generated from
    from safetensors.numpy import load_file

    assert main(["export", str(run), "--hf", str(tmp_path / "weights")]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "average"), "--ema"]) == 0
    assert "from the moving average of its weights" in capsys.readouterr().out
    weights, average = (load_file(tmp_path / name / "model.safetensors") for name in ("weights", "average"))
    assert weights.keys() == average.keys() and all((weights[k] != average[k]).any() for k in weights)
    assert main(["generate", "--checkpoint", str(run), "--ema", "--prompt", "import", "--max-new-tokens",
                 "4"]) == 0
    assert capsys.readouterr().out.startswith("import")


@pytest.mark.parametrize("args, message", [
    (["--mesh", "data=16"], "mesh shape 'data=16' needs 16 devices but only 8 are available"),
    (["--mesh", "data=3"],
     "--mesh data=3 uses 3 of the 8 devices, and the others would sit idle; give sizes that "
     "multiply to 8 (e.g. data=8, or data=-1 with the other axes), or --devices 3 to simulate 3"),
    (["--batch-size", "12"],
     ("a global batch of 12 rows (--batch-size 12) does not split over the batch axes ('data',) of mesh "
      "data=8")),
    (["--strategy", "fsdp_tp", "--mesh", "data=8"], "strategy 'fsdp_tp' needs mesh axes ('data', 'model')"),
    (["--preset", "huge"], "unknown --preset huge; choose one of tiny, small"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--data", "/nonexistent/text"], "--data '/nonexistent/text' does not exist"),
    (["--resume"], "--resume continues a saved run: name it with --run-dir DIR"),
    (["--strategy", "fsdq"], "argument --strategy: invalid choice: 'fsdq'"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["--ema", "1.5"], "--ema 1.5 is not between 0 and 1 (exclusive); use e.g. 0.999"),
])
def test_bad_flags_are_one_line_errors(args, message):
    result = shardax("train", *QUICK, "--steps", "2", *args, check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("shardax train: error: ") and message in last, result.stderr


@pytest.mark.slow
def test_bad_data_is_a_clear_error(tmp_path):
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(binary, "no usable text in --data"), (short, "bytes of training text, fewer than the 33"),
             (empty, "holds no text files")]
    for data, message in cases:
        result = shardax("train", *QUICK, "--steps", "2", "--data", data, check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert message in result.stderr.strip().splitlines()[-1], result.stderr


def test_binary_files_are_skipped_and_counted(small_corpus, tmp_path, capsys):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for path in small_corpus.iterdir():
        (mixed / path.name).write_bytes(path.read_bytes())
    (mixed / "image.txt").write_bytes(b"\x89PNG\x00\x00" * 50)
    assert main(["train", *QUICK, "--steps", "1", "--data", str(mixed), "--eval-every", "0"]) == 0
    assert "1 skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_yaml_config_with_flags_winning(small_corpus, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    # PyYAML reads 1e-3 as a string: the setting's type decides
    config.write_text(f"steps: 5\nlog-every: 1\nstrategy: fsdp\nlr: 1e-3\ndata: {small_corpus}\n"
                      f"metrics: {tmp_path / 'm.jsonl'}\n")
    assert main(["train", *QUICK, "--config", str(config), "--steps", "3"]) == 0
    assert "strategy fsdp" in capsys.readouterr().out
    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert max(r["lr"] for r in records) == pytest.approx(1e-3, rel=1e-6)  # the YAML's peak
    config.write_text("stepz: 5\n")
    result = shardax("train", "--config", config, check=False)
    assert result.returncode == 2 and "unknown setting 'stepz'" in result.stderr
