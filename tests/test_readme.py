"""The README's Python snippets run as written, in a fresh interpreter."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(section):
    text = README.read_text().split(f"## {section}", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def run(code, cwd=None):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_quick_start_runs_and_prints_a_falling_loss():
    code = snippet("Quick start")
    assert len(code.strip().splitlines()) <= 30
    code += "\nassert loss.sharding.is_fully_replicated\n"
    printed = re.findall(r"^step (\d+): loss (\d+\.\d+)$", run(code), re.M)
    assert [int(step) for step, _ in printed] == [10, 20, 30]
    losses = [float(loss) for _, loss in printed]
    assert losses[2] < losses[1] < losses[0], losses


def test_your_own_model_runs_learns_and_prints_its_held_out_accuracy(tmp_path):
    code = snippet("Your own model")
    code += ("\nassert model.dropout.deterministic and model.norm.use_running_average"
             "\nprint('ok', result.last_eval['accuracy'])\n")
    out = run(code, cwd=tmp_path)
    assert out.splitlines()[-1].startswith("ok ")
    [printed] = re.findall(r"^held-out accuracy (\d\.\d{3})$", out, re.M)
    assert float(printed) > 0.8
    assert (tmp_path / "runs/classifier/metrics.png").exists() and (tmp_path / "runs/classifier/ckpt/200").is_dir()


def test_a_model_of_ones_own_built_from_the_blocks_trains_under_pp_tp_and_context():
    code = snippet("Pipeline and context parallelism for your own model")
    model = code.split("def loss_fn", 1)[0]
    assert len(model.strip().splitlines()) <= 50, "the model the README shows stays short"
    code += "\nassert trainer.parallel.mesh.shape['context'] == 4\n"
    out = run(code)
    printed = re.findall(r"^(\w+) on (\S+): loss (\d+\.\d\d) -> (\d+\.\d\d)$", out, re.M)
    assert [(strategy, mesh) for strategy, mesh, _, _ in printed] == [("pp_tp", "stage=2,data=2,model=2"),
                                                                     ("dp", "data=2,context=4")]
    assert all(float(last) < 0.6 * float(first) for _, _, first, last in printed), printed
    assert "pipeline: 2 stages x 2 microbatches" in out and "context: each sequence split 4 ways over context" in out


def test_fine_tuning_a_hugging_face_model(tmp_path):
    out = run(snippet("Fine-tune a Hugging Face model"), cwd=tmp_path)
    assert out.splitlines()[-1].startswith("loaded 2 layers, read ")
    assert sorted(p.name for p in (tmp_path / "tiny-llama-again").iterdir()) == ["config.json", "model.safetensors"]
    command = README.read_text().split("## Fine-tune a Hugging Face model", 1)[1].split("```bash\n", 1)[1].split("\n")[0]
    assert command.startswith("shardax train --init-from tiny-llama")
    trained = subprocess.run([sys.executable, "-m", "shardax.cli", *command.split()[1:], "--steps", "2",
                              "--batch-size", "8", "--eval-every", "0", "--sample-bytes", "0"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "model: fine-tuning the Hugging Face checkpoint" in trained.stdout
    lora, *exports = README.read_text().split("## Fine-tune a Hugging Face model", 1)[1].split("```bash\n", 1)[1].split(
        "```", 1)[0].splitlines()[1:]
    assert "--lora-rank" in lora and len(exports) == 2
    for line in (lora.replace("--steps 50", "--steps 2 --batch-size 8 --eval-every 0 --sample-bytes 0"), *exports):
        done = subprocess.run([sys.executable, "-m", "shardax.cli", *line.split("#")[0].split()[1:]],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "tiny-llama-adapters" / "adapter_config.json").is_file()
    assert (tmp_path / "tiny-llama-tuned" / "model.safetensors").is_file()
