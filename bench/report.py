"""The one way a benchmark script hands in its section: print it, write it under bench/results/."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_section(report: str, out: str | None, name: str) -> str:
    """Print ``report`` and write it to ``out`` (default ``bench/results/NAME``); the path."""
    print(report)
    out = out or os.path.join(RESULTS, name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(report)
    return out
