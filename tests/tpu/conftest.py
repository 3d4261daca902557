"""Tests that need a TPU chip: skipped on every other backend (CI has none).

On the chip: ``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu`` (the suite's conftest would
otherwise pin the CPU); the README's TPU section names this command and BENCHMARKS.md keeps the
chip's output.
"""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tpu_env import child_env  # noqa: E402

IN_CHILDREN = "test_train_tpu.py"  # its runs are child processes: they need the chip free


def _no_tpu() -> str | None:
    """Why there is no TPU here (None: there is one), asked in a child process so that this one
    holds no chip before the child-process runs; no libtpu (CI, a laptop): without starting jax."""
    if importlib.util.find_spec("libtpu") is None and os.environ.get("JAX_PLATFORMS") != "tpu":
        return "no libtpu and JAX_PLATFORMS is not tpu"
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           env=child_env(), capture_output=True, text=True, timeout=300)
    if probe.returncode == 0 and probe.stdout.strip().endswith("tpu"):
        return None
    return f"jax in a child process: {(probe.stderr.strip().splitlines() or [probe.stdout.strip()])[-1]}"


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if "tests/tpu/" in str(item.fspath).replace("\\", "/")]
    if not mine:
        return
    why = _no_tpu()
    if why:
        skip = pytest.mark.skip(reason=f"needs a TPU ({why})")
        for item in mine:
            item.add_marker(skip)
        return
    # the child-process runs first: a TPU is held by the first process that touches it, until it
    # exits, and the in-process kernel tests make this process that one
    items.sort(key=lambda item: IN_CHILDREN not in str(item.fspath))


@pytest.fixture(autouse=True)
def _default_matmul_precision():
    """The suite's conftest asks for "highest" matmul precision (fp32 comparisons on the CPU);
    Mosaic refuses that contract precision on bf16 operands ("Bad lhs type"), and no training
    run sets it: the chip's tests run at jax's default precision."""
    with jax.default_matmul_precision("default"):
        yield
