"""A run's default directory: each run started gets its own, however many start at once, and a run
refused before it writes leaves none."""

import re
import threading

from shardax.cli import main
from shardax.lm import rundir


def test_runs_started_in_the_same_second_each_get_their_own_directory(tmp_path, monkeypatch):
    """A sweep launched from a shell loop: eight runs claim a name in the same second, at once."""
    monkeypatch.setenv("SHARDAX_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(rundir.time, "time", lambda: 1_790_000_000.25)
    start, claimed = threading.Barrier(8), []

    def start_a_run() -> None:
        start.wait()
        claimed.append(rundir.run_directory(None, "fsdp", None, None, False).path)

    runs = [threading.Thread(target=start_a_run) for _ in range(8)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(set(claimed)) == 8 and all(path.is_dir() for path in claimed)
    names = sorted((p.name for p in claimed), key=lambda name: (len(name), name))
    stamp = re.fullmatch(r"(\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d)_fsdp", names[0]).group(1)
    assert names == [f"{stamp}_fsdp"] + [f"{stamp}_fsdp-{n}" for n in range(2, 9)]


def test_a_run_refused_before_it_writes_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDAX_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "text.txt").write_text("some text to train on " * 20)
    assert main(["train", "--steps", "0", "--data", str(tmp_path / "text.txt")]) == 2
    assert "--steps 0 must be at least 1" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]
