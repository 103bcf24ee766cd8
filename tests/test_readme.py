"""The README's Python quick start runs as written, in a fresh interpreter."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs():
    text = README.read_text()
    quick_start = text.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", quick_start, re.S).group(1)
    assert len(code.strip().splitlines()) <= 25
    code += "\nassert float(loss) > 0 and loss.sharding.is_fully_replicated\nprint('ok', float(loss))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok ")
