"""Shared pieces of the multi-host tests: the real ``shardzoo train`` in separate processes.

Every run goes through LAUNCHER, which calls ``shardzoo.cli.main`` unchanged, plus a test aid
switched on by an environment variable:

- ``SZ_TEST_ROWS=PREFIX``: every call of ``jax.make_array_from_process_local_data`` (the point
  where a process hands its part of a global batch to JAX) appends the hashes of the rows this
  process supplied to ``PREFIX.p<process index>.jsonl``; it observes, and changes nothing.
"""

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import time

import pytest

LAUNCHER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import jax

    if os.environ.get("SZ_TEST_ROWS"):
        original = jax.make_array_from_process_local_data

        def spy(sharding, local, global_shape=None):
            keys = ("inputs", "targets", "weights")
            rows = [hashlib.sha1(b"".join(local[k][i].tobytes() for k in keys)).hexdigest()[:16]
                    for i in range(len(local["inputs"]))]
            path = f"{os.environ['SZ_TEST_ROWS']}.p{jax.process_index()}.jsonl"
            with open(path, "a") as f:
                f.write(json.dumps({"shape": list(local["inputs"].shape), "rows": rows}) + "\\n")
            return original(sharding, local, global_shape)

        jax.make_array_from_process_local_data = spy

    from shardzoo.cli import main

    sys.exit(main(sys.argv[1:]))
    """
)

# as tests/conftest.py sets for the test process: the same HLO, half the compile time
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # tests/conftest.py's

# llama-tiny made smaller: 1 layer, 32 wide (4 heads of 8, 2 kv heads), seq 16, batch 8.
TINY = ["--model", "llama-tiny", "--override", "hidden_size=32", "--override", "intermediate_size=64",
        "--override", "num_hidden_layers=1", "--seq-len", "16", "--batch-size", "8",
        "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "1", "--eval-every", "0"]


class Runner:
    """Starts ``shardzoo train`` (through LAUNCHER) in subprocesses that share a scratch dir."""

    def __init__(self, root):
        self.root = root
        self.corpus = root / "corpus.jsonl"

    def cmd(self, out, *extra) -> list[str]:
        return [sys.executable, "-c", LAUNCHER, "train", "--out", str(out), "--data", str(self.corpus),
                *TINY, *extra]

    def env(self, devices: int, **aids) -> dict:
        """``devices`` fake CPU devices, offline, a shared compile cache; ``aids``: rows=PREFIX
        (see LAUNCHER)."""
        e = {k: v for k, v in os.environ.items() if not k.startswith("SZ_TEST_")}
        e.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}", JAX_PLATFORMS="cpu",
                 HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                 JAX_COMPILATION_CACHE_DIR=str(self.root / "jax_cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        e.update({f"SZ_TEST_{k.upper()}": str(v) for k, v in aids.items()})
        return e

    def start(self, name: str, out, *extra, devices: int = 8, **aids) -> subprocess.Popen:
        """One process; its stdout and stderr go to ``root/<name>.log``."""
        with open(self.root / f"{name}.log", "w") as log:
            return subprocess.Popen(self.cmd(out, *extra), env=self.env(devices, **aids), stdout=log,
                                    stderr=subprocess.STDOUT)

    def start_pair(self, name: str, out, *extra, **aids) -> list[subprocess.Popen]:
        """Processes 0 and 1 of a two-process run (4 devices each) over 127.0.0.1."""
        flags = ["--coordinator", f"127.0.0.1:{self.free_port()}", "--num-processes", "2"]
        return [self.start(f"{name}.{i}", out, *extra, *flags, "--process-id", str(i), devices=4,
                           **aids) for i in (0, 1)]

    @staticmethod
    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    @staticmethod
    def finish(procs, timeout: float) -> None:
        """Wait for every process, killing those still running after ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()


@pytest.fixture(scope="session")
def runner(tmp_path_factory):
    """A Runner over a scratch dir holding corpus.jsonl (100 short documents)."""
    root = tmp_path_factory.mktemp("multihost")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven small cats sleep on warm mats".split()
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(100):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(20)) + "."}) + "\n")
    return Runner(root)

