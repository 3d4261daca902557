"""Damaged checkpoints are passed over (and, by train, moved aside, never deleted); a failed
save ends the run in bounded time with one line; a leftover half-written step blocks nothing."""

import glob
import os
import shutil
import subprocess
import time

import jax
import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.train.io.checkpoint import latest_step
from shardzoo.train.io.sources import load_model_and_params


def _truncate_arrays(run, step):
    files = glob.glob(str(run / "checkpoints" / str(step) / "state" / "ocdbt.process_0" / "d" / "*"))
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(10)


def _remove_manifest(run, step):
    os.remove(run / "checkpoints" / str(step) / "state" / "manifest.ocdbt")


@pytest.mark.parametrize("damage", [_truncate_arrays, _remove_manifest])
def test_a_truncated_newest_checkpoint_is_moved_aside_and_training_continues_from_the_one_before(
        cli, reference, run_copy, damage):
    """Its array files truncated, or the index of them gone (``state/manifest.ocdbt``: was "nothing
    to do" with the same --steps, and a traceback with more)."""
    damage(run_copy, 8)
    damaged = cli.snapshot(run_copy / "checkpoints" / "8")
    done = cli.train(run_copy)  # the same command as the reference's
    assert done.returncode == 0, done.stderr
    warning = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(warning) == 1 and warning[0].startswith("shardzoo: warning: checkpoint step 8 cannot "
                                                       "be restored (")
    assert "resuming from step 4" in warning[0] and "resumed from" in done.stdout
    assert cli.snapshot(run_copy / "damaged-checkpoints" / "8") == damaged  # moved, not deleted
    ref, got = cli.losses(reference), cli.losses(run_copy)
    assert [got[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]  # the same program: bitwise
    _assert_same_params(reference, run_copy)


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(load_model_and_params(str(a))[2]),
                    jax.tree.leaves(load_model_and_params(str(b))[2]), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("damage, says", [
    ("removed", "state/_METADATA is missing"),
    ("garbled", "state/_METADATA is not readable JSON (garbled)"),  # was "params do not match the model"
])
def test_generate_passes_over_a_damaged_step_and_leaves_the_run_as_it_is(cli, run_copy, capsys, damage, says):
    metadata = run_copy / "checkpoints" / "8" / "state" / "_METADATA"
    if damage == "removed":
        os.remove(metadata)
    else:
        metadata.write_text('{"tree_metadata": {"params": ')
    before = cli.snapshot(run_copy)
    capsys.readouterr()
    rc = main(["generate", "--checkpoint", str(run_copy), "--prompt", "the quick", "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "checkpoint step 8" in lines[0] and says in lines[0], lines
    assert "using step 4" in lines[0] and captured.out.startswith("the quick")
    assert cli.snapshot(run_copy) == before


def test_generate_on_an_empty_step_metadata_file_prints_its_one_line_only(cli, run_copy):
    """orbax logs ``ERROR:absl:Failed to json parse Metadata file`` each time it lists the steps
    (four times here, before the warning); the warning names the file. A subprocess: under
    pytest, absl's records go to pytest's log capture, not to stderr."""
    (run_copy / "checkpoints" / "8" / "_CHECKPOINT_METADATA").write_text("")
    done = cli.run("generate", "--checkpoint", run_copy, "--prompt", "the quick", "--max-new-tokens", "4",
                   XLA_FLAGS="--xla_force_host_platform_device_count=1")  # no cache-replication warnings
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (f"shardzoo: warning: checkpoint step 8 in {run_copy}/checkpoints cannot be "
                                   "restored (_CHECKPOINT_METADATA is empty); using step 4"), done.stderr
    assert done.stdout.startswith("the quick")


def test_export_hf_of_a_named_damaged_step_exits_2(cli, run_copy, tmp_path, capsys):
    _truncate_arrays(run_copy, 8)
    capsys.readouterr()
    rc = main(["export-hf", str(run_copy), str(tmp_path / "hf"), "--step", "8"])
    line = cli.one_line(capsys.readouterr().err, "export-hf")
    assert rc == 2 and "checkpoints/8 cannot be restored" in line and "OUT_OF_RANGE" in line, line
    assert not (tmp_path / "hf").exists()


def test_init_from_a_run_with_a_damaged_newest_step_uses_the_one_before(cli, run_copy, tmp_path, capsys):
    _truncate_arrays(run_copy, 8)
    before = cli.snapshot(run_copy)
    capsys.readouterr()
    rc = main(cli.args(tmp_path / "fine-tune", 1, "--init-from", str(run_copy)))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "checkpoint step 8" in lines[0] and "using step 4" in lines[0]
    assert latest_step(str(tmp_path / "fine-tune" / "checkpoints")) == 1
    assert cli.snapshot(run_copy) == before


def test_a_run_without_a_restorable_step_exits_2_naming_the_directory(cli, run_copy, capsys):
    for step in (4, 8):
        os.remove(run_copy / "checkpoints" / str(step) / "_CHECKPOINT_METADATA")
    before = cli.snapshot(run_copy)
    capsys.readouterr()
    rc = main(cli.args(run_copy, 12))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and f"{run_copy}/checkpoints: no checkpoint can be restored" in line, line
    assert "step 8: _CHECKPOINT_METADATA is missing" in line
    assert cli.snapshot(run_copy) == before


def test_a_leftover_half_written_step_does_not_block_the_next_run(cli, run_copy):
    shutil.rmtree(run_copy / "checkpoints" / "8")
    tmp = run_copy / "checkpoints" / "8.orbax-checkpoint-tmp-1700000000"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "junk").write_bytes(b"\0" * 100)
    done = cli.train(run_copy)
    assert done.returncode == 0, done.stderr
    assert latest_step(str(run_copy / "checkpoints")) == 8


def test_a_save_that_fails_on_a_full_disk_exits_1_within_60_s(cli, reference, tmp_path, unshare):
    """The run sits on a tmpfs with room for what it holds plus 200 KiB: the save of step 8
    (~800 KiB) fails; the process ends with one line, and step 4 stays as it was."""
    half = tmp_path / "half"
    shutil.copytree(reference, half)
    shutil.rmtree(half / "checkpoints" / "8")
    step4 = cli.snapshot(half / "checkpoints" / "4")
    size_kib = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(half) for n in ns) // 1024
    size_kib += 4 * sum(len(ns) + len(ds) for _, ds, ns in os.walk(half)) + 200  # a page per entry
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    command = " ".join(f"'{a}'" for a in cli.cmd(*cli.args(run)))
    script = (f"mount -t tmpfs -o size={size_kib}k tmpfs {disk} && cp -r {half} {run} && "
              f"{command}; status=$?; cp -r {run} {tmp_path / 'after'}; exit $status")
    started = time.monotonic()
    done = subprocess.run([*unshare, script], env=cli.env(), capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    line = cli.one_line(done.stderr)
    assert "saving checkpoint step 8" in line and "No space left on device" in line, line
    assert "steps 4) are intact" in line
    assert elapsed < 60, f"{elapsed:.0f}s"
    assert cli.snapshot(tmp_path / "after" / "checkpoints" / "4") == step4
    assert latest_step(str(tmp_path / "after" / "checkpoints")) == 4
