"""Samples drawn during a run: a hook every N steps, its images written as a PNG grid.

``fit(samples=draw, sample_every=100, samples_dir="runs/gan/samples")`` calls
``draw(model, step)`` every 100 steps and at the end, on every process (the model's arrays are
global: sampling may be a compiled program over them). ``model`` is the trained model in eval
mode, holding the moving average of its weights when its optimizer keeps one
(``shardax.ema_params``); for a run of parts, a dict of the parts by name. ``draw`` returns
images with values in [0, 1], shaped ``(count, height, width)`` or ``(count, height, width,
channels)`` with 1, 3 or 4 channels, or a dict of such batches by name. Process 0 writes each
batch as one grid, ``<samples_dir>/<name>_step_000100.png``, and hands it to the trackers
(TensorBoard, MLflow and W&B images under ``samples/<name>``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shardax.errors import UsageError

SampleFn = Callable[[Any, int], Any]


def image_batches(output: Any) -> dict[str, np.ndarray]:
    """``draw``'s output as ``{name: (count, height, width, channels) float array}``, refused in one line
    unless it is images in [0, 1]."""
    named = dict(output) if isinstance(output, Mapping) else {"samples": output}
    batches = {}
    for name, images in named.items():
        array = np.asarray(images, np.float32)
        if array.ndim == 3:
            array = array[..., None]
        if array.ndim != 4 or array.shape[-1] not in (1, 3, 4) or not array.size:
            raise UsageError(f"samples returned {name!r} of shape {np.shape(images)}; return images as "
                             "(count, height, width) or (count, height, width, channels) with 1, 3 or 4 "
                             "channels")
        if not np.all(np.isfinite(array)) or array.min() < -1e-3 or array.max() > 1 + 1e-3:
            raise UsageError(f"samples returned {name!r} with values from {np.nanmin(array):.3g} to "
                             f"{np.nanmax(array):.3g}; return values in [0, 1] (e.g. (x + 1) / 2 for tanh "
                             "outputs)")
        batches[str(name)] = np.clip(array, 0.0, 1.0)
    return batches


def grid(images: np.ndarray, padding: int = 1) -> np.ndarray:
    """``(count, height, width, channels)`` images tiled into one nearly square image (uint8),
    separated by ``padding`` pixels of white."""
    count, height, width, channels = images.shape
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    canvas = np.ones((rows * (height + padding) + padding, columns * (width + padding) + padding, channels),
                     np.float32)
    for index, image in enumerate(images):
        top, left = (padding + (index // columns) * (height + padding),
                     padding + (index % columns) * (width + padding))
        canvas[top:top + height, left:left + width] = image
    return np.round(canvas * 255).astype(np.uint8)


def write_grid(directory: Path, name: str, step: int, image: np.ndarray) -> Path:
    """``image`` (a uint8 grid) as ``<directory>/<name>_step_<step>.png``, in its own mode: grey
    (one channel), RGB or RGBA."""
    from PIL import Image  # matplotlib's own dependency

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}_step_{step:06d}.png"
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)
    return path


def check_samples(samples: Any, sample_every: int, samples_dir: str | None, samples_path: str | None) -> None:
    """Refuse, in one line, a hook that cannot run or has nowhere to write (``samples_path``: the
    folder it writes to, ``samples_dir`` or the run directory's)."""
    if samples is None:
        if sample_every or samples_dir is not None:
            raise UsageError("sample_every/samples_dir were given without samples=draw(model, step) -> "
                             "images; give the function that draws them")
        return
    if not callable(samples):
        raise UsageError(f"samples is a {type(samples).__name__}; give a function draw(model, step) -> "
                         "images in [0, 1]")
    if samples_path is None:
        raise UsageError("samples= needs a place for its PNG grids: give run_dir=DIR (they go to "
                         "DIR/samples) or samples_dir=DIR")
