"""The README and the documentation site: every Python block runs as written in a fresh
interpreter (or is marked a fragment), the guides' shell commands run as written, one after
another (or their block says why not), and the site builds with ``mkdocs build --strict``."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment: shows a call on a model of your own; not run -->\n"
PYTHON_BLOCK = re.compile(r"(?P<mark><!-- fragment:[^\n]*-->\n)?```python\n(?P<code>.*?)```", re.S)


def section(title, pages=PAGES):
    """The text after the heading ``title`` (any level) on the first page that has it."""
    for page in pages:
        found = re.search(rf"^#+ {re.escape(title)}\n", page.read_text(), re.M)
        if found:
            return page.read_text()[found.end():]
    raise AssertionError(f"no page has a heading {title!r}")


def snippet(title, pages=PAGES):
    return PYTHON_BLOCK.search(section(title, pages)).group("code")


def run(code, cwd=None):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


# the sections whose blocks the tests below run; every other block must be marked a fragment
RUN = {"Quick start", "A first data-parallel step with artifex's API", "Your own model", "Strategies",
       "Checkpoints are orbax trees",
       "Pipelines and long sequences: `LayerStack` and `Attention`", "Fine-tune a Hugging Face model",
       "Trackers"}


def test_every_python_block_runs_or_is_marked_a_fragment():
    ran = {snippet(title) for title in RUN}
    for page in PAGES:
        for block in PYTHON_BLOCK.finditer(page.read_text()):
            assert block["code"] in ran or block["mark"] == FRAGMENT, (page.name, block["code"][:200])
    assert snippet("Quick start", [README]) == snippet("Quick start", [ROOT / "docs/getting-started.md"])


def test_the_site_builds_strict(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                            str(tmp_path / "site")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    reference = (tmp_path / "site/reference/index.html").read_text()
    # the API reference is generated from the docstrings
    assert "shardax.parallelize" in reference and "trackers" in reference and "Hugging Face" in reference


def test_quick_start_runs_and_prints_a_falling_loss():
    code = snippet("Quick start", [README])
    assert len(code.strip().splitlines()) <= 30
    out = run(code)
    [printed] = re.findall(r"^\[([\d., ]+)\]$", out, re.M)
    assert "shardax: 1,348 parameters, strategy fsdp" in out  # a small model's size in full, not "0.00M"
    losses = [float(loss) for loss in printed.split(",")]
    # steps 1, 20, 40 and 60
    assert (len(losses) == 4 and all(a > b for a, b in zip(losses, losses[1:]))
            and losses[-1] < 0.1 * losses[0]), losses


def test_artifex_api_step_runs_and_prints_a_falling_loss():
    code = snippet("A first data-parallel step with artifex's API")
    code += "\nassert loss.sharding.is_fully_replicated\n"
    printed = re.findall(r"^step (\d+): loss (\d+\.\d+)$", run(code), re.M)
    assert [int(step) for step, _ in printed] == [10, 20, 30]
    losses = [float(loss) for _, loss in printed]
    assert losses[2] < losses[1] < losses[0], losses


@pytest.mark.slow
def test_your_own_model_runs_learns_and_prints_its_held_out_accuracy(tmp_path):
    code = snippet("Your own model")
    code += ("\nassert model.dropout.deterministic and model.norm.use_running_average"
             "\nprint('ok', result.last_eval['accuracy'])\n")
    for _ in range(2):  # as a user runs it, then runs it again
        out = run(code, cwd=tmp_path)
        assert out.splitlines()[-1].startswith("ok ")
        [printed] = re.findall(r"^held-out accuracy (\d\.\d{3})$", out, re.M)
        assert float(printed) > 0.8
    runs = sorted((tmp_path / "runs").glob("classifier-*"))
    assert len(runs) == 2 and all((r / "metrics.png").exists() and (r / "ckpt/200").is_dir() for r in runs)


def test_a_checkpoint_restores_with_orbax_alone(tmp_path):
    """The docs' recipe: plain orbax (no shardax) restores a Trainer checkpoint into nnx.state(model)."""
    code = snippet("Checkpoints are orbax trees")
    restoring = code.split("# orbax alone", 1)[1].split("\n", 1)[1].split("same =", 1)[0]
    assert "shardax" not in restoring and "trainer" not in restoring and "ocp.PyTreeCheckpointer" in restoring
    out = run(code, cwd=tmp_path)
    assert out.splitlines()[-1] == ("restored with orbax alone: out.kernel (32, 4), equal to the trained "
                                    "one: True")


