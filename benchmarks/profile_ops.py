"""The ops a compiled step spends its device time in, read from a JAX profiler trace.

    from profile_ops import profile_top_ops
    rows = profile_top_ops(lambda: step_once(), compiled.as_text(), steps=3, top=5)

It runs the step under ``jax.profiler.trace`` (with a Perfetto trace), sums the duration of
every event that names an HLO instruction (``hlo_op``), and returns the largest, each with its
share of the total, the number of times it ran per step, and the JAX operation it came from
(the instruction's ``op_name`` metadata in the compiled program). On a GPU only the device's
own timelines count (kernels, not their launches on the host; a kernel the trace does not tie
to an instruction counts under its own name); on a CPU, XLA's thunks, less the time
collectives spend waiting for the other devices.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax

WAITING = ("Rendezvous", "Wait")


def _op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the ``op_name`` of its metadata (for a fusion, of its last op)."""
    bodies = {}
    for match in re.finditer(r"^%?(\S+) \([^\n]*\{\n(.*?)\n\}", hlo_text, re.M | re.S):
        bodies[match.group(1)] = match.group(2)
    names = {}
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%(\S+) = .*?(?:calls=%(\S+?)[,}\s]|$)", line)
        if not found:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        if op is None and found.group(2) in bodies:
            inner = re.findall(r'op_name="([^"]*)"', bodies[found.group(2)])
            op = inner[-1] if inner else None
        else:
            op = op.group(1) if op else None
        if op:
            names[found.group(1)] = op
    return names


def _trace_events(directory: str) -> list[dict[str, Any]]:
    paths = sorted(glob.glob(f"{directory}/plugins/profile/*/perfetto_trace.json.gz"))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no Perfetto trace under {directory}")
    with gzip.open(paths[-1]) as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def top_ops_in_trace(directory: str, hlo_text: str, steps: int, top: int | None = 5) -> list[dict[str, Any]]:
    events = _trace_events(directory)
    devices = {event["pid"] for event in events
               if event.get("ph") == "M" and event.get("name") == "process_name"
               and "/device:" in str(event.get("args", {}).get("name", "")) and "CPU" not in
               str(event.get("args", {}).get("name", ""))}
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    kernels: dict[str, str] = {}
    for event in events:
        if event.get("ph") != "X" or (devices and event["pid"] not in devices):
            continue
        # a device's kernels name their HLO instruction where the trace says it, else by themselves
        op = event.get("args", {}).get("hlo_op") or (event["name"] if devices else None)
        if not op:
            continue
        if any(event["name"].startswith(word) for word in WAITING):
            continue
        totals[op] += event.get("dur", 0.0)
        counts[op] += 1
        kernels.setdefault(op, event["name"])
    whole = sum(totals.values()) or 1.0
    names = _op_names(hlo_text)
    per_device = max(1, len({event.get("args", {}).get("device_ordinal") for event in events
                             if event.get("args", {}).get("hlo_op")} - {None})) if not devices else 1
    return [{"hlo_op": op, "kernel": kernels[op], "jax_op": names.get(op, ""), "share": seconds / whole,
             "ms_per_step": seconds / 1e3 / steps / per_device,
             "runs_per_step": counts[op] / steps / per_device}
            for op, seconds in totals.most_common(top)]


def profile_top_ops(run_step: Callable[[], Any], hlo_text: str, steps: int = 3,
                    top: int | None = 5) -> list[dict[str, Any]]:
    """Profile ``steps`` calls of ``run_step`` (already compiled and warm) and return the ``top``
    ops (``None``: all of them)."""
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(run_step())
        return top_ops_in_trace(directory, hlo_text, steps, top)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def compute_by_kind(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Milliseconds per device per step by kind of instruction (its name less the number), the
    collectives left out (on a CPU their time is mostly waiting for the other devices)."""
    kinds: collections.Counter = collections.Counter()
    for row in rows:
        kind = re.sub(r"\.\d+$", "", row["hlo_op"])
        if not kind.startswith(COLLECTIVES):
            kinds[kind] += row["ms_per_step"]
    return dict(kinds.most_common())


def markdown(rows: list[dict[str, Any]]) -> str:
    return "; ".join(f"{row['hlo_op']} ({row['jax_op'].split('/')[-1] or row['kernel']}) "
                     f"{100 * row['share']:.1f}%"
                     for row in rows)


if __name__ == "__main__":  # a self-check on whatever device is here
    import jax.numpy as jnp

    matrix = jnp.ones((512, 512))
    step = jax.jit(lambda m: jnp.tanh(m @ m) @ m)
    step(matrix).block_until_ready()
    rows = profile_top_ops(lambda: step(matrix), step.lower(matrix).compile().as_text())
    print(json.dumps(rows, indent=1))
    print(Path(__file__).name, "ok")
