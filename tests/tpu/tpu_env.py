"""The environment of the child processes the TPU tests start (conftest's probe, test_train_tpu's runs)."""

import os
import re


def child_env() -> dict:
    """The environment of a child process that should see the chip: the TPU platform, without the
    fake CPU devices and the CPU-only compile shortcut tests/conftest.py adds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", JAX_PLATFORMS="tpu")
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+|--xla_backend_optimization_level=\S+", "",
                              os.environ.get("XLA_FLAGS", "")).strip()
    return env
