"""The HBM a TPU step needs, as XLA:TPU itself counts it: its buffer assignment's heap.

XLA:TPU's ``memory_analysis()`` estimates a program's temporaries, and the estimate runs high:
25-32% above the heap its buffer assignment reserves for a step under dp. The heap is what
XLA:TPU checks against the chip when it compiles, so it is what fits or not. Compiled for a
v5e-8 (16 GB a chip), a 3-layer, 320-wide model's dp step at a batch whose memory analysis
counts 21 GB compiles; at a batch 25% larger XLA:TPU refuses with "the total memory required
for HLO temporaries (18.60G) exceeds available HBM (15.75G)", GiB that are that batch's heap,
not its estimate (docs/plan.md has the figures).

libtpu writes each program's buffer assignment into a folder when it starts with
``--xla_jf_dump_to`` (category ``misc`` is that one file, about 100 KB). shardax starts libtpu
so when it first describes a TPU slice (:mod:`shardax.analysis.targets`) and reads the heap
after each compile. Where libtpu was started otherwise (JAX's TPU backend started it first, or
``LIBTPU_INIT_ARGS`` names a dump folder of its own), or a compile came from JAX's compilation
cache, the heap is unknown: the memory analysis stands in, and a warning says so.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
import warnings
import weakref
from typing import Any

import jax

_folder: str | None = None
_heaps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), preallocated-temp:", re.MULTILINE)
_ON_CHIP = re.compile(r"^allocation \d+: size (\d+), color \d+, preallocated-temp:", re.MULTILINE)


def libtpu_flags() -> str:
    """``LIBTPU_INIT_ARGS`` that make libtpu write each program's buffer assignment into a
    folder of this process's own (removed when it exits)."""
    global _folder
    if _folder is None:
        _folder = tempfile.mkdtemp(prefix="shardax-buffer-assignments-")
        atexit.register(shutil.rmtree, _folder, True)
    return f"--xla_jf_dump_to={_folder} --xla_jf_dump_category_filter=misc --xla_jf_dump_llo_text=false"


def heap_bytes(buffer_assignment: str) -> int:
    """The preallocated temporaries of the default memory space, HBM (an allocation with a
    ``color`` is in another space, such as the chip's on-chip memory)."""
    return sum(int(size) for size in _ALLOCATION.findall(buffer_assignment))


def on_chip_bytes(buffer_assignment: str) -> int:
    """The temporaries XLA:TPU keeps in the chip's own memories (the allocations with a color:
    memory space 1 on v5e, v5p and v6e, 3 on v4, and a few KB in others), not HBM."""
    return sum(int(size) for size in _ON_CHIP.findall(buffer_assignment))


def _take() -> tuple[int, int] | None:
    """(HBM heap, on-chip temporaries) of the program compiled last, from the buffer assignments
    written since the previous call (which are then removed); None when there are none."""
    if _folder is None:
        return None
    paths = sorted(glob.glob(os.path.join(_folder, "*buffer-assignment.txt")), key=os.path.getmtime)
    found = None
    if paths:
        with open(paths[-1]) as file:
            text = file.read()
        found = heap_bytes(text), on_chip_bytes(text)
    for path in paths:
        os.remove(path)
    return found


def compile_with_heap(lowered: Any, compiler_options: dict[str, Any] | None = None) -> Any:
    """``lowered.compile(...)``, noting XLA:TPU's heap for :func:`hbm_heap` where libtpu wrote it."""
    _take()  # what earlier compiles left
    compiled = lowered.compile(compiler_options=compiler_options)
    found = _take()
    if found is not None:
        _heaps[compiled] = found
    elif _for_tpu(compiled):
        warnings.warn("XLA:TPU's heap is unknown for this step (libtpu started before shardax described a "
                      "TPU target, or LIBTPU_INIT_ARGS has its own --xla_jf_dump_to, or the compile was "
                      "cached): its memory is XLA's memory analysis, an estimate that runs higher; describe "
                      "the target (shardax.analysis.targets.parse_target(...).devices()) before anything "
                      "else uses JAX",
                      stacklevel=3)
    return compiled


def _for_tpu(compiled: Any) -> bool:
    shardings = jax.tree.leaves(compiled.input_shardings)
    return bool(shardings) and next(iter(shardings[0].device_set)).platform == "tpu"


def hbm_heap(compiled: Any) -> int | None:
    """XLA:TPU's HBM heap for a program compiled by :func:`compile_with_heap`, if known."""
    found = _heaps.get(compiled)
    return None if found is None else found[0]


def on_chip_heap(compiled: Any) -> int | None:
    """The temporaries XLA:TPU keeps in the chip's own memory for such a program, if known."""
    found = _heaps.get(compiled)
    return None if found is None else found[1]
