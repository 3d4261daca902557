"""glibc's malloc told to keep the memory a process frees, for XLA:CPU's steps (standard library only).

XLA:CPU allocates a step's temporary buffers afresh every step, hundreds of MB for a small Llama
(the layer scan's stacked residuals among them). glibc serves a block that large with ``mmap``
(above 32 MB always; in a thread's own arena, whatever its size) and unmaps it when freed, so the
next step touches fresh pages again: 160,000 page faults and 0.3 CPU s of a 3.1 s train step of
``bench/bench_cpu.py``'s Llama, charged to whichever op writes the buffer first (the zero fill of
the scan's stacks; BENCHMARKS.md, the CPU section). One arena, no ``mmap``'d blocks and no
trimming keep what a step frees for the next one: no page faults after the first step, the
numbers unchanged. The process keeps its peak heap until it ends.

``python -m shardzoo`` applies it before jax starts (``__main__.py``), where jax has no
accelerator plugin to use; it must come before jax's threads exist (a thread keeps the arena it
took) and leaves alone a process whose malloc the user has set (``GLIBC_TUNABLES``,
``MALLOC_ARENA_MAX``, ...).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
KEEP = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim
# plugins through which jax would run on a TPU or GPU rather than the CPU
ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def cpu_only() -> bool:
    """Whether jax will run on the CPU: ``JAX_PLATFORMS=cpu``, or no accelerator plugin installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) for name in ACCELERATOR_PLUGINS)


def user_set_malloc() -> bool:
    """Whether the environment already configures glibc's malloc."""
    return "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in os.environ)


_applied = False


def keep_freed_memory() -> bool:
    """Apply ``KEEP`` with ``mallopt`` on Linux with glibc, when jax will run on the CPU and the
    user has not set malloc up; whether it was applied."""
    global _applied
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc" or user_set_malloc() or not cpu_only():
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    _applied = all(mallopt(param, value) == 1 for param, value in KEEP)
    return _applied


def setting() -> str:
    """What this process's malloc does, as a run records it (run.json's ``host_malloc``)."""
    return "keeps freed memory (one arena, no mmap, no trim)" if _applied else "default"
