"""Ctrl-C saves the current step and exits 130 with one line, and the resume ends bit-identical
to an uninterrupted run; a second Ctrl-C aborts at once without saving."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from shardzoo.train.io.checkpoint import latest_step
from shardzoo.train.io.sources import load_model_and_params


def test_a_second_ctrl_c_aborts_at_once_without_saving(cli, tmp_path):
    """Steps take 3 s (the delay before each batch): both signals land within one step, so the
    second one finds the run still on its way to the save the first one asked for."""
    out = tmp_path / "aborted"
    proc = cli.start("sigint2", *cli.args(out), SZ_TEST_STEP_DELAY="3")
    try:
        cli.wait_for(lambda: cli.logged_step(out) >= 1, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130, cli.err("sigint2")
    finally:
        cli.stop(proc)
    lines = [line for line in cli.err("sigint2").splitlines() if line.strip()]
    assert lines[-1] == "shardzoo train: interrupted (Ctrl-C); nothing more was saved", lines
    assert latest_step(str(out / "checkpoints")) is None  # no save at step 1 or 2


def test_ctrl_c_at_each_phase_of_a_run_ends_within_10_s_with_one_line_and_the_run_resumes(cli, reference, tmp_path):
    """Ctrl-C at one moment of each phase of a run (8 steps of 0.3 s, a save every 2 steps).
    Before its loop: 0.5 s after the start (the interpreter's start-up), halfway to the moment
    the loop runs took the lock (jax and shardzoo importing), 0.1 s after the lock appears (the
    data read and tokenized under a --out this command created) and as run.json appears (the
    model built and its step compiled). In its loop: 0.1 s after it logged step 1 (in step 2),
    as it logged step 4 (in that step's log and save) and 0.2 s after it logged step 6 (in step 7).
    Each process ends within 10 s with exit 130 and one line, never a crash. Before the loop
    nothing is saved (the run directory is as a resume expects it); in it, the step it was at
    (the last it logged) is saved. The run.json moment and the loop's three are one run: each
    is the same command resuming what the one before left (one process a moment, and every
    resume but the first from the step the one before saved), and the last resume trains it to
    its end bit-identical to the uninterrupted ``reference`` (its losses and parameters)."""
    delay = dict(SZ_TEST_STEP_DELAY="0.3")
    logged = [(1, 0.1), (4, 0.0), (6, 0.2)]  # (logged step to wait for, then seconds)
    lock_s = []  # from the start to the lock, in the runs that reach run.json
    chain = tmp_path / "chain"  # the run the run.json moment starts and the loop's moments resume
    moments = [("start", "run.json")] + [("loop", m) for m in logged] + [("start", s) for s in ("0.5 s", "halfway", "lock")]
    kinds, saved, want = [], None, jax.tree.leaves(load_model_and_params(str(reference))[2])
    for k, (phase, moment) in enumerate(moments):
        out = chain if phase == "loop" or moment == "run.json" else tmp_path / f"run{k}"
        name = f"ctrl_c_{k}"
        assert not (out / ".shardzoo.lock").exists(), f"moment {k}: the lock of the one before is left"
        started = time.monotonic()
        proc = cli.start(name, *cli.args(out, 8, "--save-every", "2"), **delay)
        try:
            if phase == "loop":
                step, wait = moment
                cli.wait_for(lambda out=out: (out / ".shardzoo.lock").exists(), proc)
                lock_s.append(time.monotonic() - started)
                cli.wait_for(lambda out=out, step=step: cli.logged_step(out) >= step, proc)
                time.sleep(wait)
            elif moment in ("0.5 s", "halfway"):
                time.sleep(0.5 if moment == "0.5 s" else min(lock_s) / 2)
                assert not out.exists(), f"moment {k} ({moment}): the lock was taken already"
            else:  # 0.1 s after the lock appears (not at once: between taking it and ``undone`` is no moment
                # a person can aim at), as run.json does
                lock = out / ".shardzoo.lock"
                cli.wait_for(lock.exists, proc, poll=0.005)
                lock_s.append(time.monotonic() - started)
                marker = lock if moment == "lock" else out / "run.json"
                cli.wait_for(marker.exists, proc, poll=0.005)
                time.sleep(0.1 if moment == "lock" else 0)
            proc.send_signal(signal.SIGINT)
            sent = time.monotonic()
            rc = proc.wait(timeout=60)
            took = time.monotonic() - sent
        finally:
            cli.stop(proc)
        err = cli.err(name)
        assert rc == 130, f"moment {k} ({phase} {moment}): exit {rc}\n{err}"
        assert took < 10, f"moment {k}: {took:.1f} s"
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, f"moment {k}:\n{err}"
        if phase == "loop" and saved is not None:  # this process was the same command resuming
            assert f"resumed from {out}/checkpoints/{saved}" in (cli.root / f"{name}.out").read_text(), f"moment {k}"
        if lines[0] == "shardzoo train: interrupted (Ctrl-C); nothing more was saved":
            kinds.append("before the loop")
            assert not (out / "checkpoints").exists() or latest_step(str(out / "checkpoints")) is None
            # the --out it created is gone unless the run wrote its files there (no empty dir, no lock)
            assert not out.exists() or (out / "run.json").exists() and not (out / ".shardzoo.lock").exists()
            # else the same command is a fresh run into a new --out, as ``reference``
            assert out.exists() == (out == chain), f"moment {k}"
        else:
            saved = latest_step(str(out / "checkpoints"))
            assert lines[0] == (f"shardzoo train: interrupted: saved step {saved} to {out}/checkpoints/{saved}; "
                                "run the same command to resume"), lines[0]
            assert phase == "start" or saved == cli.logged_step(out) >= moment[0]  # the step it was at
            kinds.append(f"saved {saved}")
    resumed = cli.train(chain, 8, "--save-every", "2")  # the same command, to the run's end
    assert resumed.returncode == 0, f"the resume failed\n{resumed.stderr}"
    assert latest_step(str(chain / "checkpoints")) == 8
    assert f"resumed from {chain}/checkpoints/{saved}" in resumed.stdout, resumed.stdout
    assert cli.losses(chain) == cli.losses(reference)  # the same program: bitwise
    for a, b in zip(want, jax.tree.leaves(load_model_and_params(str(chain))[2]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # the start-up moments before run.json reach before the loop, and the loop's three saved three steps
    assert kinds[0] == "before the loop" and kinds[4:] == ["before the loop"] * 3, kinds
    assert len(set(kinds[1:4])) == 3 and all(kind.startswith("saved") for kind in kinds[1:4]), kinds


def _pipeline(cli, out, name, stderr, **env):
    """``train`` into ``| tee``, both in one new process group (a shell's foreground job); returns
    (train, tee)."""
    proc = subprocess.Popen(cli.cmd(*cli.args(out)), env=cli.env(SZ_TEST_STEP_DELAY="0.3", **env),
                            stdout=subprocess.PIPE, process_group=0, **stderr)
    tee_with_ctrl_c = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execvp('tee', ['tee', sys.argv[1]])")  # even where the test's SIGINT is ignored
    tee = subprocess.Popen([sys.executable, "-c", tee_with_ctrl_c, str(cli.root / f"{name}.log")], stdin=proc.stdout,
                           stdout=subprocess.DEVNULL, process_group=proc.pid)
    proc.stdout.close()  # the pipe's reader is tee alone
    return proc, tee


def test_ctrl_c_through_a_pipe_whose_reader_dies_with_it_saves_and_resumes(cli, reference, tmp_path):
    """``train 2>&1 | tee log``, Ctrl-C to the whole job: tee dies of the same SIGINT, so every
    line the run prints after it (the save's) goes to a closed pipe; the save must not depend on
    them. Then ``train | head -1`` with stderr closed (``2>&-``): head leaves after one line and the
    run trains on to its end."""
    out = tmp_path / "tee"
    proc, tee = _pipeline(cli, out, "tee", dict(stderr=subprocess.STDOUT))
    try:
        cli.wait_for(lambda: cli.logged_step(out) >= 5, proc)
        os.killpg(proc.pid, signal.SIGINT)
        assert tee.wait(timeout=30) != 0  # killed by the signal: the pipe has no reader
        assert proc.wait(timeout=120) == 130
    finally:
        cli.stop(proc, tee)
    saved = latest_step(str(out / "checkpoints"))
    assert saved == cli.logged_step(out) and saved >= 5
    done = cli.train(out)  # the same command resumes
    assert done.returncode == 0, done.stderr
    assert f"resumed from {out}/checkpoints/{saved}" in done.stdout
    assert cli.losses(out) == cli.losses(reference)

    out = tmp_path / "head"
    closed_stderr = ["sh", "-c", 'exec "$@" 2>&-', "sh", *cli.cmd(*cli.args(out))]
    proc = subprocess.Popen(closed_stderr, env=cli.env(), stdout=subprocess.PIPE)
    head = subprocess.run(["head", "-1"], stdin=proc.stdout, capture_output=True, text=True, timeout=300)
    proc.stdout.close()
    try:
        assert proc.wait(timeout=300) == 0
    finally:
        cli.stop(proc)
    assert len(head.stdout.splitlines()) == 1
    assert latest_step(str(out / "checkpoints")) == 8 and cli.losses(out) == cli.losses(reference)


def test_ctrl_c_at_start_up_removes_the_out_this_command_created(cli, tmp_path):
    """What ``train`` does between taking the lock on a new --out and writing run.json there
    (``launch.run``), held open: the Ctrl-C that ends the process removes that empty directory
    and its lock (was: an empty --out left behind); a directory that was there stays."""
    script = ("import sys, time\n"
              "from shardzoo import interrupt\n"
              "interrupt.watch('train')\n"
              "from shardzoo.train.io.rundir import DirLock\n"
              "lock = DirLock(sys.argv[1])\n"
              "lock.acquire()\n"
              "with interrupt.undone(lock.release):\n"
              "    print('locked', flush=True)\n"
              "    time.sleep(60)\n")
    existing = tmp_path / "existing"
    existing.mkdir()
    for out in (tmp_path / "new" / "run", existing):
        proc = subprocess.Popen([sys.executable, "-c", script, str(out)], env=cli.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "locked\n"
            assert (out / ".shardzoo.lock").exists()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 130
        finally:
            cli.stop(proc)
        assert proc.stderr.read() == "shardzoo train: interrupted (Ctrl-C); nothing more was saved\n"
        assert not (out / ".shardzoo.lock").exists()
    assert not (tmp_path / "new").exists() and existing.is_dir()
