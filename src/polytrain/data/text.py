"""A byte-level text corpus read from the Python standard library's own source files."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

from ..errors import ConfigError

__all__ = ["stdlib_corpus"]


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The bytes of the standard library's ``.py`` files in sorted path order, as uint8.

    Needs no download: every Python installation carries it. The order is fixed
    (sorted relative paths), so every process reads the same corpus.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        # Below the root: a Python installed under /home/test/ is not a test directory.
        if {"site-packages", "test"} & set(path.relative_to(root).parts):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size < 1 << 16:
        raise ConfigError(f"found only {size} bytes of Python source under {root}",
                          "use a Python installation with its standard library")
    raw = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
