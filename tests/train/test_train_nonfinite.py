"""The non-finite guard: stop at a NaN step keeping the last good checkpoint, or skip and count."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import NONFINITE_EXIT, TrainConfig
from shardzoo.train.io.checkpoint import latest_step
from shardzoo.train.io.sources import load_model_and_params
from shardzoo.train.metrics import read_metrics
from shardzoo.train.trainer import NonFiniteError, Trainer


def hooked_train(argv):
    """``tests/train/hooked_train.py``'s main: ``shardzoo train`` with test hooks, in-process."""
    path = os.path.join(os.path.dirname(__file__), "hooked_train.py")
    spec = importlib.util.spec_from_file_location("hooked_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_a_nan_step_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
        tiny_lm, batches, small, tmp_path):
    module, config = tiny_lm
    cfg = TrainConfig(out=str(tmp_path), save_every=2, **small)
    trainer = Trainer(module, config, cfg, make_mesh("fsdp=8"), get_rules("fsdp"),
                      batches(32, 16, nan_at=2), meta={"model": "llama-tiny"})  # step 3's batch
    with pytest.raises(NonFiniteError, match=r"at step 3 .*last good checkpoint is step 2"):
        trainer.fit()
    assert latest_step(str(tmp_path / "checkpoints")) == 2
    _, _, params, _ = load_model_and_params(str(tmp_path))
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] == "nan"


def test_skip_nonfinite_keeps_the_state_of_a_nan_step_and_counts_it(tiny_lm, batches, small, tmp_path):
    module, config = tiny_lm
    cfg = TrainConfig(out=str(tmp_path), save_every=1, keep=10, skip_nonfinite=True, **small)
    trainer = Trainer(module, config, cfg, make_mesh("fsdp=8"), get_rules("fsdp"),
                      batches(32, 16, nan_at=2), meta={"model": "llama-tiny"})
    history = trainer.fit(stop_after=4)
    assert [r["nonfinite_skipped"] for r in history] == [0, 0, 1, 1]
    assert np.isnan(history[2]["loss"]) and np.isfinite(history[3]["loss"])
    ckpt = {s: load_model_and_params(str(tmp_path / "checkpoints" / str(s)))[2] for s in (2, 3, 4)}
    leaves = {s: jax.tree.leaves(p) for s, p in ckpt.items()}
    assert all(np.array_equal(a, b) for a, b in zip(leaves[2], leaves[3], strict=True))  # kept
    assert not all(np.array_equal(a, b) for a, b in zip(leaves[3], leaves[4], strict=True))  # moved on


def test_a_nan_on_the_command_line_exits_3_naming_the_step(small, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of a small corpus."}) + "\n" for i in range(200)))
    out = tmp_path / "run"
    # the in-process runs' settings (see conftest.SMALL), so the compiled step is theirs
    flags = ["--steps", "8", "--batch-size", "32", "--seq-len", "16", "--lr", "1e-2", "--warmup-steps", "2",
             "--log-every", "1", "--save-every", "1", "--override", "hidden_size=32",
             "--override", "intermediate_size=64", "--override", "num_hidden_layers=1",
             "--override", "num_key_value_heads=4"]
    assert (small["steps"], small["batch_size"], small["seq_len"], small["lr"]) == (8, 32, 16, 1e-2)
    rc = hooked_train(["--nan-at", "2", "--", "--out", str(out), "--data", str(corpus), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == NONFINITE_EXIT == 3
    assert err[-1].startswith("shardzoo train: error: non-finite loss or gradient at step 2 "), err
    assert latest_step(str(out / "checkpoints")) == 1
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [1, 2]
