"""``shardzoo train`` and ``shardzoo plot`` as a user runs them: real processes where it matters
(end to end, kill -9 and resume, SIGTERM), in-process for bad inputs and the plot."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.train.io.checkpoint import latest_step
from shardzoo.train.io.sources import load_model_and_params
from shardzoo.train.metrics import read_metrics

STEPS = 12
HOOKED = os.path.join(os.path.dirname(__file__), "hooked_train.py")
TINY = ["--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--override", "num_key_value_heads=4"]


def _write_corpus(path, rows=200, seed=0):
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while seven small cats sleep on warm mats".split()
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(20)) + "."}) + "\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    _write_corpus(root / "corpus.jsonl")
    (root / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    return root


def _args(out, corpus):
    return ["--out", str(out), "--data", str(corpus), "--eval-fraction", "0.1", "--steps", str(STEPS),
            "--batch-size", "8", "--seq-len", "16", "--lr", "1e-2", "--warmup-steps", "2",
            "--log-every", "1", "--save-every", "4", "--eval-every", "6", "--eval-steps", "2",
            "--tensorboard", *TINY]


def _env(files):
    # opt level 0 as tests/conftest.py sets for the test process: the same HLO, half the compile time
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    # the runs of this module compile the same programs: share them through jax's disk cache
    env.update(JAX_COMPILATION_CACHE_DIR=str(files / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def _train(files, out, *extra, delay=None, wait=True):
    """``shardzoo train`` through the test hooks: batch hashes logged, ``delay`` s after each step."""
    hooks = ["--hash"] + (["--delay", str(delay)] if delay else [])
    cmd = [sys.executable, HOOKED, *hooks, "--", *_args(out, files / "corpus.jsonl"), *extra]
    if not wait:  # stderr to a file: a pipe nobody reads could fill up and stall the run
        log = open(os.path.join(files, f"{os.path.basename(out)}.stderr"), "w")
        return subprocess.Popen(cmd, env=_env(files), stdout=subprocess.DEVNULL, stderr=log)
    return subprocess.run(cmd, env=_env(files), capture_output=True, text=True, timeout=600)


def _logged_steps(out):
    path = os.path.join(out, "metrics.jsonl")
    return [r["step"] for r in read_metrics(path)] if os.path.exists(path) else []


def _wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early: {open(proc.stderr.name).read()}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(files):
    """One uninterrupted run of the CLI: (out dir, stdout)."""
    out = files / "reference"
    done = _train(files, out)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_cli_trains_a_tiny_llama_end_to_end(reference):
    out, stdout = reference
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in ("learning_rate", "grad_norm", "tokens_per_sec", "step_time_s", "batch_hash"):
        assert key in train[0], key
    # step 6 samples --eval-steps batches of the held-out split (and says so); the final eval scores it whole
    assert [r["step"] for r in records if "eval_loss_sampled" in r] == [6]
    assert [r["step"] for r in records if "eval_loss" in r] == [12]
    first, last = np.mean([r["loss"] for r in train[:3]]), np.mean([r["loss"] for r in train[-3:]])
    assert last < first - 0.5, (first, last)
    assert latest_step(str(out / "checkpoints")) == STEPS
    run = json.loads((out / "run.json").read_text())
    assert run["model"] == "llama-tiny" and run["overrides"]["hidden_size"] == "32"
    assert (out / "tokenizer").is_dir()
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(out / "tensorboard"))
    assert "rule table: fsdp" in stdout and "per device" in stdout


def test_config_file_settings_apply_and_flags_win(tmp_path):
    from shardzoo.cli import build_parser
    from shardzoo.train.flags import config_from_args

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("steps: 50\nlr: 0.02\nbatch-size: 4\noverride: {hidden_size: 32, num_hidden_layers: 1}\n")
    args = build_parser().parse_args(["train", "--config", str(yaml_file), "--out", "x", "--steps", "7",
                                      "--override", "hidden_size=48"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.lr, cfg.batch_size, cfg.out) == (7, 0.02, 4, "x")
    assert cfg.override == ("hidden_size=32", "num_hidden_layers=1", "hidden_size=48")  # the last wins


def test_plot_draws_the_loss_curves_to_a_png(reference, tmp_path):
    out, _ = reference
    png = tmp_path / "loss.png"
    assert main(["plot", str(out), "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_kill_9_and_restart_ends_bit_identical_to_the_uninterrupted_run(reference, files):
    ref_out, _ = reference
    out = files / "killed"
    proc = _train(files, out, delay=0.4, wait=False)
    # kill once checkpoint 4 is committed and the run has gone past it
    _wait_for(lambda: latest_step(str(out / "checkpoints")) == 4 and max(_logged_steps(out) or [0]) >= 5, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    logged_before = _logged_steps(out)
    assert latest_step(str(out / "checkpoints")) == 4 < max(logged_before) < STEPS

    done = _train(files, out)
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout
    ref_hashes = [r["batch_hash"] for r in read_metrics(ref_out / "metrics.jsonl") if "batch_hash" in r]
    hashes = [r["batch_hash"] for r in read_metrics(out / "metrics.jsonl") if "batch_hash" in r]
    assert len(ref_hashes) == STEPS and hashes == ref_hashes  # the same batches, in the same order
    ref_params, params = load_model_and_params(str(ref_out))[2], load_model_and_params(str(out))[2]
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_saves_a_checkpoint_at_the_current_step_and_exits_0(files):
    out = files / "preempted"
    proc = _train(files, out, delay=0.4, wait=False)
    _wait_for(lambda: max(_logged_steps(out) or [0]) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, open(proc.stderr.name).read()
    current = max(_logged_steps(out))
    assert 2 <= current < STEPS
    assert latest_step(str(out / "checkpoints")) == current


BAD = {
    "unknown model": (["--model", "llama-huge"], "unknown model 'llama-huge'"),
    "other model on resume": (["--model", "gpt2-tiny"], "holds model 'llama-tiny', not 'gpt2-tiny'"),
    "other override on resume": (["--override", "hidden_size=64"], "hidden_size=32"),
    "unknown rules": (["--rules", "fsdp_ultra"], "unknown rule preset 'fsdp_ultra'"),
    "missing rule file": (["--rules", "nope/rules.yaml"], "rule file nope/rules.yaml"),
    "mesh of the wrong size": (["--mesh", "data=3"], "mesh spec data=3 has 3 devices but 8"),
    "unknown mesh axis": (["--mesh", "pipeline=8"], "unknown mesh axis 'pipeline'"),
    "missing data file": (["--data", "nope/corpus.jsonl"], "nope/corpus.jsonl"),
    "missing column": (["--text-column", "body"], "no column 'body'"),
    "empty dataset": (["--data", "{files}/empty.jsonl"], "empty dataset"),
    "missing config file": (["--config", "nope.yaml"], "--config nope.yaml"),
    "batch not divisible": (["--batch-size", "12"], "not divisible by the 8 devices"),
    "bad remat": (["--remat", "fast"], "--remat 'fast': choose auto or one of"),
    # "none" is a policy, not a missing value (it was read as "not given": auto on the chip, 2026-12-07)
    "remat none against an override": (["--remat", "none", "--override", "remat_policy=full"],
                                       "--remat none and --override remat_policy=full disagree"),
    "bad device memory": (["--device-memory", "lots"], "device memory 'lots'"),
    # a resume to a later step whose compiled step does not fit: the fit is decided before any write
    "step does not fit": (["--device-memory", "10kB", "--steps", str(STEPS + 1)],
                          "the train step does not fit one device: it needs "),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_input_exits_2_with_one_line_and_leaves_out_untouched(reference, files, case, capsys, snapshot):
    out, _ = reference
    before = snapshot(out)
    flags, expected = BAD[case]
    flags = [f.format(files=files) for f in flags]
    capsys.readouterr()
    rc = main(["train", *_args(out, files / "corpus.jsonl"), *flags])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("shardzoo train: error: "), captured.err
    assert expected in lines[0]
    assert snapshot(out) == before


def test_a_bad_input_creates_no_out_dir(files, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", *_args(out, files / "corpus.jsonl"), "--model", "llama-huge"]) == 2
    assert not out.exists()


def test_a_step_that_does_not_fit_is_one_line_and_creates_no_out_dir(files, tmp_path, capsys):
    out = tmp_path / "never"
    capsys.readouterr()
    assert main(["train", *_args(out, files / "corpus.jsonl"), "--device-memory", "10kB", "--remat", "auto"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "remat none " in lines[0] and "remat full " in lines[0], lines
    assert "one device has 10.00 kB (--device-memory 10kB; a step may use 9.70 kB)" in lines[0]
    assert not out.exists()


def test_remat_none_is_the_policy_on_an_accelerator_too(files, tmp_path):
    """``--remat none`` asks for that policy: only it is checked against the device's memory, where
    a run without --remat tries every policy (auto, the accelerator's default)."""
    import argparse

    from shardzoo.models import get_model
    from shardzoo.train import fit
    from shardzoo.train.flags import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def requested(*flags):
        cfg = config_from_args(parser.parse_args(["--out", str(tmp_path / "x"), *flags]))
        _, config = get_model(cfg.model)
        return fit.requested_remat(cfg, config, accelerator=True)

    assert requested("--remat", "none") == "none"
    assert requested("--remat", "None") == "none"
    assert requested() == "auto"


@pytest.mark.parametrize("fresh", [True, False])
def test_a_step_out_of_memory_while_running_is_one_line_and_undone(reference, files, tmp_path, fresh, monkeypatch,
                                                                    capsys, snapshot):
    """XLA's RESOURCE_EXHAUSTED at the first step (here faked, after the metrics and TensorBoard
    files were opened): one line, exit 2, and --out as it was (a fresh one gone, a resumed run's
    files byte for byte)."""
    from shardzoo.train.trainer import Trainer

    def out_of_memory(self, end):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.50G.")

    monkeypatch.setattr(Trainer, "_loop", out_of_memory)
    out = tmp_path / "fresh" if fresh else reference[0]
    before = None if fresh else snapshot(out)
    capsys.readouterr()
    assert main(["train", *_args(out, files / "corpus.jsonl"), "--steps", str(STEPS + 1)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["shardzoo train: error: the train step (remat none) ran out of device memory while "
                     "running: try a smaller --batch-size (now 8) or --seq-len (now 16), --remat full, --override "
                     "param_dtype=bfloat16 (params and optimizer state in half the bytes), the optimizer state "
                     "sharded (--opt-rules zero1, or --rules fsdp over more devices) or --grad-accum 2 (the batch "
                     "in smaller microbatches)"]
    if fresh:
        assert not out.exists()
    else:
        assert snapshot(out) == before


def test_a_rule_file_typo_lists_every_problem_typo_first(files, tmp_path, capsys):
    rules = tmp_path / "typo.yaml"  # a mesh-axis typo in a table that also forgets `vocab`
    rules.write_text("- [batch, [data, fsdp]]\n- [embed, fsdp]\n- [mlp, bogusaxis]\n- [heads, null]\n"
                     "- [kv_heads, null]\n- [head_dim, null]\n- [layers, null]\n- [length, null]\n")
    out = tmp_path / "never"
    capsys.readouterr()
    rc = main(["train", *_args(out, files / "corpus.jsonl"), "--rules", str(rules), "--mesh", "fsdp=8"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err and not out.exists()
    assert lines[0] == ("shardzoo train: error: rules 'typo.yaml' on mesh data=1,stage=1,fsdp=8,expert=1,sequence=1,"
                        "context=1,tensor=1: 2 sharding problems:")
    assert "rule #2 mlp->bogusaxis names mesh axis 'bogusaxis', which the mesh does not have" in lines[1]
    assert "logical axis 'vocab' has no rule in rule table 'typo.yaml'" in lines[2] and len(lines) == 3


def test_a_bad_model_field_exits_2_with_one_line(files, tmp_path, capsys):
    out = tmp_path / "never"
    capsys.readouterr()
    assert main(["train", *_args(out, files / "corpus.jsonl"), "--override", "hidden_act=foo"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    from shardzoo.models.arch import ACTIVATIONS

    assert lines == ["shardzoo train: error: model 'llama-tiny': TransformerArch.hidden_act='foo' is not "
                     f"one of {', '.join(ACTIVATIONS)}"]
    assert not out.exists()
