"""``train --wandb PROJECT`` (the optional extra ``shardzoo[wandb]``) logs what metrics.jsonl logs
to one W&B run per run directory, in W&B's offline mode (no account, no network): the run's
``.wandb`` file is read back record by record. Without the package, --wandb is one line."""

import glob
import importlib.util
import json
import os
import random
import struct
import subprocess
import sys

import pytest

from shardzoo.cli import main
from shardzoo.train.metrics import read_metrics

TINY = ["--model", "llama-tiny", "--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--override", "num_key_value_heads=4"]


def wandb_records(path):
    """The records of a ``.wandb`` file (W&B's LevelDB-style log: 32 KiB blocks of records with a
    7-byte header: crc32, length, type full/first/middle/last)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        if kind in (1, 4):
            yield pending + chunk
            pending = b""
        else:
            pending = chunk if kind == 2 else pending + chunk


def history(run_file) -> tuple[str, dict]:
    """(project, {step: {metric: value}}) logged to one offline W&B run."""
    from wandb.proto import wandb_internal_pb2 as pb

    project, steps = None, {}
    for raw in wandb_records(run_file):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project = record.run.project
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            steps[record.history.step.num] = items
    return project, steps


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog".split()
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(100):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(20))}) + "\n")
    return root


def train(corpus, out, steps, *extra):
    return ["train", "--out", str(out), "--data", str(corpus / "corpus.jsonl"), *TINY, "--steps", str(steps),
            "--batch-size", "8", "--seq-len", "16", "--log-every", "2", "--eval-every", "0",
            "--eval-fraction", "0.2", *extra]


def test_offline_wandb_logs_what_metrics_jsonl_logs_and_resumes_the_same_run(corpus):
    out = corpus / "run"
    env = {**os.environ, "WANDB_MODE": "offline"}
    # the run and its resume (a resume logs to the same W&B run), one after the other in one child
    # process (W&B's state stays out of this one): each says where it logs and exits 0
    runs = [train(corpus, out, steps, "--wandb", "sz-test") for steps in (4, 6)]
    script = ("import json, sys\nfrom shardzoo.cli import main\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    print('exit', main(args), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(runs)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith(("wandb: logging to", "exit"))]
    assert len(said) == 4 and said[1::2] == ["exit 0", "exit 0"], done.stdout + done.stderr
    assert all(line.startswith("wandb: logging to project sz-test") and "(offline)" in line for line in said[::2])
    run_id = (out / "wandb-run-id").read_text().strip()
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / f"run-{run_id}.wandb")))
    assert len(runs) == 2
    logged = {}
    for run_file in runs:
        project, steps = history(run_file)
        assert project == "sz-test"
        logged.update(steps)
    records = {r["step"]: r for r in read_metrics(str(out / "metrics.jsonl"))}
    assert sorted(logged) == sorted(records) == [1, 2, 4, 6]
    for step, record in records.items():
        for key in ("loss", "grad_norm", "learning_rate"):
            assert logged[step][key] == pytest.approx(record[key], rel=1e-6, abs=1e-9), (step, key)
    assert logged[6]["eval_loss"] == pytest.approx(records[6]["eval_loss"], rel=1e-9)


def test_wandb_without_the_package_is_one_line(corpus, snapshot, tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    before = snapshot(corpus)
    capsys.readouterr()
    for project, expected in (("sz-test", "the wandb package is not installed: pip install 'shardzoo[wandb]'"),
                              (" ", "--wandb needs a project name")):
        rc = main(train(corpus, tmp_path / "never", 2, "--wandb", project))
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("shardzoo train: error: --wandb"), lines
        assert expected in lines[0], lines[0]
    assert not (tmp_path / "never").exists() and snapshot(corpus) == before
