"""safetensors files: read lazily by slice, written whole, and a directory written as a whole."""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.errors import UsageError

DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", jnp.bfloat16), "float16": ("F16", np.float16)}


class SafeTensors:
    """The tensors of a model directory by name, each readable as a view onto its file (the bytes
    that views' slices read are counted in ``bytes_read``)."""

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
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.places: dict[str, tuple[int, Any]] = {}  # where each tensor's bytes begin in its file, its dtype
        for name in files:
            try:  # safetensors checks the file (its header, and that the data is all there)
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
            del handle
            self.places.update(_data_places(path / name))
        if weight_map is not None:
            absent = [key for key, name in weight_map.items() if self.where.get(key) != name]
            if absent:
                raise UsageError(f"{path / weight_map[absent[0]]} lacks {absent[0]}, which the index places "
                                 "there; download the checkpoint again")
        self.bytes_read = 0
        self._counting = threading.Lock()
        self._mapped = threading.local()  # each thread's tensors mapped since its last ``release``

    def close(self) -> None:
        self.release()

    def release(self) -> None:
        """Let go of the calling thread's mapped tensors: the file pages they touched stop counting
        in this process's memory once no slice of them is held."""
        self._mapped.tensors = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` in the file's dtype (bfloat16 as ``ml_dtypes``' numpy type), a read-only
        view onto the file: nothing is read until a slice of it is used. It stays mapped for the
        calling thread until ``release`` (the slices of several devices fault its pages in once)."""
        mapped = getattr(self._mapped, "tensors", None)
        if mapped is None:
            mapped = self._mapped.tensors = {}
        if name not in mapped:
            start, dtype = self.places[name]
            whole = np.memmap(self.path / self.where[name], dtype=dtype, mode="r", offset=start,
                              shape=self.shapes[name])
            mapped[name] = whole.view(np.ndarray)  # a plain array over the mapping (memmap slices slowly)
        return mapped[name]

    def block(self, name: str, rows: slice, columns: slice | None = None) -> np.ndarray:
        """``tensor(name)[rows, columns]`` (``columns``: all when None), counted as read. Whole rows
        are read in one positioned read into the calling thread's own buffer, which the next call
        reuses (from a cold disk, several times faster than faulting the mapping's pages in one at
        a time); a cut of the columns is taken from the mapping, which reads those bytes alone."""
        tensor = self.tensor(name)
        if columns is not None and (columns.start, columns.stop) != (0, tensor.shape[1]):
            return self.count(tensor[rows, columns])
        start, dtype = self.places[name]
        shape = (rows.stop - rows.start, *tensor.shape[1:])
        row_bytes = tensor.itemsize * math.prod(tensor.shape[1:])
        out = thread_buffer(_READS, math.prod(shape) * tensor.itemsize)
        view, read = memoryview(out), 0
        descriptor = os.open(self.path / self.where[name], os.O_RDONLY)
        try:
            while read < out.size:
                got = os.preadv(descriptor, [view[read:]], start + rows.start * row_bytes + read)
                if got == 0:
                    raise UsageError(f"{self.path / self.where[name]} ends inside tensor {name}; download "
                                     "the checkpoint again")
                read += got
        finally:
            os.close(descriptor)
        return self.count(out.view(dtype).reshape(shape))

    def count(self, block: np.ndarray) -> np.ndarray:
        """``block`` (a slice of a ``tensor``), its bytes counted as read; returns it."""
        with self._counting:
            self.bytes_read += block.nbytes
        return block


_READS = threading.local()  # each thread's buffer for reads


def new_memory(size: int) -> np.ndarray:
    """``size`` bytes of new, page-aligned host memory, given back when the last array over it
    goes. It is mapped in small pages: numpy asks for huge pages for its large arrays, and a
    first write to those can wait seconds while the kernel compacts memory for them (a 1B
    checkpoint's load took twice as long)."""
    if os.name != "posix":
        block = np.empty(size + 64, np.uint8)
        return block[-block.ctypes.data % 64:][:size]
    mapping = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, np.uint8)[:size]


def thread_buffer(where: threading.local, size: int) -> np.ndarray:
    """``size`` bytes of the calling thread's buffer in ``where`` (grown as needed; it lives as
    long as the thread: a load's readers end with it)."""
    buffer = getattr(where, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = where.buffer = np.empty(size, np.uint8)
    return buffer[:size]


# a safetensors dtype code: the numpy type a view of its bytes takes
FILE_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}


def _data_places(file: Path) -> dict[str, tuple[int, Any]]:
    """Where each tensor's bytes begin in a safetensors ``file`` and its dtype (the format: an
    8-byte little-endian header length, the JSON header, then the data)."""
    with file.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    places = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in FILE_DTYPES:
            raise UsageError(f"{file}: tensor {name} is of dtype {entry['dtype']}; shardax reads "
                             f"{', '.join(FILE_DTYPES)} weights")
        places[name] = (8 + length + entry["data_offsets"][0], FILE_DTYPES[entry["dtype"]])
    return places


def stored_dtype(path: Path) -> str:
    """``"bfloat16"`` where each weight of the checkpoint in ``path`` is stored as bfloat16 (read
    off its safetensors files' headers or, with no weights there, ``config.json``'s
    ``torch_dtype``), else ``"float32"``: the dtype in which a weight that never changes is
    kept as it is."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        dtypes = {dtype for file in files for _, dtype in _data_places(file).values()}
        return "bfloat16" if dtypes == {jnp.bfloat16} else "float32"
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    return "bfloat16" if raw.get("torch_dtype", raw.get("dtype")) == "bfloat16" else "float32"


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
