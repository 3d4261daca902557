"""Tests that need a TPU chip: skipped on every other backend (CI has none).

On the chip: ``JAX_PLATFORMS=tpu python3 -m pytest -q tests/tpu`` (the suite's conftest would
otherwise pin the CPU); the README's TPU section names this command and BENCHMARKS.md keeps the
chip's output.
"""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "tpu":
        return
    skip = pytest.mark.skip(reason="needs a TPU (jax.default_backend() is not 'tpu')")
    for item in items:
        if "tests/tpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_matmul_precision():
    """The suite's conftest asks for "highest" matmul precision (fp32 comparisons on the CPU);
    Mosaic refuses that contract precision on bf16 operands ("Bad lhs type"), and no training
    run sets it: the chip's tests run at jax's default precision."""
    with jax.default_matmul_precision("default"):
        yield
