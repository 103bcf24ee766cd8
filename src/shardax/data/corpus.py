"""A byte-level corpus: every byte is a token (vocabulary 256), no tokenizer to download.

The default corpus is the Python standard library's own source, which ships with every Python.
Files are split into train and validation by a stable hash of their path, so the split does
not depend on the order files are listed in or on which machine reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shardax.errors import UsageError

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".csv",
                 ".html", ".xml", ".c", ".h", ".js", ".ts", ".sh", ".tex"}
SEPARATOR = b"\n\n"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation bytes, plus what was read and what was skipped (and why)."""

    train: np.ndarray  # uint8
    validation: np.ndarray  # uint8
    files: int
    skipped: tuple[str, ...]
    source: str

    def unigram_entropy(self) -> float:
        """Nats per byte of the best model that ignores context (the baseline to beat)."""
        counts = np.bincount(self.train, minlength=256).astype(np.float64)
        probabilities = counts[counts > 0] / counts.sum()
        return float(-(probabilities * np.log(probabilities)).sum())


def default_sources() -> list[Path]:
    """The standard library's ``.py`` files (tests, site-packages and IDLE left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not excluded & set(p.relative_to(root).parts))


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UsageError(f"--data {str(given)!r} does not exist; give text files or folders of them")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise UsageError(
                    f"--data folder {str(given)!r} holds no text files (looked for "
                    f"{', '.join(sorted(TEXT_SUFFIXES))}); point --data at files or folders of text, or run "
                    "shardax prepare on other formats"
                )
            files.extend(found)
        else:
            files.append(path)
    return files


def _read(path: Path) -> tuple[bytes | None, str]:
    """The file's bytes, or None and the reason it was skipped."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return None, f"{path}: unreadable ({error.strerror or error})"
    if b"\x00" in data[:8192]:
        return None, f"{path}: binary (contains NUL bytes)"
    return data, ""


def _is_validation(path: Path, fraction: float) -> bool:
    digest = hashlib.sha1(path.name.encode() + str(path.parent.name).encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < fraction


def load_corpus(paths: Sequence[str | Path] | None = None, *, validation_fraction: float = 0.05,
                min_bytes: int = 0) -> Corpus:
    """Read ``paths`` (files or folders; default: the standard library) into a byte corpus.

    Binary, empty and unreadable files are skipped and listed; an input with no usable text,
    or less than ``min_bytes`` of training text, is a ``ValueError`` saying what was found.
    """
    files = default_sources() if not paths else _expand(paths)
    source = "the Python standard library" if not paths else ", ".join(str(p) for p in paths)
    train, validation, skipped = [], [], []
    for path in files:
        data, reason = _read(path)
        if data is None:
            skipped.append(reason)
            continue
        if not data.strip():  # an empty __init__.py: nothing to learn, nothing to report
            continue
        (validation if _is_validation(path, validation_fraction) else train).append(data)
    if skipped:
        # the header counts them
        logger.info("skipped %d of %d files: %s", len(skipped), len(files), "; ".join(skipped[:5]))
    if not train and not validation:
        raise UsageError(f"no usable text in --data {source} ({len(skipped)} files skipped: "
                         f"{'; '.join(skipped[:3])}); give UTF-8 text files")
    if not train or not validation:  # one file, or an unlucky split: hold out the tail instead
        text = SEPARATOR.join(train + validation)
        cut = int(len(text) * (1 - max(validation_fraction, 0.1)))
        train, validation = [text[:cut]], [text[cut:]]
    train_bytes = np.frombuffer(SEPARATOR.join(train), np.uint8)
    if train_bytes.size < min_bytes:
        raise UsageError(
            f"--data {source} has {train_bytes.size} bytes of training text, fewer than the {min_bytes} "
            "that one batch needs; give more text, or lower --seq-len / --batch-size"
        )
    return Corpus(train_bytes, np.frombuffer(SEPARATOR.join(validation), np.uint8), len(files) - len(skipped),
                  tuple(skipped), source)
