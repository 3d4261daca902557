"""``shardzoo train`` on a TPU as a user runs it: real processes, the chip's own memory.

Skipped unless a TPU is there. Run with the chip visible (tests/conftest.py makes the CPU the
default backend) and without ``-n`` (one process at a time may hold the chip):

    JAX_PLATFORMS=tpu python3 -m pytest -q -p no:cacheprovider tests/tpu

The backend is asked in a child process, and every run is one; conftest.py runs these first, before
the in-process kernel tests make this process hold the chip.
"""

import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from tpu_env import child_env  # noqa: E402


def _env():
    return child_env()


def _train(*flags, timeout=600):
    return subprocess.run([sys.executable, "-m", "shardzoo", "train", *flags], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _losses(stdout: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^step \d+: loss ([0-9.e+-]+)", stdout, re.M)]


def test_the_readme_main_job_trains_on_a_tpu(tmp_path):
    """The README's main job, its first steps: the embedded corpus loads (datasets 5.0.1 +
    pyarrow 25 once raised a PicklingError there), the plan gives the chip's verdict, the loss falls."""
    out = tmp_path / "demo"
    run = _train("--out", str(out), "--steps", "30", "--log-every", "5", "--eval-every", "0")
    assert run.returncode == 0, run.stderr[-4000:]
    assert re.search(r"^  device local TPU[^:]*: fits \(", run.stdout, re.M), run.stdout[-4000:]
    assert "no accelerator here" not in run.stdout
    losses = _losses(run.stdout)
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, losses


def test_tiny_bf16_run_chooses_its_remat_and_records_it(tmp_path):
    out = tmp_path / "tiny"
    run = _train("--out", str(out), "--model", "llama-tiny", "--override", "dtype=bfloat16", "--steps", "20",
                 "--batch-size", "16", "--seq-len", "128", "--log-every", "1", "--eval-every", "0")
    assert run.returncode == 0, run.stderr[-4000:]
    chosen = re.search(r"^remat auto: (\w+), the first of none, ", run.stdout, re.M)
    assert chosen, run.stdout[-4000:]
    losses = _losses(run.stdout)
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses
    recorded = json.loads((out / "run.json").read_text())
    assert recorded["settings"]["model"]["remat"] == chosen.group(1)  # the policy, never "auto"
    assert recorded["config"]["execution"]["remat_policy"] == chosen.group(1)
    print(run.stdout)  # the run's whole output, in pytest -rA's report of what passed


def test_a_step_larger_than_the_chip_is_one_line_and_writes_nothing(tmp_path):
    """llama3.2-1b with float32 params, gradients and adam state needs ~19.8 GB before any
    activation, more than the chip's 15.75 GB whatever XLA rematerializes (this test's first
    choice, qwen2.5-0.5b at 16 x 2048 without remat, trained to the end on v5e on 2026-12-07 since
    splash and the tiled loss). The user sees one line, not a RESOURCE_EXHAUSTED traceback, and no
    --out. On v5e (2026-12-07, as auto) every policy, full too, ran out of memory: "it needs more
    than it (remat none out of memory, ..., remat full out of memory), one device has 16.91 GB ...:
    try a smaller --batch-size (now 16) or --seq-len (now 2048), --override param_dtype=bfloat16
    (params and optimizer state in half the bytes), ..." """
    out = tmp_path / "too-big"
    run = _train("--out", str(out), "--model", "llama3.2-1b", "--override", "dtype=bfloat16", "--remat", "none",
                 "--batch-size", "16", "--seq-len", "2048", "--steps", "2")
    errors = [line for line in run.stderr.splitlines() if line.startswith("shardzoo train: error: ")]
    assert run.returncode == 2, run.stderr[-4000:]
    assert len(errors) == 1 and errors[0].startswith("shardzoo train: error: the train step does not fit one "
                                                     "device: it needs "), run.stderr[-4000:]
    for word in ("Traceback", "RESOURCE_EXHAUSTED"):
        at = run.stderr.find(word)
        assert at < 0, f"{word} in stderr: ...{run.stderr[max(at - 1500, 0):at + 1500]}..."
    # only the policy asked for is tried ("--remat none" was read as auto until 05f39bf: the line
    # then listed all five); the rest are offered, the float32 state named
    assert "(remat none out of memory)" in errors[0] and "--remat full" in errors[0], errors[0]
    assert "--override param_dtype=bfloat16" in errors[0], errors[0]
    assert not out.exists()


def test_remat_auto_fits_what_remat_none_cannot(tmp_path):
    """llama3.2-1b, bf16 params and adam state, 2 x 2048 (TPU.md: remat none does not fit even
    1 x 2048, dots_with_no_batch_dims_saveable needs 19.1 GB, save_qkv_mlp 16.8, save_attn_mlp 16.3 GB): --remat
    auto, the default on a TPU, compiles its way down to a policy that fits, and it trains."""
    out = tmp_path / "fits"
    run = _train("--out", str(out), "--model", "llama3.2-1b", "--override", "dtype=bfloat16",
                 "--override", "param_dtype=bfloat16", "--batch-size", "2", "--seq-len", "2048", "--steps", "2",
                 "--log-every", "1", "--eval-every", "0", "--save-every", "0")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    chosen = re.search(r"^remat auto: (\w+), the first of none, dots_with_no_batch_dims_saveable, save_qkv_mlp, "
                       r"save_qkv, save_attn_mlp, full \(fastest first\)", run.stdout, re.M)
    assert chosen and chosen.group(1) in ("save_qkv_mlp", "save_qkv", "save_attn_mlp", "full"), run.stdout[-4000:]
    assert len(_losses(run.stdout)) == 2
