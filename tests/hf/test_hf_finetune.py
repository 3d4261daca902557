"""examples/finetune_hf.py end to end: a tiny random Llama, its BPE tokenizer and a
prompt/completion jsonl are built, fine-tuned through ``shardzoo train --init-from HF_DIR`` (loss
on completions only), exported, and the export loads in transformers with the fine-tuned weights."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardzoo.train.io.sources import load_model_and_params

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_hf.py")


def test_finetune_example_runs_loss_falls_and_export_loads(tmp_path):
    out = tmp_path / "ft"
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device: the sharded paths are tested elsewhere
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--make-tiny-demo", "--out", str(out), "--steps", "12", "--lr", "3e-3",
         "--batch-size", "8"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "run" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses

    exported = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    start = load_file(str(out / "demo" / "hf" / "model.safetensors"))
    tuned = exported.state_dict()
    assert set(start) == set(tuned)
    changed = [n for n in start if not np.array_equal(start[n], tuned[n].numpy())]
    assert len(changed) == len(start)  # every tensor was fine-tuned and exported (none left at init)

    # The export computes what the fine-tuned shardzoo checkpoint computes, on the run's tokenizer.
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    prompt = tokenizer("What is two plus three?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = exported(prompt).logits.numpy()
    module, _, params, _ = load_model_and_params(str(out / "run"))
    got = jax.jit(lambda p, x: module.apply({"params": p}, x))(params, prompt.numpy().astype(np.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
