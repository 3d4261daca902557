"""One process at a time on a run directory: a second one exits 2 naming the holder; a dead
holder's lock is taken over with one warning; a multi-process run refuses on every process."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from shardzoo.cli import main
from shardzoo.train.io.rundir import LOCK_FILE, DirLock


def test_two_trains_started_together_on_one_out(cli, tmp_path):
    out = tmp_path / "shared"
    procs = [cli.start(f"together{i}", *cli.args(out), SZ_TEST_STEP_DELAY="0.3") for i in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither process ended"
            time.sleep(0.1)
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner = procs[1 - loser]
        assert procs[loser].returncode == 2, cli.err(f"together{loser}")
        line = cli.one_line(cli.err(f"together{loser}"))
        assert f"is in use by pid {winner.pid} on host {socket.gethostname()}" in line
        cli.wait_for(lambda: cli.logged_step(out) >= 1, winner)  # the holder trains on, untouched
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(timeout=120) == 0, cli.err(f"together{1 - loser}")
    finally:
        cli.stop(*procs)
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_a_held_lock_refuses_a_resume_and_changes_nothing(cli, run_copy, capsys):
    before = cli.snapshot(run_copy)
    with DirLock(str(run_copy)):
        capsys.readouterr()
        rc = main(cli.args(run_copy, 12))
        err = capsys.readouterr().err
        held = cli.snapshot(run_copy)
    assert rc == 2
    line = cli.one_line(err)
    assert f"in use by pid {os.getpid()} on host {socket.gethostname()}" in line
    held.pop(LOCK_FILE)
    assert held == before and cli.snapshot(run_copy) == before


def test_a_stale_lock_is_taken_over_with_one_warning(cli, run_copy, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_copy / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                  "started": "2020-01-01T00:00:00"}) + "\n")
    capsys.readouterr()
    rc = main(cli.args(run_copy, 8))  # at step 8 already: nothing to do
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardzoo: warning: "), captured.err
    assert f"stale lock of pid {dead.pid}" in lines[0]
    assert "nothing to do" in captured.out
    assert not (run_copy / LOCK_FILE).exists()


def test_a_multi_process_run_on_a_locked_out_stops_every_process(cli, tmp_path):
    """Process 0 cannot take the lock: both processes exit 2, neither waits for the other."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "held"
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--distributed-timeout", "60"]
    with DirLock(str(out)):
        procs = [cli.start(f"mp{i}", *cli.args(out, 4), *flags, "--process-id", str(i),
                           XLA_FLAGS="--xla_force_host_platform_device_count=4") for i in (0, 1)]
        try:
            for p in procs:
                p.wait(timeout=90)
        finally:
            cli.stop(*procs)
    assert [p.returncode for p in procs] == [2, 2], (cli.err("mp0"), cli.err("mp1"))
    assert f"in use by pid {os.getpid()}" in cli.one_line(cli.err("mp0"))
    assert "process 0 of this run stopped with an error" in cli.one_line(cli.err("mp1"))
    assert not out.exists()  # the test's lock is released and the run wrote nothing
