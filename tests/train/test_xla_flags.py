"""--xla-preset: named XLA flags reach XLA_FLAGS of the training process, before JAX starts."""

import json
import os
import platform
import subprocess
import sys

import jax
import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.train.xla_flags import XLA_PRESETS, XlaPresetError, apply_xla_preset, merged_flags

CHILD_ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.parametrize("preset", [p for p in XLA_PRESETS if XLA_PRESETS[p]])
def test_every_flag_of_every_preset_is_known_to_this_xla(preset):
    """XLA parses the GPU flags on CPU too and aborts on one it does not know (a flag removed
    from XLA, a typo): a fresh process with the preset's flags must start and compute."""
    env = dict(CHILD_ENV, XLA_FLAGS=merged_flags(preset), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import jax; print(float(jax.numpy.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr[-500:]


def test_flags_the_user_set_keep_their_values():
    user = "--xla_gpu_enable_pipelined_all_gather=false --xla_force_host_platform_device_count=2"
    flags = merged_flags("gpu-overlap", user).split()
    assert flags.count("--xla_gpu_enable_pipelined_all_gather=false") == 1
    assert not any(f == "--xla_gpu_enable_pipelined_all_gather=true" for f in flags)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert merged_flags("none", user) == user


def test_too_late_or_unknown_is_a_one_line_error(tmp_path, capsys):
    jax.devices()  # this process's JAX has started: XLA would silently ignore new flags
    with pytest.raises(XlaPresetError, match="already started"):
        apply_xla_preset("gpu-overlap", environ={})
    assert main(["train", "--out", str(tmp_path / "r"), "--model", "llama-tiny",
                 "--xla-preset", "fastest"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--xla-preset 'fastest'" in err and "gpu-overlap" in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_the_preset_reaches_the_training_process_and_run_json(tmp_path):
    """A fresh `shardzoo train`: the preset's flags and the user's own XLA_FLAGS both reach XLA
    (the user's device count shows in run.json's devices) and run.json records them."""
    rng = np.random.default_rng(0)
    path = tmp_path / "reg.jsonl"
    path.write_text("".join(json.dumps({"x": rng.normal(size=2).tolist(), "y": 1.0}) + "\n"
                            for _ in range(64)))
    env = dict(CHILD_ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "shardzoo", "train", "--out", str(tmp_path / "run"), "--data", str(path),
         "--model", "mlp-tiny-regression", "--override", "in_features=2", "--label-column", "y",
         "--steps", "2", "--batch-size", "8", "--eval-every", "0", "--rules", "dp",
         "--xla-preset", "gpu-overlap"],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run" / "run.json") as f:
        run = json.load(f)
    assert run["devices"] == 2
    flags = run["xla_flags"].split()
    assert set(XLA_PRESETS["gpu-overlap"]) <= set(flags)
    assert "--xla_force_host_platform_device_count=2" in flags
    assert run["settings"]["runtime"]["xla_preset"] == "gpu-overlap"
    # host_memory on jax's CPU: glibc's malloc keeps freed memory unless the environment sets malloc
    kept = (platform.libc_ver()[0] == "glibc" and "glibc.malloc" not in env.get("GLIBC_TUNABLES", "")
            and not any(k.startswith("MALLOC_") for k in env))
    assert run["host_malloc"] == ("keeps freed memory (one arena, no mmap, no trim)" if kept else "default")
