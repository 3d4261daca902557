"""The embedded default corpus: the Python standard library's own source files.

It exists on every machine that runs shardzoo, so the default training run needs no download.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import datasets
import pyarrow as pa

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
    """A ``datasets.Dataset`` with one ``text`` row per standard-library source file.

    Built from an Arrow table with its fingerprint given (a hash of the texts): ``from_dict``
    would fingerprint the new dataset by pickling its Python state with dill, which raised
    ``PicklingError: Can't pickle <class 'MonthDayNano'>`` under datasets 5.0.1 and pyarrow 25.
    """
    texts = [
        p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(max_files, max_bytes)
    ]
    digest = hashlib.sha256()
    for text in texts:
        digest.update(len(text).to_bytes(8, "little") + text.encode())
    return datasets.Dataset(pa.table({"text": pa.array(texts, pa.string())}),
                            fingerprint="stdlib-" + digest.hexdigest()[:32])
