"""The progress bars (tqdm, with an ETA) of training and eval show on a terminal and never on a
pipe or a log: the same commands under a pseudo-terminal and piped."""

import fcntl
import json
import os
import pty
import random
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from shardzoo import cli

TINY = ["--model", "llama-tiny", "--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--override", "num_key_value_heads=4"]
TRAIN_BAR = re.compile(r"train: +\d+%\|[^|]*\| *\d+/(\d+) \[\d\d:\d\d<\d\d:\d\d")  # elapsed<remaining
# a fast eval may be cleared before its first rate is known: ETA "?"
EVAL_BAR = re.compile(r"eval: +\d+%\|[^|]*\| *\d+/\d+ \[\d\d:\d\d<(\d\d:\d\d|\?)")


def command(*args):
    return [sys.executable, "-m", "shardzoo", *map(str, args)]


def under_pty(args, timeout=300) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on a pseudo-terminal; (exit status, all it wrote)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column terminal
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog".split()
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(100):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(20))}) + "\n")
    return root


def train(corpus, out, steps):
    return command("train", "--out", out, "--data", corpus / "corpus.jsonl", *TINY, "--steps", steps,
                   "--batch-size", 8, "--seq-len", 16, "--log-every", 2, "--eval-every", 0,
                   "--eval-fraction", 0.2, "--save-every", 0)


def test_bars_on_a_terminal_and_none_on_a_pipe(corpus):
    out = corpus / "run"
    piped = subprocess.run(train(corpus, out, 4), capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert not TRAIN_BAR.search(piped.stderr + piped.stdout) and "\r" not in piped.stderr + piped.stdout
    assert "step 2: loss" in piped.stdout  # a pipe gets the log lines instead

    rc, seen = under_pty(train(corpus, out, 8))  # resumes at step 4
    assert rc == 0, seen
    bars = TRAIN_BAR.findall(seen)
    assert bars and set(bars) == {"8"}, seen
    assert "4/8" in seen and "8/8" in seen
    assert EVAL_BAR.search(seen), seen  # the final evaluation over the whole held-out split

    evaluate = command("eval", "--checkpoint", out, "--split", "eval")
    rc, seen = under_pty(evaluate)
    assert rc == 0 and EVAL_BAR.search(seen) and "eval over" in seen, seen
    piped = subprocess.run(evaluate, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert piped.stdout.startswith("eval over")


IMPORT_BAR = re.compile(r"import: +\d+%\|[^|]*\| *\d+/(\d+) \[")
EXPORT_BAR = re.compile(r"export: +\d+%\|[^|]*\| *\d+/(\d+) \[")


def test_import_and_export_show_a_bar_on_a_terminal_and_none_on_a_pipe(corpus):
    """export-hf and import-hf go leaf by leaf through the checkpoint: a bar of leaves on a
    terminal, nothing on a pipe."""
    run, hf_dir = corpus / "ie_run", corpus / "ie_hf"
    assert cli.main([str(a) for a in train(corpus, run, 2)[3:]]) == 0  # the run to export: in this process
    piped = subprocess.run(command("export-hf", run, hf_dir), capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert not EXPORT_BAR.search(piped.stderr) and "\r" not in piped.stderr + piped.stdout
    rc, seen = under_pty(command("export-hf", run, corpus / "ie_hf2"))
    assert rc == 0 and EXPORT_BAR.search(seen), seen
    rc, seen = under_pty(command("import-hf", hf_dir, corpus / "ie_imported"))
    assert rc == 0 and IMPORT_BAR.search(seen), seen
    piped = subprocess.run(command("import-hf", hf_dir, corpus / "ie_imported2"), capture_output=True, text=True,
                           timeout=300)
    assert piped.returncode == 0 and not IMPORT_BAR.search(piped.stderr) and "\r" not in piped.stderr, piped.stderr
