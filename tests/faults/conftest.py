"""Shared pieces of the fault-injection tests: a tiny run made once, the CLI in subprocesses,
tree hashes, and the one-line check.

Faults come from outside the program: a signal, a truncated or removed file, a lock held by the
test, a full or read-only file system (a private mount namespace, ``unshare -m``), or a slow batch
placement (LAUNCHER's ``SZ_TEST_STEP_DELAY``, which wraps ``jax.make_array_from_process_local_data``
and changes nothing else).
"""

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

LAUNCHER = textwrap.dedent(
    """
    import os, runpy, sys, time
    from shardzoo import interrupt
    interrupt.watch(sys.argv[1])  # as the shardzoo command does, before jax starts its threads
    import jax

    delay = float(os.environ.get("SZ_TEST_STEP_DELAY", "0"))
    if delay:
        original = jax.make_array_from_process_local_data

        def slow(*args, **kwargs):
            time.sleep(delay)
            return original(*args, **kwargs)

        jax.make_array_from_process_local_data = slow
    sys.argv = ["shardzoo", *sys.argv[1:]]
    runpy.run_module("shardzoo", run_name="__main__")
    """
)

STEPS = 8
# as tests/conftest.py sets for the test process: the same HLO, half the compile time
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # tests/conftest.py's
TINY = ["--model", "llama-tiny", "--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--override", "num_key_value_heads=4"]


def train_args(out, corpus, steps=STEPS, *extra):
    return ["train", "--out", str(out), "--data", str(corpus), *TINY, "--steps", str(steps),
            "--batch-size", "8", "--seq-len", "16", "--lr", "1e-2", "--warmup-steps", "2",
            "--log-every", "1", "--save-every", "4", "--eval-every", "0", *extra]


class Cli:
    """``shardzoo`` in subprocesses that share a corpus and a compile cache under ``root``."""

    def __init__(self, root):
        self.root = root
        self.corpus = root / "corpus.jsonl"

    def env(self, **extra) -> dict:
        """The subprocesses' environment; XLA_FLAGS (8 devices unless ``extra`` says) always gets
        FAST_COMPILE."""
        e = {k: v for k, v in os.environ.items() if not k.startswith("SZ_TEST_")}
        e.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                 HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                 JAX_COMPILATION_CACHE_DIR=str(self.root / "jax_cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        e.update(extra)
        e["XLA_FLAGS"] = f"{e['XLA_FLAGS']} {FAST_COMPILE}"
        return e

    def cmd(self, *args) -> list[str]:
        return [sys.executable, "-c", LAUNCHER, *map(str, args)]

    def run(self, *args, timeout=300, **env) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(*args), env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout)

    def start(self, name, *args, **env) -> subprocess.Popen:
        """A background process; stdout and stderr go to ``root/<name>.out`` / ``.err``."""
        with open(self.root / f"{name}.out", "w") as out, open(self.root / f"{name}.err", "w") as err:
            return subprocess.Popen(self.cmd(*args), env=self.env(**env), stdout=out, stderr=err)

    def err(self, name) -> str:
        return (self.root / f"{name}.err").read_text()

    def args(self, out, steps=STEPS, *extra) -> list[str]:
        """``train`` arguments of the tiny run into ``out``."""
        return train_args(out, self.corpus, steps, *extra)

    def train(self, out, steps=STEPS, *extra, **env):
        return self.run(*train_args(out, self.corpus, steps, *extra), **env)


@pytest.fixture(scope="session")
def cli(tmp_path_factory, snapshot):
    root = tmp_path_factory.mktemp("faults")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven small cats sleep on warm mats".split()
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(20)) + "."}) + "\n")
    found = Cli(root)
    found.snapshot = snapshot  # tests/conftest.py's
    return found


@pytest.fixture(scope="session")
def reference(cli):
    """An uninterrupted 8-step run (checkpoints 4 and 8): its directory. Never modified: copy it."""
    out = cli.root / "reference"
    done = cli.train(out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def run_copy(reference, tmp_path):
    """A private copy of the reference run."""
    dest = tmp_path / "run"
    shutil.copytree(reference, dest)
    return dest


def one_line(stderr: str, command: str = "train", kind: str = "error") -> str:
    """The message, asserting that stderr holds exactly one line, ``shardzoo COMMAND: KIND: ...``."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"shardzoo {command}: {kind}: "), lines[0]
    return lines[0]


def losses(out) -> dict:
    from shardzoo.train.metrics import read_metrics

    if not os.path.exists(os.path.join(out, "metrics.jsonl")):
        return {}
    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r}


def logged_step(out) -> int:
    return max(losses(out) or [0])


def wait_for(predicate, proc, timeout=240, poll=0.05):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the process ended early ({proc.returncode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def stop(*procs) -> None:
    """Leave no process running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="session")
def unshare():
    """A command prefix that runs a shell in a private mount namespace (skips where not allowed)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs `unshare -m` (a private mount namespace) to fake a full or read-only disk")
    return ["unshare", "-m", "sh", "-c"]


# the helpers above, reachable from the tests through the ``cli`` fixture (tests/ is no package)
for _helper in (one_line, losses, logged_step, wait_for, stop):
    setattr(Cli, _helper.__name__, staticmethod(_helper))
