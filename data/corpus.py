"""The embedded default corpus: the Python standard library's own source files.

It exists on every machine that runs shardzoo, so the default training run needs no download.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import datasets

MAX_FILES = 64
MAX_BYTES = 2 << 20  # 2 MiB: a few seconds to tokenize, thousands of rows at seq_len 256


def stdlib_files(max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES) -> list[Path]:
    """The first top-level ``*.py`` files of the standard library, sorted by name, within the bounds."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.glob("*.py")):
        size = path.stat().st_size
        if len(chosen) >= max_files or total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def stdlib_corpus(max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES) -> datasets.Dataset:
    """A ``datasets.Dataset`` with one ``text`` row per standard-library source file."""
    texts = [
        p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(max_files, max_bytes)
    ]
    return datasets.Dataset.from_dict({"text": texts})
