"""host_memory: glibc's malloc keeps what a process frees, so a big block freed and taken again by
a thread touches no fresh pages; applied only where jax runs on the CPU and malloc is unset."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from shardzoo import host_memory

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="glibc's mallopt")

# A thread (as XLA's) takes a 64 MB block, writes every page and frees it, three times: the
# page faults of the last two rounds (a fresh block: 16,384 of 4 KiB pages a round).
ROUNDS = textwrap.dedent("""
    import ctypes, resource, sys, threading
    from shardzoo import host_memory
    applied = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    faults = []
    def rounds():
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = libc.malloc(64 << 20)
            ctypes.memset(block, 1, 64 << 20)
            libc.free(ctypes.c_void_p(block))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    print(applied, sum(faults[1:]))
""")


def _faults(mode: str, env: dict) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0], int(out[1])


@glibc
def test_kept_memory_is_taken_again_without_page_faults():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    env["JAX_PLATFORMS"] = "cpu"
    applied, kept = _faults("keep", env)
    _, fresh = _faults("plain", env)
    assert applied == "True" and kept < 1000 and fresh > 2 * 16384 * 0.9, (kept, fresh)
    # the user's own malloc settings, or jax on an accelerator: left as they are
    assert _faults("keep", {**env, "MALLOC_ARENA_MAX": "4"})[0] == "False"
    assert _faults("keep", {**env, "JAX_PLATFORMS": "tpu"})[0] == "False"


def test_where_it_applies(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.cpu_only()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert host_memory.user_set_malloc() and not host_memory.keep_freed_memory()
