"""Eight fake CPU devices for every test; set before jax is first imported."""

import os

# Backend optimisation level 0 and the CPU's loop emitters instead of its fusion emitters only
# change code generation on the CPU (the HLO, its shardings and collectives are the same) and
# cut compile time, which dominates these tests, by about 2x and then 1.3-3x.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
# torch (transformers, TRL, peft: the references) on one thread: two test workers share two
# cores, and torch's threads fought each other (16 greedy tokens of a tiny model: 2.5 s, 0.2 s on one)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# jax's persistent compilation cache, one per test session: tests (and the command-line runs
# they start, which inherit the environment) that build the same program compile it once.
# The process that makes it (pytest's controller under xdist; its workers inherit the variable)
# removes it when it exits: each session's cache is ~160 MB, and /tmp kept every one of them.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardzoo-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _snapshot(path) -> dict:
    """Every file under ``path`` (relative name) with the sha256 of its bytes."""
    import hashlib

    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture(scope="session")
def snapshot():
    """``snapshot(path)``: every file under ``path`` with the sha256 of its bytes (to show that a
    failed command left a run directory byte for byte as it was)."""
    return _snapshot
