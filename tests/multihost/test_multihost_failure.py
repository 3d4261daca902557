"""A multi-process run whose peer dies, or never comes, ends with an error in bounded time
instead of hanging.

jax's own timeouts do the bounding (``initialization_timeout``, ``heartbeat_timeout_seconds``),
set from ``shardzoo train --distributed-timeout / --heartbeat-timeout``.
"""

import os
import re
import signal
import subprocess
import time

import pytest

HEARTBEAT = 10  # seconds without a heartbeat before the coordinator declares a process dead
INIT_TIMEOUT = 10  # seconds to wait for every process to join
SLACK = 50  # scheduling slack on a loaded 2-core machine
LONG_RUN = ["--steps", "1000", "--save-every", "0", "--rules", "fsdp", "--mesh", "fsdp=8"]


def _wait_for(text: str, name: str, runner, procs, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in runner.log(name):
        for p in procs:
            assert p.poll() is None, f"a process exited early ({p.returncode}):\n{runner.log(name)[-3000:]}"
        assert time.monotonic() < deadline, f"{name} never printed {text!r}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lone(runner):
    """Process 0 of a 2-process run whose process 1 never starts: (process, start time, out dir).

    Started before the kill test's pair, so the two waits overlap."""
    out = runner.root / "lone"
    proc = runner.start("lone", out, *LONG_RUN, "--coordinator", f"127.0.0.1:{runner.free_port()}",
                        "--num-processes", "2", "--process-id", "0",
                        "--distributed-timeout", str(INIT_TIMEOUT), devices=4)
    yield proc, time.monotonic(), out
    runner.finish([proc], timeout=0.1)


def test_survivor_of_a_killed_process_exits_with_an_error(runner, lone):
    """kill -9 process 1 once both have initialised: process 0 exits non-zero within the
    heartbeat timeout (+ slack), saying that another process died."""
    out = runner.root / "killed"
    procs = runner.start_pair("killed", out, *LONG_RUN, "--heartbeat-timeout", str(HEARTBEAT))
    try:
        _wait_for("rule table", "killed.0", runner, procs)  # printed after jax.distributed init
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        runner.finish(procs[:1], timeout=HEARTBEAT + SLACK)
        elapsed = time.monotonic() - killed_at
    finally:
        runner.finish(procs, timeout=0.1)
    log = runner.log("killed.0")
    assert procs[0].returncode not in (0, None), log[-3000:]
    assert elapsed < HEARTBEAT + SLACK, f"still running {elapsed:.0f}s after its peer died"
    assert re.search(r"another task died|heartbeat|Connection reset|Connection closed", log), log[-3000:]


def test_lone_process_gives_up_waiting_for_its_peer(runner, lone):
    """With process 1 never started, process 0 exits non-zero once the join times out, having
    written nothing."""
    proc, started, out = lone
    try:
        proc.wait(timeout=max(started + INIT_TIMEOUT + SLACK - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass  # reported below
    log = runner.log("lone")
    assert proc.returncode not in (0, None), f"still waiting after {INIT_TIMEOUT + SLACK}s:\n{log[-3000:]}"
    assert re.search(r"(?i)deadline|timed out|timeout", log), log[-3000:]
    assert not out.exists()  # nothing is written before every process has joined
