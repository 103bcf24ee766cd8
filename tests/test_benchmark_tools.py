"""The profile reader that benchmark 7 (MFU) uses to name the ops a step spends its time in."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from profile_ops import profile_top_ops  # noqa: E402


def test_the_profile_names_the_matrix_product_as_the_op_that_takes_the_time():
    big, small = jnp.ones((768, 768)), jnp.ones((768,))
    step = jax.jit(lambda m, v: (jnp.tanh(m @ m) + v, v * 2.0))
    jax.block_until_ready(step(big, small))

    rows = profile_top_ops(lambda: step(big, small), step.lower(big, small).compile().as_text(), steps=3, top=5)

    assert rows[0]["jax_op"].endswith("dot_general"), rows
    assert rows[0]["share"] > 0.5, rows
    assert rows[0]["runs_per_step"] == 1.0, rows
    assert sum(row["share"] for row in rows) <= 1.0 + 1e-9
    assert [row["share"] for row in rows] == sorted((row["share"] for row in rows), reverse=True)
