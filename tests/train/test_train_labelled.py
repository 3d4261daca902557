"""The trainer is generic: `shardzoo train` trains the zoo's MLP on labelled examples."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.train.io.sources import load_model_and_params
from shardzoo.train.metrics import read_metrics


def _digits_module():
    path = os.path.join(os.path.dirname(__file__), "..", "data", "conftest.py")
    spec = importlib.util.spec_from_file_location("digits_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    path = tmp_path_factory.mktemp("digits") / "digits.parquet"
    _digits_module().write_digits(path, 400)
    return str(path)


MODEL = ["--model", "mlp-mnist", "--override", "in_features=64"]
FLAGS = ["--label-column", "label", "--steps", "30", "--batch-size", "32", "--lr", "1e-2", "--warmup-steps", "2",
         "--log-every", "5", "--eval-every", "0", "--eval-fraction", "0.2", "--eval-steps", "3"]


def test_mlp_trains_on_an_image_parquet_with_labels(digits, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", digits, "--rules", "fsdp", "--mesh", "fsdp=8",
                 *MODEL, *FLAGS]) == 0
    records = read_metrics(str(out / "metrics.jsonl"))
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]  # cross-entropy of 10 classes starts near ln 10 = 2.3
    final = records[-1]
    assert final["step"] == 30 and final["eval_accuracy"] >= 0.9 and "eval_perplexity" not in final
    assert "examples" in final and "tokens" not in final  # the weight counts examples
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["data"]["label_column"] == "label"
    assert run["settings"]["model"]["override"] == ["in_features=64"]
    assert not (out / "tokenizer").exists()
    _, config, params, _ = load_model_and_params(str(out))
    assert config.in_features == 64 and params["head"]["kernel"].shape == (512, 10)
    assert "rule table: fsdp" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    ([*MODEL, "--override", "in_features=32"], "64 features per example, --model mlp-mnist takes in_features=32"),
    ([*MODEL, "--override", "num_outputs=4"], "10 classes, --model mlp-mnist has num_outputs=4"),
    (["--model", "llama-tiny"], "is a language model"),
])
def test_labelled_data_that_does_not_fit_the_model_exits_2(digits, tmp_path, capsys, flags, message):
    out = tmp_path / "bad"
    assert main(["train", "--out", str(out), "--data", digits, *FLAGS, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_an_mlp_without_labels_is_refused(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--model", "mlp-mnist"]) == 2
    assert "give --data and --label-column" in capsys.readouterr().err


def test_regression_on_jsonl_features_with_a_compile_cache(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    path = tmp_path / "reg.jsonl"
    path.write_text("".join(json.dumps({"x": a.tolist(), "y": float(b)}) + "\n" for a, b in zip(x, y, strict=True)))
    out = tmp_path / "run"
    # a process of its own, without the test session's cache: --compile-cache sets it up
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, "-m", "shardzoo", "train", "--out", str(out), "--data", str(path),
         "--model", "mlp-tiny-regression", "--override", "in_features=4", "--label-column", "y",
         "--steps", "40", "--batch-size", "32", "--lr", "1e-2", "--log-every", "5", "--eval-every", "0",
         "--rules", "dp", "--mesh", "data=8", "--compile-cache", str(tmp_path / "cache")],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(tmp_path / "cache")) >= 2  # the init and the train step, at least
    losses = [r["mse"] for r in read_metrics(str(out / "metrics.jsonl")) if "mse" in r]
    assert losses[-1] < 0.2 * losses[0]
