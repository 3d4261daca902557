"""A Hugging Face Hub model id wherever an HF directory is accepted (import-hf, --init-from,
generate --hf, eval --hf), resolved through huggingface_hub's cache: a cache this test fills
itself (HF_HUB_CACHE, laid out as huggingface_hub lays a snapshot), no network, HF_HUB_OFFLINE=1.
A model that is not cached is one line naming the id, and nothing is written."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from huggingface_hub import constants

from shardzoo import cli
from shardzoo.train.io.hub import is_hub_id

sys.path.insert(0, os.path.dirname(__file__))
from harness import bpe_tokenizer, tiny_llama  # noqa: E402

REPO, REV = "tiny-org/tiny-llama", "0123456789abcdef0123456789abcdef01234567"
PROMPT = "the lazy fox"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(cache dir, snapshot dir): a tiny Llama with its tokenizer as the Hub cache holds it."""
    model = tiny_llama()
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    model.save_pretrained(snapshot)
    bpe_tokenizer(snapshot, ["the quick brown fox jumps over the lazy dog."])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return cache, snapshot


@pytest.fixture
def cached(hub_cache, monkeypatch):
    """This process reads the test's cache (huggingface_hub read HF_HUB_CACHE at import)."""
    cache, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert constants.HF_HUB_OFFLINE  # tests/conftest.py: no network
    return snapshot


def run(capsys, *args):
    capsys.readouterr()
    rc = cli.main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_and_eval_take_a_hub_id(cached, tmp_path, capsys):
    flags = ["--prompt", PROMPT, "--max-new-tokens", 12]
    rc, by_dir, err = run(capsys, "generate", "--hf", cached, *flags)
    assert rc == 0, err
    for name in (REPO, f"{REPO}@{REV}"):
        rc, by_id, err = run(capsys, "generate", "--hf", name, *flags)
        assert rc == 0 and by_id == by_dir and len(by_id) > len(PROMPT) + 4, err
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "the quick brown fox jumps over the lazy dog."}) + "\n"
                            for _ in range(4)))
    metrics = []
    for source in (cached, REPO):
        rc, out, err = run(capsys, "eval", "--hf", source, "--data", data, "--seq-len", 16,
                           "--out", tmp_path / "m.json")
        assert rc == 0, err
        metrics.append(json.loads((tmp_path / "m.json").read_text()))
    assert abs(metrics[0]["loss"] - metrics[1]["loss"]) < 1e-6 and metrics[1]["model"] == REPO


def test_import_hf_and_init_from_take_a_hub_id(cached, tmp_path, capsys):
    rc, out, err = run(capsys, "import-hf", REPO, tmp_path / "imported")
    assert rc == 0 and f"from {REPO} into" in out, err
    run_json = json.loads((tmp_path / "imported" / "run.json").read_text())
    assert run_json["hf_source"] == str(cached) and run_json["hf_model_type"] == "llama"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "the quick brown fox jumps over the lazy dog."}) + "\n"
                            for _ in range(40)))
    rc, out, err = run(capsys, "train", "--out", tmp_path / "tuned", "--init-from", REPO, "--data", data,
                       "--steps", 1, "--batch-size", 8, "--seq-len", 16, "--lora-rank", 2, "--eval-every", 0)
    assert rc == 0, err
    meta = json.loads((tmp_path / "tuned" / "run.json").read_text())
    assert meta["lora"]["base"] == REPO  # what PEFT's base_model_name_or_path should say
    assert meta["tokenizer"] == str(cached)  # the snapshot's tokenizer, saved with the run
    assert (tmp_path / "tuned" / "tokenizer" / "tokenizer.json").is_file()


def test_a_local_path_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert not is_hub_id("org/model") and not is_hub_id("./x") and not is_hub_id("/abs/x")
    assert not is_hub_id("~/x") and not is_hub_id("a/b/c")
    assert is_hub_id("gpt2") and is_hub_id("org/other") and is_hub_id(f"{REPO}@main")


def test_a_model_not_in_the_cache_offline_is_one_line(hub_cache, snapshot, tmp_path):
    """In a fresh process: HF_HUB_CACHE and HF_HUB_OFFLINE come from the environment."""
    cache, _ = hub_cache
    before = snapshot(cache)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def shardzoo(*args):
        return subprocess.run([sys.executable, "-m", "shardzoo", *map(str, args)], env=env, capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)

    done = shardzoo("import-hf", REPO, tmp_path / "ok")  # the cache named by the environment
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ok" / "checkpoints" / "0").is_dir()
    for args, flag in ((["import-hf", "tiny-org/absent", tmp_path / "never"], "HF_DIR"),
                       (["generate", "--hf", "tiny-org/absent", "--prompt", "x"], "--hf")):
        done = shardzoo(*args)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"shardzoo {args[0]}: error: {flag} tiny-org/absent: no such directory, "
                                   "and as a Hugging Face Hub model id it is not in the cache"), lines[0]
        assert "HF_HUB_OFFLINE is set" in lines[0]
    assert not (tmp_path / "never").exists()
    assert snapshot(cache) == before
    shutil.rmtree(tmp_path / "ok")
