"""The progress bars (tqdm, with an ETA) of training and eval show on a terminal and never on a
pipe or a log: the same commands under a pseudo-terminal and piped.

Every command runs in one child process (``DRIVER``), each with descriptors 1 and 2 pointed at a
pseudo-terminal or at pipes of its own, so jax is imported once for all eight of them."""

import json
import random
import re
import subprocess
import sys
import textwrap

import pytest

TINY = ["--model", "llama-tiny", "--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--override", "num_key_value_heads=4"]
TRAIN_BAR = re.compile(r"train: +\d+%\|[^|]*\| *\d+/(\d+) \[\d\d:\d\d<\d\d:\d\d")  # elapsed<remaining
# a fast eval may be cleared before its first rate is known: ETA "?"
EVAL_BAR = re.compile(r"eval: +\d+%\|[^|]*\| *\d+/\d+ \[\d\d:\d\d<(\d\d:\d\d|\?)")


DRIVER = textwrap.dedent(
    """
    import fcntl, json, os, pty, struct, sys, termios, threading
    from shardzoo import cli

    def drained(fd, into):
        def read():
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                into.append(data)
            os.close(fd)
        thread = threading.Thread(target=read)
        thread.start()
        return thread

    def run(args, terminal):
        # (exit status, stdout, stderr) of cli.main(args), fds 1 and 2 on a 160-column
        # pseudo-terminal (both in stdout) or on two pipes
        if terminal:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
            ends = [(master, slave), (None, slave)]
        else:
            ends = [os.pipe(), os.pipe()]
        got = [[], []]
        readers = [drained(r, got[i]) for i, (r, _) in enumerate(ends) if r is not None]
        sys.stdout.flush(), sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        for fd, (_, w) in zip((1, 2), ends):
            os.dup2(w, fd)
        try:
            rc = cli.main(args)
        except SystemExit as e:
            rc = e.code
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            for w in {w for _, w in ends}:
                os.close(w)
        for t in readers:
            t.join(timeout=60)
        return [rc, *(b"".join(g).decode("utf-8", "replace") for g in got)]

    todo = json.loads(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump({name: run(args, terminal) for name, args, terminal in todo}, f)
    """
)


def command(*args):
    """A command line for ``cli.main``."""
    return [*map(str, args)]


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


@pytest.fixture(scope="module")
def seen(corpus):
    """name -> (exit status, stdout, stderr) of each command, in this order, in one process; on a
    terminal stdout holds both."""
    out, hf_dir = corpus / "run", corpus / "ie_hf"
    evaluate = command("eval", "--checkpoint", out, "--split", "eval")
    todo = [("train_pipe", train(corpus, out, 4), False),
            ("train_tty", train(corpus, out, 8), True),  # resumes at step 4
            ("eval_tty", evaluate, True),
            ("eval_pipe", evaluate, False),
            ("export_pipe", command("export-hf", out, hf_dir), False),  # the run trained above
            ("export_tty", command("export-hf", out, corpus / "ie_hf2"), True),
            ("import_tty", command("import-hf", hf_dir, corpus / "ie_imported"), True),
            ("import_pipe", command("import-hf", hf_dir, corpus / "ie_imported2"), False)]
    results = corpus / "results.json"
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(todo), str(results)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(results.read_text())


def test_bars_on_a_terminal_and_none_on_a_pipe(seen):
    rc, stdout, stderr = seen["train_pipe"]
    assert rc == 0, stderr
    assert not TRAIN_BAR.search(stderr + stdout) and "\r" not in stderr + stdout
    assert "step 2: loss" in stdout  # a pipe gets the log lines instead

    rc, tty, _ = seen["train_tty"]
    assert rc == 0, tty
    bars = TRAIN_BAR.findall(tty)
    assert bars and set(bars) == {"8"}, tty
    assert "4/8" in tty and "8/8" in tty
    assert EVAL_BAR.search(tty), tty  # the final evaluation over the whole held-out split

    rc, tty, _ = seen["eval_tty"]
    assert rc == 0 and EVAL_BAR.search(tty) and "eval over" in tty, tty
    rc, stdout, stderr = seen["eval_pipe"]
    assert rc == 0 and stderr == "", stderr
    assert stdout.startswith("eval over")


IMPORT_BAR = re.compile(r"import: +\d+%\|[^|]*\| *\d+/(\d+) \[")
EXPORT_BAR = re.compile(r"export: +\d+%\|[^|]*\| *\d+/(\d+) \[")


def test_import_and_export_show_a_bar_on_a_terminal_and_none_on_a_pipe(seen):
    """export-hf and import-hf go leaf by leaf through the checkpoint: a bar of leaves on a
    terminal, nothing on a pipe."""
    rc, stdout, stderr = seen["export_pipe"]
    assert rc == 0, stderr
    assert not EXPORT_BAR.search(stderr) and "\r" not in stderr + stdout
    rc, tty, _ = seen["export_tty"]
    assert rc == 0 and EXPORT_BAR.search(tty), tty
    rc, tty, _ = seen["import_tty"]
    assert rc == 0 and IMPORT_BAR.search(tty), tty
    rc, _, stderr = seen["import_pipe"]
    assert rc == 0 and not IMPORT_BAR.search(stderr) and "\r" not in stderr, stderr
