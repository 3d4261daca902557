"""Ctrl-C saves the current step and exits 130 with one line, and the resume ends bit-identical
to an uninterrupted run; a second Ctrl-C aborts at once without saving."""

import signal
import time

import jax
import numpy as np

from shardzoo.train.checkpoint import latest_step, load_model_and_params


def test_ctrl_c_saves_exits_130_and_the_resume_is_bit_identical(cli, reference, tmp_path):
    out = tmp_path / "interrupted"
    proc = cli.start("sigint", *cli.args(out), SZ_TEST_STEP_DELAY="0.3")
    try:
        cli.wait_for(lambda: cli.logged_step(out) >= 5, proc)  # past checkpoint 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, cli.err("sigint")
    finally:
        cli.stop(proc)
    saved = latest_step(str(out / "checkpoints"))
    line = cli.one_line(cli.err("sigint"), kind="interrupted")
    assert f"saved step {saved} to {out}/checkpoints/{saved}; run the same command to resume" in line
    assert saved == cli.logged_step(out) and 5 <= saved < 8  # the step it was at, not checkpoint 4

    done = cli.train(out)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {out}/checkpoints/{saved}" in done.stdout
    assert cli.losses(out) == cli.losses(reference)  # the same program: bitwise
    for a, b in zip(jax.tree.leaves(load_model_and_params(str(reference))[2]),
                    jax.tree.leaves(load_model_and_params(str(out))[2]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


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
