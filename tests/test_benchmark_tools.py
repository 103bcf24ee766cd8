"""The profile reader that benchmark 7 (MFU) uses to name the ops a step spends its time in."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

# In a process of its own: JAX's profiler records no CPU ops in a process that has loaded libtpu
# (which `shardax plan --target` tests do in the test workers), as benchmark 7 always runs alone.
PROFILE = f"""
import json, sys
import jax, jax.numpy as jnp
sys.path.insert(0, {str(BENCHMARKS)!r})
from profile_ops import profile_top_ops
big, small = jnp.ones((768, 768)), jnp.ones((768,))
step = jax.jit(lambda m, v: (jnp.tanh(m @ m) + v, v * 2.0))
jax.block_until_ready(step(big, small))
print(json.dumps(profile_top_ops(lambda: step(big, small), step.lower(big, small).compile().as_text(),
                                 steps=3, top=5)))
"""


def test_the_profile_names_the_matrix_product_as_the_op_that_takes_the_time():
    result = subprocess.run([sys.executable, "-c", PROFILE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])

    assert rows[0]["jax_op"].endswith("dot_general"), rows
    assert rows[0]["share"] > 0.5, rows
    assert rows[0]["runs_per_step"] == 1.0, rows
    assert sum(row["share"] for row in rows) <= 1.0 + 1e-9
    assert [row["share"] for row in rows] == sorted((row["share"] for row in rows), reverse=True)
