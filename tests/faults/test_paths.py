"""Paths that name the wrong thing end in one line where they enter, and change nothing: an
--out inside a run's checkpoints, a garbled run.json, a missing --hf dir, a directory that is no
model, /dev/null as data; metrics of no checkpoint are set aside, not a refusal; and export-lora
follows the readers' rule (the newest step that restores)."""

import os
import shutil

import pytest

from shardzoo.cli import main


def _refused(cli, capsys, argv, command="train"):
    """Run ``argv`` in-process: its exit status must be 2 and stderr one line; return the line."""
    capsys.readouterr()
    rc = main(argv)
    line = cli.one_line(capsys.readouterr().err, command)
    assert rc == 2, line
    return line


@pytest.mark.parametrize("where", ["checkpoints/8", "checkpoints", "checkpoints/8/state"])
def test_out_at_a_runs_checkpoint_is_refused_before_anything_is_written(cli, run_copy, where, capsys):
    before = cli.snapshot(run_copy)
    line = _refused(cli, capsys, cli.args(run_copy / where, 12))
    assert f"--out {run_copy / where} is" in line and f"of the run {run_copy}" in line, line
    assert f"resume that run with --out {run_copy}" in line
    assert cli.snapshot(run_copy) == before


def test_metrics_of_no_checkpoint_are_set_aside_and_the_run_starts(cli, run_copy, capsys):
    """A run whose first save failed, that was killed before it, or whose checkpoints were deleted
    holds metrics.jsonl rows that belong to no checkpoint: the same command keeps them as
    metrics.jsonl.orphaned-TIME, says so in one line, and trains (was: refused, exit 2);
    ``--restart`` starts metrics.jsonl over instead."""
    for step in (4, 8):
        shutil.rmtree(run_copy / "checkpoints" / str(step))
    logged = (run_copy / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(cli.args(run_copy, 1)) == 0
    captured = capsys.readouterr()
    (orphaned,) = run_copy.glob("metrics.jsonl.orphaned-*")
    assert orphaned.read_bytes() == logged  # kept whole
    assert f"{run_copy}/metrics.jsonl held steps up to 8 but no checkpoint they belong to: moved it to " \
        f"{orphaned}; training from step 0" in captured.out.splitlines(), captured.out
    assert sorted(cli.losses(run_copy)) == [1]
    shutil.rmtree(run_copy / "checkpoints" / "1")
    assert main(cli.args(run_copy, 1, "--restart")) == 0  # asked for: it starts over, nothing set aside
    assert sorted(cli.losses(run_copy)) == [1] and len(list(run_copy.glob("metrics.jsonl.orphaned-*"))) == 1


def test_a_garbled_run_json_is_reported_as_garbled(cli, run_copy, capsys):
    (run_copy / "run.json").write_text('{"model": "llama-tiny", "sett')
    before = cli.snapshot(run_copy)
    line = _refused(cli, capsys, cli.args(run_copy, 12))
    assert f"{run_copy}/run.json is garbled (not JSON: " in line and "not a shardzoo run" not in line, line
    line = _refused(cli, capsys, ["eval", "--checkpoint", str(run_copy)], "eval")
    assert f"{run_copy}/run.json is garbled" in line, line
    assert cli.snapshot(run_copy) == before


def test_a_missing_hf_dir_is_reported_missing(cli, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    before = cli.snapshot(tmp_path)
    line = _refused(cli, capsys, ["generate", "--hf", str(missing), "--prompt", "hi"], "generate")
    assert line.endswith(f"--hf {missing}: no such directory"), line
    line = _refused(cli, capsys, ["eval", "--hf", str(missing), "--data", str(cli.corpus)], "eval")
    assert line.endswith(f"--hf {missing}: no such directory"), line
    assert cli.snapshot(tmp_path) == before and not missing.exists()


def test_init_from_a_directory_that_is_no_model_or_a_run_without_checkpoints(cli, reference, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    shutil.copy(reference / "run.json", empty_run / "run.json")
    before = cli.snapshot(tmp_path)
    line = _refused(cli, capsys, cli.args(tmp_path / "new", 1, "--init-from", str(notes)))
    assert f"--init-from {notes} is a directory but not a Hugging Face model directory (no config.json" \
        in line and "a shardzoo run (no checkpoints/)" in line, line
    line = _refused(cli, capsys, cli.args(tmp_path / "new", 1, "--init-from", str(empty_run)))
    assert f"--init-from {empty_run} is a shardzoo run without a finished checkpoint" in line, line
    assert cli.snapshot(tmp_path) == before and not (tmp_path / "new").exists()


def test_data_dev_null_is_not_called_missing(cli, tmp_path, capsys):
    out = tmp_path / "never"
    argv = cli.args(out, 4)
    argv[argv.index("--data") + 1] = os.devnull
    line = _refused(cli, capsys, argv)
    assert "data '/dev/null' is a character device, not a data file" in line, line
    assert "does not exist" not in line and not out.exists()


@pytest.fixture(scope="module")
def lora_run(reference, tmp_path_factory, cli):
    """A LoRA run on the reference (checkpoints 1 and 2). Never modified: copy it."""
    out = tmp_path_factory.mktemp("lora") / "run"
    assert main(cli.args(out, 2, "--init-from", str(reference), "--lora-rank", "2", "--save-every", "1")) == 0
    return out


def test_export_lora_passes_over_a_damaged_newest_step(cli, lora_run, tmp_path, capsys):
    run = tmp_path / "lora"
    shutil.copytree(lora_run, run)
    os.remove(run / "checkpoints" / "2" / "state" / "_METADATA")
    before = cli.snapshot(run)
    capsys.readouterr()
    rc = main(["export-lora", str(run), str(tmp_path / "peft")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardzoo: warning: checkpoint step 2"), captured.err
    assert "state/_METADATA is missing" in lines[0] and "using step 1" in lines[0]
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert cli.snapshot(run) == before
    line = _refused(cli, capsys, ["export-lora", str(run), str(tmp_path / "peft8"), "--step", "2"], "export-lora")
    assert "checkpoints/2 cannot be restored: state/_METADATA is missing" in line, line
    assert not (tmp_path / "peft8").exists() and cli.snapshot(run) == before
