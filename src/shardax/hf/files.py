"""safetensors files: read lazily by slice, written whole, and a directory written as a whole."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.errors import UsageError

DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", jnp.bfloat16), "float16": ("F16", np.float16)}


class SafeTensors:
    """The tensors of a model directory by name, read a slice at a time (and the bytes read)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError):
                raise UsageError(f"{index} is unreadable or lacks weight_map; give a Hugging Face model "
                                 "directory") from None
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            raise UsageError(f"{path} holds neither model.safetensors nor model.safetensors.index.json; give "
                             "a Hugging Face model directory saved with safetensors")
        self.files: dict[str, Any] = {}  # open handles (each maps its file; ``release`` lets them go)
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            try:
                handle = safe_open(str(path / name), framework="flax")
            except FileNotFoundError:
                raise UsageError(f"{path / name} is missing (the index names it); download the whole "
                                 "checkpoint again") from None
            except Exception as error:  # safetensors' own error for a damaged header
                raise UsageError(f"{path / name} is not a readable safetensors file ({error}); download it "
                                 "again") from None
            for key in handle.keys():
                self.where[key] = name
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())
        if weight_map is not None:
            absent = [key for key, name in weight_map.items() if self.where.get(key) != name]
            if absent:
                raise UsageError(f"{path / weight_map[absent[0]]} lacks {absent[0]}, which the index places "
                                 "there; download the checkpoint again")
        self.bytes_read = 0

    def close(self) -> None:
        self.release()

    def release(self) -> None:
        """Unmap the files: the pages a read touched stop counting in this process's memory."""
        self.files = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, rows: slice, columns: slice | None = None) -> np.ndarray:
        """``tensor[rows, columns]`` (``columns`` None: a vector) in the file's dtype (bfloat16 as
        ``ml_dtypes``' numpy type); whoever places it casts it."""
        from safetensors import safe_open

        file = self.where[name]
        if file not in self.files:
            self.files[file] = safe_open(str(self.path / file), framework="flax")
        part = self.files[file].get_slice(name)
        block = part[rows] if columns is None else part[rows, columns]
        array = np.asarray(block)
        self.bytes_read += array.nbytes
        return array


def give_back_freed_memory() -> None:
    """Return the host memory freed while reading a weight to the system (glibc keeps freed heap
    memory for reuse otherwise, and it would count against the process until the load ends)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass




def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], Any]], dtype: str) -> None:
    """A safetensors file written a tensor at a time (the header first: every shape is known).
    ``entries``: (name, shape, a function giving the tensor)."""
    code, numpy_dtype = DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * np.dtype(numpy_dtype).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for _, _, produce in entries:
            file.write(np.ascontiguousarray(produce(), dtype=numpy_dtype).tobytes())


def check_output(out: Path, dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"dtype={dtype!r}; use one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not an empty directory; choose a new directory to "
                         "save in")


def begin_write(out: Path) -> tuple[bool, Path]:
    """(whether this process writes, the directory it writes into before it becomes ``out``)."""
    writing = jax.process_index() == 0
    partial = out.with_name(out.name + ".partial")
    if writing:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    return writing, partial


def finish_write(writing: bool, partial: Path, out: Path) -> Path:
    if writing:
        if out.exists():
            out.rmdir()
        partial.rename(out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("shardax: Hugging Face checkpoint saved")
    return out
