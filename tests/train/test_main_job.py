"""The README's main job (``shardzoo train --out DIR``: llama-tiny on the embedded corpus, float32
on the CPU) keeps its numbers while its speed changes (issue 39): its first 20 losses equal those
recorded at c2e18f3 (2026-12-03, before the CPU work) to 1e-5."""

import json
import os
import subprocess
import sys

import numpy as np

# `shardzoo train --out DIR --steps 20 --log-every 1 --eval-every 0` at c2e18f3, metrics.jsonl's
# losses (AMD EPYC; equal to 4.8e-7 at a4890d6, whose projections are flat matmuls on a CPU)
RECORDED = [6.2747641, 6.2699575, 6.2091923, 6.1556439, 6.0262918, 5.939899, 5.8429341, 5.7251105, 5.5798731,
            5.5442219, 5.4017653, 5.3532839, 5.1394758, 5.0164738, 4.809864, 4.599946, 4.487977, 4.1641908,
            4.3069992, 4.010457]


def test_the_main_job_trains_to_the_recorded_losses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, XLA's own settings
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-m", "shardzoo", "train", "--out", str(tmp_path / "demo"), "--steps", "20",
                          "--log-every", "1", "--eval-every", "0"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    with open(tmp_path / "demo" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    np.testing.assert_allclose(losses, RECORDED, rtol=0, atol=1e-5)