@pytest.mark.slow
def test_the_strategies_page_trains_reports_and_reshards():
    out = run(snippet("Strategies"))
    assert "per device vs" in out and re.search(r"^loss \d+\.\d{3}; resharded to tp: [\d,]+ bytes per "
                                                r"device$", out, re.M)


def test_trackers_page_logs_to_mlflow_and_reads_it_back(tmp_path):
    out = run(snippet("Trackers"), cwd=tmp_path)
    pairs = re.findall(r"\((\d+), (\d+\.\d+)\)", out.splitlines()[-1])
    assert [int(step) for step, _ in pairs] == [1, 5, 10, 15, 20] and float(pairs[-1][1]) < float(pairs[0][1])


@pytest.mark.slow
def test_a_model_of_ones_own_built_from_the_blocks_trains_under_pp_tp_and_context():
    code = snippet("Pipelines and long sequences: `LayerStack` and `Attention`")
    model = code.split("def loss_fn", 1)[0]
    assert len(model.strip().splitlines()) <= 50, "the model the docs show stays short"
    code += "\nassert trainer.parallel.mesh.shape['context'] == 4\n"
    out = run(code)
    printed = re.findall(r"^(\w+) on (\S+): loss (\d+\.\d\d) -> (\d+\.\d\d)$", out, re.M)
    assert [(strategy, mesh) for strategy, mesh, _, _ in printed] == [("pp_tp", "stage=2,data=2,model=2"),
                                                                     ("dp", "data=2,context=4")]
    assert all(float(last) < 0.6 * float(first) for _, _, first, last in printed), printed
    assert ("pipeline: 2 stages x 2 microbatches" in out
            and "context: each sequence split 4 ways over context" in out)


@pytest.mark.slow
def test_fine_tuning_a_hugging_face_model(tmp_path):
    out = run(snippet("Fine-tune a Hugging Face model"), cwd=tmp_path)
    assert out.splitlines()[-2].startswith("loaded 2 layers, read ")
    assert out.splitlines()[-1] == "as stored: bfloat16, held as bfloat16"
    assert (sorted(p.name for p in (tmp_path / "tiny-llama-again").iterdir())
            == ["config.json", "model.safetensors"])


BASH_BLOCK = re.compile(r"(?P<mark><!-- not run: [^\n]*-->\n)?```bash\n(?P<code>.*?)```", re.S)
# the guides' chain: these pages' shell blocks, run in this order as a user types them
CHAIN = [ROOT / "docs/fine-tuning.md", ROOT / "docs/generation.md"]


def shell_blocks(page):
    return list(BASH_BLOCK.finditer(page.read_text()))


def test_every_shell_block_is_run_as_written_or_says_why_not():
    for page in PAGES:
        for block in shell_blocks(page):
            assert page in CHAIN or block["mark"], (page.name, block["code"][:200])
    # each chain page runs one block, its first; any other says why not
    assert [[bool(block["mark"]) for block in shell_blocks(page)][:1] for page in CHAIN] == [[False], [False]]
    assert [sum(not block["mark"] for block in shell_blocks(page)) for page in CHAIN] == [1, 1]


@pytest.mark.slow
def test_the_guides_chain_runs_as_written_on_the_readme_machine(tmp_path):
    """Train the default run, export it, fine-tune it with LoRA on one's own text, export the
    adapters and the merged model, fine-tune that in full, and generate from each: every
    command of the guides, exactly as the pages write them. The exports are what transformers
    and peft read (the same logits as shardax's), with the run's own tokenizer."""
    from cli_helpers import subprocess_env

    lines = [line for page in CHAIN for line in shell_blocks(page)[0]["code"].splitlines() if line.strip()]
    outputs = {}
    for line in lines:
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                              env=subprocess_env())
        assert done.returncode == 0, (line, done.stderr[-2000:])
        stderr = done.stderr
        if "--data python-pairs" in line:  # held out, DPO stays at chance at this size, and says so
            warning = ("nats/pair is not below the policy = reference baseline 0.6931 nats/pair; train "
                       "longer or raise --lr")
            stderr = "".join(row for row in stderr.splitlines(keepends=True)
                             if not (row.startswith("warning: validation loss ") and warning in row))
        assert "Traceback" not in stderr and "warning:" not in stderr, (line, stderr[-2000:])
        outputs[line] = done.stdout
    default = next(out for line, out in outputs.items()
                   if line.startswith("shardax train --run-dir runs/tiny"))
    assert "shardax train: 0.92M parameters" in default and "to train further:" in default
    lora = next(out for line, out in outputs.items() if "--lora-rank 8" in line)
    assert "model: fine-tuning the Hugging Face checkpoint" in lora and "step     50" in lora
    chat = next(out for line, out in outputs.items() if "--data python-chats" in line)
    assert "conversations" in chat and "rendered with shardax's built-in chat template" in chat
    dpo = next(out for line, out in outputs.items() if "--data python-pairs" in line)
    assert "preference pairs" in dpo and "reward_accuracy" in dpo and "the chat template of" in dpo
    reply = next(out for line, out in outputs.items() if "--chat" in line)
    assert reply.strip() and "<|end|>" not in reply  # the reply alone, its end of turn left out
    generated = [out for line, out in outputs.items()
                 if line.startswith("shardax generate") and "--chat" not in line]
    assert generated[0].startswith("def main(") and generated[1].startswith("def main(")
    assert generated[2].startswith("import json") and "\nclass" in generated[2]
    check = textwrap.dedent("""
        import numpy as np, peft, torch, transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained("tiny-hf")
        tokens = tokenizer("def main():\\n    return 0\\n")["input_ids"]
        def logits(model):
            with torch.no_grad():
                return model.eval()(torch.tensor([tokens])).logits.numpy()
        merged = logits(transformers.AutoModelForCausalLM.from_pretrained("tiny-tuned"))
        base = transformers.AutoModelForCausalLM.from_pretrained("tiny-hf")
        adapted = logits(peft.PeftModel.from_pretrained(base, "tiny-adapters"))
        import shardax
        shardax.simulate_cpu_devices(8)
        import jax
        from shardax import hf
        ours = np.asarray(jax.jit(lambda model, t: model(t))(hf.load("tiny-tuned", "data=8", "fsdp").model(),
                                                            np.array([tokens])))
        scale = np.abs(ours).max()
        print(len(tokens), float(np.abs(adapted - merged).max() / scale),
              float(np.abs(ours - merged).max() / scale))
    """)
    count, peft_error, shardax_error = run(check, cwd=tmp_path).split()
    assert int(count) > 4 and float(peft_error) < 1e-4 and float(shardax_error) < 1e-4


@pytest.mark.slow
def test_the_layout_picture_is_drawn_from_the_arrays(tmp_path):
    """docs/layouts.py lays a model out under each strategy and draws its shards."""
    result = subprocess.run([sys.executable, str(ROOT / "docs/layouts.py"), str(tmp_path / "layouts.png")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "layouts.png").read_bytes()[:4] == b"\x89PNG"


def test_the_benchmarks_page_shows_the_table_the_results_make():
    """docs/benchmarks.md's last section and benchmarks/results/README.md are the table built from
    the JSON results as they are now (``python benchmarks/run_all.py --table-only`` writes both)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    table = run_all.table()
    assert (ROOT / "benchmarks" / "results" / "README.md").read_text() == table
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page.endswith(run_all.TABLE_HEADING + table), (
        "docs/benchmarks.md's table is not the results' table: run python benchmarks/run_all.py --table-only")
